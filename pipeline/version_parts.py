"""One policy version published by several ranks: each rank's part, and joining the parts into views.

Each rank publishes the units of the publish layout it owns (`pipeline/publish_layout.py`): their
shard files (keyframe) or patches, and skip patches, already in the blob store. What it hands rank 0
is a `VersionPart`: blob pointers and digests, no tensors (it travels through `all_gather_object`).
Rank 0 checks that the parts make one whole version (`join_parts`) and turns each view's units into
the `ViewVersion` a single-process publisher would have written (`view_version`): the same digests
in name order, the same root hash, the shard blobs in file order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import msgspec

from pipeline.bits import root_hash
from pipeline.errors import SprawlError
from pipeline.publish_layout import PublishLayout
from schemas import BlobPointer, SkipPatch, TensorDigest, ViewVersion


class UnitSkip(msgspec.Struct, frozen=True, kw_only=True):
    """One unit's share of a skip patch base_version -> this version."""

    base_version: int
    blob: BlobPointer
    changed_elements: int


class UnitView(msgspec.Struct, frozen=True, kw_only=True):
    """One unit of one view, as its rank published it."""

    unit: int
    blob: BlobPointer
    """Keyframe: the unit's shard file. Patch: its patch from the previous version. Named by the shard file."""
    tensors: list[TensorDigest]
    """The unit's served tensors, sorted by name, with their changed-element counts."""
    tensor_bytes: int
    """Bytes of those tensors (the index's `total_size` adds them up)."""
    skips: list[UnitSkip] = []


class ViewPart(msgspec.Struct, frozen=True, kw_only=True):
    view: str
    kind: Literal["keyframe", "patch"]
    units: list[UnitView]
    """In unit order."""


class VersionPart(msgspec.Struct, frozen=True, kw_only=True):
    """What one rank published of a version: small and picklable (pointers and digests, no tensors)."""

    version: int
    rank: int
    world_size: int
    writer_id: str
    """The blob key prefix's writer: one id for every rank of a version."""
    layout_id: str
    units: list[int]
    views: list[ViewPart]
    """In the publisher's view order."""


class PartsInconsistent(SprawlError):
    def __init__(self, version: int, problem: str):
        super().__init__(
            f"the parts of version {version} do not make one version: {problem}; nothing was appended",
            hint="every rank of one world publishes the same version with the same layout, writer id and "
            "agreed keyframe decision, and rank 0 gets every rank's part exactly once",
        )


def join_parts(
    parts: Sequence[VersionPart], *, version: int, views: Sequence[str], layout: PublishLayout, writer_id: str
) -> dict[str, tuple[str, list[UnitView]]]:
    """Check that `parts` are one complete, consistent version; returns per view its kind and every
    unit, in unit order. Raises PartsInconsistent, naming the first problem found."""

    def refuse(problem: str) -> PartsInconsistent:
        return PartsInconsistent(version, problem)

    if not parts:
        raise refuse("no parts")
    for field, want in (("version", version), ("writer_id", writer_id), ("layout_id", layout.layout_id)):
        got = sorted({str(getattr(p, field)) for p in parts})
        if got != [str(want)]:
            raise refuse(f"{field} {', '.join(got)} where this publisher has {want}")
    sizes = sorted({p.world_size for p in parts})
    if len(sizes) != 1:
        raise refuse(f"world sizes {sizes} differ")
    ranks = sorted(p.rank for p in parts)
    if ranks != list(range(sizes[0])):
        raise refuse(f"ranks {ranks} are not each of 0..{sizes[0] - 1} exactly once")
    units = sorted(u for p in parts for u in p.units)
    if units != list(range(layout.count)):
        duplicated = sorted({u for u in units if units.count(u) > 1})
        missing = sorted(set(range(layout.count)) - set(units))
        raise refuse(f"units {layout.count} in the layout; duplicated {duplicated}, missing {missing}")
    for part in parts:
        if [v.view for v in part.views] != list(views):
            raise refuse(f"rank {part.rank}'s views are {[v.view for v in part.views]}, not {list(views)}")
    joined: dict[str, tuple[str, list[UnitView]]] = {}
    for index, name in enumerate(views):
        entries = [p.views[index] for p in parts]
        kinds = sorted({e.kind for e in entries})
        if len(kinds) != 1:
            raise refuse(f"view {name} is a {' and a '.join(kinds)} in different parts")
        for part, entry in zip(parts, entries, strict=True):
            if [u.unit for u in entry.units] != sorted(part.units):
                raise refuse(f"rank {part.rank}'s view {name} holds units {[u.unit for u in entry.units]}, not its own")
        unit_views = sorted((u for e in entries for u in e.units), key=lambda u: u.unit)
        for unit in unit_views:
            if unit.blob.name != (file := layout.shard_file(unit.unit)):
                raise refuse(f"unit {unit.unit}'s blob is named {unit.blob.name!r}, not {file!r}")
        names = [t.name for u in unit_views for t in u.tensors]
        if len(set(names)) != len(names):
            raise refuse(f"view {name} has tensors in two units")
        joined[name] = (kinds[0], unit_views)
    return joined


def weight_map(units: Sequence[UnitView], layout: PublishLayout) -> dict[str, str]:
    """Served tensor name -> its shard file, sorted by name (the keyframe index's map)."""
    return dict(sorted((t.name, layout.shard_file(u.unit)) for u in units for t in u.tensors))


def view_version(
    view: str,
    kind: Literal["keyframe", "patch"],
    version: int,
    units: Sequence[UnitView],
    *,
    metadata_blobs: Sequence[BlobPointer] = (),
) -> ViewVersion:
    """The view's entry of the event, from all its units (in unit order). `metadata_blobs`: a keyframe's
    index, config and extra files, listed after its shards. A skip patch is listed only where every unit
    has its share (a partial one could not be applied); in order of distance, nearest first."""
    digests = sorted((t for u in units for t in u.tensors), key=lambda t: t.name)
    blobs = [*(u.blob for u in units), *metadata_blobs]
    bases = sorted({s.base_version for u in units for s in u.skips}, reverse=True)
    skips = []
    for base in bases:
        shares = [next((s for s in u.skips if s.base_version == base), None) for u in units]
        if any(s is None for s in shares):
            continue
        complete = [s for s in shares if s is not None]
        skips.append(
            SkipPatch(
                base_version=base,
                blobs=[s.blob for s in complete],
                bytes=sum(s.blob.bytes for s in complete),
                changed_elements=sum(s.changed_elements for s in complete),
            )
        )
    return ViewVersion(
        view=view,
        kind=kind,
        base_version=None if kind == "keyframe" else version - 1,
        blobs=blobs,
        tensors=digests,
        root_hash=root_hash([(d.name, d.dtype, tuple(d.shape), d.xxh3) for d in digests]),
        bytes=sum(b.bytes for b in blobs),
        changed_elements=sum(d.changed for d in digests),
        total_elements=sum(math.prod(d.shape) for d in digests),
        skip_patches=skips,
    )
