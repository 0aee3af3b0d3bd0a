"""The signed manifest of a policy version: exactly the fields an island must be able to trust.

The trainer signs, and an island verifies, the bytes

    b"sprawl.version-manifest.v1\\n" + msgspec.json.encode(VersionManifest(...))

that is: the domain prefix (so these bytes can never be mistaken for another signed message), then
the manifest as compact JSON (no whitespace), object keys in the order the fields are declared
below, nested objects likewise, lists in the event's order, integers without a fraction, `null` for
None, strings UTF-8 with only `"`, `\\` and control characters escaped (every string here is ASCII in
practice: hex digests, URIs, tensor and file names). A client in another language rebuilds these
bytes from the PolicyVersion event (its `views`, `blobs`, `skip_patches`, `lineage_*` fields) and
checks the Ed25519 signature in `PolicyVersion.signature` over them.

The tensor digests are not listed (a version names thousands): the manifest carries each view's
`root_hash`, and a verifier recomputes the root hash from the event's `tensors` list (xxh3-128 over
`name\\0dtype\\0shape-joined-by-commas\\0xxh3\\n` per tensor, in name order) and refuses the version
if it differs, so the digests every materialized tensor is checked against are bound too.

A new field is a new manifest format (`.v2`), never an additive change: a verifier that decoded an
old event with a default for a new field would otherwise sign-check different bytes.
"""

from __future__ import annotations

from typing import Literal

import msgspec

MANIFEST_FORMAT = "sprawl.version-manifest.v1"
SIGNED_PREFIX = MANIFEST_FORMAT.encode() + b"\n"
"""What precedes the manifest's JSON in the signed bytes."""


class _Layout(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base: every field is required and every key known, so two encoders agree byte for byte."""


class ManifestBlob(_Layout):
    uri: str
    sha256: str
    bytes: int
    name: str


class ManifestSkipPatch(_Layout):
    base_version: int
    blobs: list[ManifestBlob]


class ManifestView(_Layout):
    view: str
    kind: Literal["keyframe", "patch"]
    base_version: int | None
    root_hash: str
    """Binds the event's `tensors` list: a verifier recomputes it from them."""
    blobs: list[ManifestBlob]
    skip_patches: list[ManifestSkipPatch]


class VersionManifest(_Layout):
    format: Literal["sprawl.version-manifest.v1"]
    run_id: str
    version: int
    parent_version: int | None
    trainer_step: int
    lineage_uri: str | None
    lineage_sha256: str | None
    views: list[ManifestView]
