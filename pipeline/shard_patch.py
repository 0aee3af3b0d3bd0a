"""Applying a route's patches to one safetensors shard on disk: in place, or rewritten when a patch
changes the shard's layout.

In place (the usual case: a patch keeps every tensor's dtype and shape): the shard is mapped and each
tensor's byte range handed to the codec, which writes only the positions that change
(`pipeline/safetensors_layout.py`). Where a patch changes a tensor's shape or dtype (or a tensor does
not lie aligned), the shard is loaded, patched in memory and written again whole.

Each patch's header is held against what is known before a byte of it is written: every base
checksum against the digest of the bits there now (`digests`, kept up to date step by step), every
target checksum against the target version's own digests. A disagreement is a `PatchRefused`. The
codec then checks each target it produces against the header; nothing else is hashed, and a tensor
the patch leaves unchanged keeps its digest without being read.
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline import patch_codec
from pipeline.bits import bits_dtype, dtype_name, from_bits, to_bits
from pipeline.errors import SprawlError
from pipeline.keyframe import load_shard
from pipeline.logs import get_logger
from pipeline.safetensors_layout import ShardLayout, mapped_tensors, read_layout

log = get_logger(__name__)


@dataclass(frozen=True)
class PatchStep:
    """One patch of a route, as it applies to this shard."""

    label: str
    """What it is, for messages: `patch v3->v4`."""
    header: patch_codec.PatchHeader
    payload: memoryview
    target_digests: dict[str, str]
    """The target version's xxh3 per tensor, from its (verified) event."""


class StepFailed(SprawlError):
    """A step of the route could not be applied; `step` is its index. Subclasses say why."""

    def __init__(self, step: int, message: str):
        self.step = step
        super().__init__(message, hint="the shard is left half-patched: drop the staging directory")


class PatchRefused(StepFailed):
    """The patch's header disagrees with the bits it applies to or with its target version's digests:
    refused before it wrote anything."""


class PatchUnreadable(StepFailed):
    """The codec could not decode the patch (damaged streams, a header that does not fit)."""


class WrongBits(StepFailed):
    """A tensor came out of the patch with bits other than the header's target: either the patch or
    the bits it was applied to are wrong."""

    def __init__(self, step: int, message: str, tensor: str):
        self.tensor = tensor
        self.from_start = True
        """No earlier step changed the tensor: its base bits are the shard's as it was given."""
        super().__init__(step, message)


@dataclass
class ShardPatched:
    in_place: bool
    touched_bytes: int
    """Bytes of the tensors some step changed (what an in-place apply may write)."""
    changed: set[str]
    """Tensors some step changed (`changed > 0` in its header): their new bits were hashed by the codec."""


def fits_in_place(layout: ShardLayout, header: patch_codec.PatchHeader) -> bool:
    """Can the patch be written into the file where it lies: every tensor it names keeps its dtype and
    shape (and lies aligned, as the codec's kernels want it)?"""
    for group in header.groups:
        if not group.has_base:
            return False
        for t in group.tensors:
            span = layout.tensors.get(t.name)
            if span is not None and (span.dtype != group.dtype or span.shape != tuple(t.shape) or not span.aligned):
                return False
    return True


def patch_shard(
    path: Path,
    steps: list[PatchStep],
    digests: dict[str, str],
    map_groups: Callable[[Callable, Iterable], Iterable] | Executor | None = None,
) -> ShardPatched:
    """Apply `steps` in order to the shard at `path`. `digests` (each tensor's xxh3 as the file is now)
    is updated to each step's targets. `map_groups`: an executor (or a `map`) to apply a patch's groups
    concurrently; they touch disjoint tensors."""
    layout = read_layout(path)
    mapper = map_groups.map if isinstance(map_groups, Executor) else (map_groups or map)
    changed: set[str] = set()

    def run(index: int, step: PatchStep, arrays: dict[str, np.ndarray], in_place: bool) -> None:
        try:
            changed.update(_apply_step(index, step, arrays, digests, mapper, in_place=in_place))
        except WrongBits as exc:
            exc.from_start = exc.tensor not in changed
            raise

    if all(fits_in_place(layout, step.header) for step in steps):
        with mapped_tensors(layout, writable=True) as mapped:
            for i, step in enumerate(steps):
                for name in _written_nearly_everywhere(step.header):
                    if name in mapped.arrays:
                        mapped.prefault_for_writes(name)
                run(i, step, mapped.arrays, True)
        return ShardPatched(True, sum(layout.tensors[n].nbytes for n in changed if n in layout.tensors), changed)
    log.info("a patch changes the shard's layout: rewriting it whole", shard=path.name)
    tensors = load_shard(path)
    arrays = {name: to_bits(tensor) for name, tensor in tensors.items()}
    kinds = {name: (dtype_name(t.dtype), tuple(t.shape)) for name, t in tensors.items()}
    for i, step in enumerate(steps):
        run(i, step, arrays, False)
        for group in step.header.groups:
            kinds.update({t.name: (group.dtype, tuple(t.shape)) for t in group.tensors})
    from safetensors.torch import save_file

    rewritten = {name: from_bits(arrays[name], *kinds[name]) for name in arrays}
    tmp = path.with_name(f".{path.name}.rewrite")
    save_file(rewritten, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)
    return ShardPatched(False, path.stat().st_size, changed)


def _written_nearly_everywhere(header: patch_codec.PatchHeader) -> list[str]:
    """Tensors whose every page the patch almost surely writes: two or more changes per page expected
    (then at least 86% of pages are written, the density at which prefaulting them all costs no extra
    dirty pages worth counting). Sparser tensors take their page faults one by one."""
    names = []
    for group in header.groups:
        per_page = mmap.PAGESIZE // bits_dtype(group.dtype).itemsize
        names += [t.name for t in group.tensors if t.changed * per_page >= 2 * max(1, math.prod(t.shape))]
    return names


def check_header(step_index: int, step: PatchStep, digests: dict[str, str], names: Iterable[str]) -> None:
    """PatchRefused unless the header fits what is known: its tensors are this shard's, its bases are the
    bits there now, its targets are the target version's, and a tensor it leaves unchanged keeps its
    checksum."""
    present = set(names)
    for group in step.header.groups:
        for t in group.tensors:
            if t.name not in present:
                raise PatchRefused(step_index, f"{step.label} names unknown tensors {[t.name]}")
            base, target = t.base_checksum.hex(), t.target_checksum.hex()
            if group.has_base and base != digests[t.name]:
                raise PatchRefused(
                    step_index,
                    f"refused: the base of {step.label} does not match (tensor {t.name}: the patch expects "
                    f"{base}, the bits there are {digests[t.name]})",
                )
            if target != step.target_digests.get(t.name):
                raise PatchRefused(
                    step_index,
                    f"refused: {step.label} makes tensor {t.name} {target}, "
                    f"its version says {step.target_digests.get(t.name)}",
                )
            if group.has_base and t.changed == 0 and base != target:
                raise PatchRefused(step_index, f"refused: {step.label} changes no element of {t.name} but its checksum")


def _apply_step(
    index: int,
    step: PatchStep,
    arrays: dict[str, np.ndarray],
    digests: dict[str, str],
    mapper: Callable,
    *,
    in_place: bool,
) -> set[str]:
    check_header(index, step, digests, arrays)

    def apply(group: patch_codec.GroupEntry) -> dict[str, np.ndarray]:
        base = {t.name: arrays[t.name] for t in group.tensors} if group.has_base else None
        # verify_base=False: each base checksum was just compared with the digest of the bits there
        return patch_codec.apply_group(group, step.payload, base, verify=True, verify_base=False, inplace=True)

    try:
        results = list(mapper(apply, step.header.groups))
    except patch_codec.ChecksumMismatch as exc:
        raise WrongBits(index, f"{step.label} produced wrong bits ({exc.message})", exc.tensor) from exc
    except patch_codec.PatchFormatError as exc:
        raise PatchUnreadable(index, f"{step.label} is unreadable: {exc.message}") from exc
    changed = set()
    for group, out in zip(step.header.groups, results, strict=True):
        for t in group.tensors:
            produced = out[t.name]
            if not np.may_share_memory(produced, arrays[t.name]):
                if in_place:  # a whole tensor the codec built apart, same layout: into the file
                    arrays[t.name][...] = produced.reshape(-1)
                else:
                    arrays[t.name] = produced.reshape(-1)
            digests[t.name] = t.target_checksum.hex()
            if t.changed or not group.has_base:
                changed.add(t.name)
    return changed
