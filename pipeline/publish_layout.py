"""The publish layout: which source parameters go into which keyframe shard, and which rank publishes it.

A version's files are cut into *units*: consecutive runs of source parameters (the trainer's master
weights, transformers in-memory names, e.g. a fused `mlp.experts.gate_up_proj [E, 2I, H]`) in name
order. A unit is one safetensors shard `model-0000i-of-0000n.safetensors` in EVERY view: whatever a
source parameter is served as (split per expert by `disk_layout`, fp8 or mxfp4 scales) lands in its
unit's file, and a patch covers one unit. A source parameter is never split across units.

The plan is made from source names and shapes only, never from the number of ranks: a 1-rank and an
N-rank trainer cut the same files, so their versions are the same bits, names and hashes. Ranks then
share the units (`units_of`, `owned`); each computes, uploads and patches its own units, and rank 0
appends the one event naming all of them (`pipeline/chain_publish.py`, `pipeline/version_parts.py`).

Bytes are estimated as numel x 2 (the bf16 view, the largest one served): `max_shard_bytes` then keeps
its meaning for bf16 shards, and the smaller fp8/mxfp4 shards stay under it too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import xxhash

from pipeline.errors import SprawlError
from pipeline.keyframe import shard_file

SERVED_BYTES_PER_ELEMENT = 2
"""The estimate of a served element's size (bf16): what a unit's size is measured in."""


class LayoutMismatch(SprawlError, ValueError):
    """Parameters handed to a rank are not the ones the layout gives it."""


@dataclass(frozen=True)
class PublishLayout:
    source_shapes: tuple[tuple[str, tuple[int, ...]], ...]
    """Every source parameter's (name, global shape), sorted by name: what the plan was made from."""
    units: tuple[tuple[str, ...], ...]
    """Source parameter names per unit, in unit order (which is name order)."""

    @classmethod
    def plan(
        cls, source_shapes: Mapping[str, tuple[int, ...]], *, max_shard_bytes: int, min_units: int
    ) -> PublishLayout:
        """Cut the sorted source names into units of at most `target` estimated bytes (a parameter
        bigger than that gets a unit of its own), `target` being the smaller of `max_shard_bytes` and
        total / `min_units` rounded down: every unit but a single oversized parameter's holds at most
        1/min_units of the model, so there are at least `min_units` units unless one parameter alone
        outweighs that share (then it is the floor of any assignment's imbalance anyway)."""
        if min_units < 1 or max_shard_bytes < 1:
            raise ValueError(f"min_units ({min_units}) and max_shard_bytes ({max_shard_bytes}) must be >= 1")
        shapes = tuple(sorted((name, tuple(int(d) for d in shape)) for name, shape in source_shapes.items()))
        if not shapes:
            raise LayoutMismatch("no source parameters to plan a publish layout from", hint="pass every parameter")
        sizes = [_estimated_bytes(shape) for _, shape in shapes]
        target = max(1, min(max_shard_bytes, sum(sizes) // min_units))
        units: list[list[str]] = [[]]
        size = 0
        for (name, _), nbytes in zip(shapes, sizes, strict=True):
            if units[-1] and size + nbytes > target:
                units.append([])
                size = 0
            units[-1].append(name)
            size += nbytes
        return cls(source_shapes=shapes, units=tuple(tuple(u) for u in units))

    # ---------------------------------------------------------------- what the plan says

    @property
    def count(self) -> int:
        return len(self.units)

    def shard_file(self, unit: int) -> str:
        """The safetensors file of `unit`, the same name in every view."""
        return shard_file(unit, self.count)

    @cached_property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self.source_shapes)

    @cached_property
    def unit_bytes(self) -> tuple[int, ...]:
        """Estimated served bytes of each unit."""
        return tuple(sum(_estimated_bytes(self.shapes[n]) for n in unit) for unit in self.units)

    @cached_property
    def layout_id(self) -> str:
        """xxh3-128 over the names, shapes and cuts: parts planned from another layout are refused."""
        h = xxhash.xxh3_128()
        for i, unit in enumerate(self.units):
            for name in unit:
                h.update(f"{i}\0{name}\0{','.join(map(str, self.shapes[name]))}\n".encode())
        return h.hexdigest()

    # ---------------------------------------------------------------- who publishes what

    def units_of(self, rank: int, world_size: int) -> list[int]:
        """The units `rank` publishes, ascending: units assigned biggest first, each to the rank with the
        fewest estimated bytes so far (ties: the lower rank), so every unit has exactly one rank and the
        ranks' loads differ by at most one unit's size. Deterministic: every rank computes the same."""
        _check_rank(rank, world_size)
        return self._assignment(world_size)[rank]

    def owned(self, rank: int, world_size: int) -> list[str]:
        """The source parameters `rank` must hold in full to publish its units, in name order."""
        return [name for unit in self.units_of(rank, world_size) for name in self.units[unit]]

    def _assignment(self, world_size: int) -> list[list[int]]:
        loads = [0] * world_size
        by_rank: list[list[int]] = [[] for _ in range(world_size)]
        for unit in sorted(range(self.count), key=lambda u: (-self.unit_bytes[u], u)):
            rank = min(range(world_size), key=lambda r: (loads[r], r))
            by_rank[rank].append(unit)
            loads[rank] += self.unit_bytes[unit]
        return [sorted(units) for units in by_rank]

    def check_owned(self, rank: int, world_size: int, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Raise LayoutMismatch unless `shapes` are exactly `rank`'s parameters with their planned shapes."""
        wanted = self.owned(rank, world_size)
        missing, extra = sorted(set(wanted) - set(shapes)), sorted(set(shapes) - set(wanted))
        wrong = sorted(n for n in set(wanted) & set(shapes) if tuple(shapes[n]) != self.shapes[n])
        if missing or extra or wrong:
            detail = "; ".join(
                f"{label}: {names[:3]}{' ...' if len(names) > 3 else ''}"
                for label, names in (("missing", missing), ("not this rank's", extra), ("shape differs", wrong))
                if names
            )
            raise LayoutMismatch(
                f"rank {rank} of {world_size} was handed parameters the publish layout does not give it ({detail})",
                hint="gather exactly publisher.layout.owned(rank, world_size), full (unsharded) tensors; "
                "a changed model needs publisher.plan_layout(new shapes) on every rank",
            )


def _estimated_bytes(shape: tuple[int, ...]) -> int:
    return math.prod(shape) * SERVED_BYTES_PER_ELEMENT


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise LayoutMismatch(f"rank {rank} of world size {world_size}", hint="0 <= rank < world_size, world_size >= 1")
