"""Signed policy versions: the trainer's Ed25519 key, the manifest it signs, and the island's check.

Who may publish the weights an island serves is decided by a key, not by who can write to the log
or the bucket: the trainer signs each version's manifest (`schemas/version_manifest.py` names the
exact bytes), and an island pinned to the trainer's public key refuses a version that is unsigned,
signed by another key, or whose signed fields (root hash per view, every blob's uri and sha256,
the lineage digest, the version number) differ from what was signed. The blob digests are then what
the materializer checks every downloaded byte against, so a rewritten object is refused too.

Keys: a PEM private key file for the trainer (created 0600 by `ensure_signing_key`), and the public
key as PEM or as base64 of its 32 raw bytes for islands (`SPRAWL_TRUST__VERSION_PUBLIC_KEY`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from pipeline.config import TrustSettings
from pipeline.errors import SprawlError
from pipeline.logs import get_logger
from schemas import PolicyVersion, VersionSignature
from schemas.version_manifest import (
    MANIFEST_FORMAT,
    SIGNED_PREFIX,
    ManifestBlob,
    ManifestSkipPatch,
    ManifestView,
    VersionManifest,
)

log = get_logger(__name__)

PUBLIC_KEY_SETTING = "SPRAWL_TRUST__VERSION_PUBLIC_KEY"
SIGNING_KEY_SETTING = "SPRAWL_TRUST__SIGNING_KEY_FILE"
UNSIGNED_SETTING = "SPRAWL_TRUST__ALLOW_UNSIGNED_VERSIONS"


class VersionSignatureInvalid(SprawlError):
    """An island refuses this version: it must not serve a single token of it."""

    def __init__(self, version: int, reason: str):
        self.version, self.reason = version, reason
        super().__init__(
            f"policy version {version} refused: {reason}",
            hint="the island keeps serving its last good version; check who published it and with which key",
        )


class TrustNotConfigured(SprawlError):
    """A worker that would publish or serve versions has no key and was not told to go without."""


class KeyUnreadable(SprawlError):
    """A configured key cannot be read or is not an Ed25519 key."""


# ---------------------------------------------------------------- keys


def generate_signing_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def save_signing_key(key: Ed25519PrivateKey, path: Path) -> None:
    """Write the private key as PEM, readable by its owner only; an existing file is never overwritten
    (a second trainer's key would orphan every island pinned to the first)."""
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # created 0600: never readable in between
    with os.fdopen(fd, "wb") as f:
        f.write(pem)


def load_signing_key(path: Path) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise KeyUnreadable(
            f"cannot read the version-signing key {path}: {exc}",
            hint=f"{SIGNING_KEY_SETTING} must name an unencrypted Ed25519 PEM private key",
        ) from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyUnreadable(
            f"{path} is a {type(key).__name__}, not an Ed25519 key", hint=f"check {SIGNING_KEY_SETTING}"
        )
    return key


def ensure_signing_key(path: Path) -> str:
    """The public key text of the signing key at `path`, creating the key (PEM, 0600) if it is missing:
    what `sprawl up` gives the trainer (`signing_key_file`) and the islands (`version_public_key`)."""
    path = Path(path)
    if not path.exists():
        try:
            save_signing_key(generate_signing_key(), path)
            log.info("created a version-signing key", path=str(path))
        except FileExistsError:
            pass  # another process created it first: use theirs
    return public_key_text(load_signing_key(path))


def public_key_text(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """The public key as PEM (SubjectPublicKeyInfo): what islands pin."""
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()


def load_public_key(text: str) -> Ed25519PublicKey:
    """A public key from PEM or from base64 of its 32 raw bytes."""
    text = text.strip()
    try:
        if text.startswith("-----BEGIN"):
            key = serialization.load_pem_public_key(text.encode())
        else:
            key = Ed25519PublicKey.from_public_bytes(base64.b64decode(text, validate=True))
    except (ValueError, TypeError, binascii.Error) as exc:
        raise KeyUnreadable(
            f"the pinned version key is not a public key: {exc}",
            hint=f"{PUBLIC_KEY_SETTING} takes a PEM public key or base64 of the 32 raw Ed25519 bytes",
        ) from exc
    if not isinstance(key, Ed25519PublicKey):
        raise KeyUnreadable(f"the pinned version key is a {type(key).__name__}", hint=f"{PUBLIC_KEY_SETTING}: Ed25519")
    return key


def key_id(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """A short name of a key: the first 16 hex of the SHA-256 of its raw public bytes."""
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


# ---------------------------------------------------------------- the manifest


def version_manifest(event: PolicyVersion) -> VersionManifest:
    def blobs(pointers) -> list[ManifestBlob]:
        return [ManifestBlob(uri=b.uri, sha256=b.sha256, bytes=b.bytes, name=b.name) for b in pointers]

    return VersionManifest(
        format=MANIFEST_FORMAT,
        run_id=event.run_id,
        version=event.version,
        parent_version=event.parent_version,
        trainer_step=event.trainer_step,
        lineage_uri=event.lineage_uri,
        lineage_sha256=event.lineage_sha256,
        views=[
            ManifestView(
                view=v.view,
                kind=v.kind,
                base_version=v.base_version,
                root_hash=v.root_hash,
                blobs=blobs(v.blobs),
                skip_patches=[
                    ManifestSkipPatch(base_version=s.base_version, blobs=blobs(s.blobs)) for s in v.skip_patches
                ],
            )
            for v in event.views
        ],
    )


def signed_bytes(event: PolicyVersion) -> bytes:
    """Exactly what the signature covers (documented in `schemas/version_manifest.py`)."""
    return SIGNED_PREFIX + msgspec.json.encode(version_manifest(event))


def sign_version(event: PolicyVersion, key: Ed25519PrivateKey) -> PolicyVersion:
    signature = VersionSignature(key_id=key_id(key), signature=key.sign(signed_bytes(event)))
    return msgspec.structs.replace(event, signature=signature)


def verify_version(event: PolicyVersion, public_key: Ed25519PublicKey) -> None:
    """Raise VersionSignatureInvalid unless `public_key` signed this version's manifest and each view's
    tensor digests hash to its signed root hash."""
    signature = event.signature
    if signature is None:
        raise VersionSignatureInvalid(event.version, "unsigned")
    pinned = key_id(public_key)
    if signature.algorithm != "ed25519":
        raise VersionSignatureInvalid(event.version, f"signed with {signature.algorithm}, islands accept ed25519")
    if signature.key_id != pinned:
        raise VersionSignatureInvalid(event.version, f"signed by key {signature.key_id}, pinned {pinned}")
    try:
        public_key.verify(signature.signature, signed_bytes(event))
    except InvalidSignature:
        raise VersionSignatureInvalid(event.version, "signature does not match the manifest") from None
    from pipeline.bits import root_hash  # torch: only where versions are materialized anyway

    for view in event.views:
        recomputed = root_hash([(t.name, t.dtype, tuple(t.shape), t.xxh3) for t in view.tensors])
        if recomputed != view.root_hash:
            raise VersionSignatureInvalid(
                event.version,
                f"view {view.view}'s tensor digests hash to {recomputed}, the signed root is {view.root_hash}",
            )


# ---------------------------------------------------------------- what a worker does with its settings


@dataclass(frozen=True)
class VersionTrust:
    """What an island accepts: versions signed by `public_key`, or (None, an explicit opt-out) any."""

    public_key: Ed25519PublicKey | None

    @property
    def key_id(self) -> str | None:
        return key_id(self.public_key) if self.public_key is not None else None

    def check(self, event: PolicyVersion) -> None:
        if self.public_key is not None:
            verify_version(event, self.public_key)


def island_trust(settings: TrustSettings) -> VersionTrust:
    """The pinned key an island verifies with; refuses to start with neither a key nor the opt-out."""
    if settings.version_public_key:
        return VersionTrust(load_public_key(settings.version_public_key))
    if not settings.allow_unsigned_versions:
        raise TrustNotConfigured(
            "no version public key is pinned: this island cannot tell the trainer's versions from forged ones",
            hint=f"set {PUBLIC_KEY_SETTING} to the trainer's public key (or, on a closed test fleet only, "
            f"{UNSIGNED_SETTING}=true)",
        )
    log.warning(
        "SERVING UNSIGNED POLICY VERSIONS: no version key is pinned, so anyone who can write to the log or the "
        "bucket decides the weights this island serves",
        setting=UNSIGNED_SETTING,
    )
    return VersionTrust(None)


def trainer_signing_key(settings: TrustSettings) -> Ed25519PrivateKey | None:
    """The key the trainer signs with; None only under the explicit opt-out (with a loud warning)."""
    if settings.signing_key_file is not None:
        return load_signing_key(settings.signing_key_file)
    if not settings.allow_unsigned_versions:
        raise TrustNotConfigured(
            "no version-signing key is configured: islands pinned to a key would refuse every version",
            hint=f"set {SIGNING_KEY_SETTING} to an Ed25519 PEM key (`ensure_signing_key` creates one), or on a "
            f"closed test fleet only {UNSIGNED_SETTING}=true",
        )
    log.warning("PUBLISHING UNSIGNED POLICY VERSIONS: no signing key is configured", setting=UNSIGNED_SETTING)
    return None
