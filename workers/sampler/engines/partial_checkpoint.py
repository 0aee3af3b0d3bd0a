"""A partial checkpoint: only the changed tensors of a materialized version, for an engine whose
disk reload loads whatever tensors a directory holds and leaves the others as they are.

The version directory itself is never touched (it is the verified, hashed copy); the partial copy
is written next to it, where the engine can already read, and removed after the load. Which
tensors go in is decided here, conservatively: anything odd about `changed` means the whole
directory is loaded instead, never a guess.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pipeline.keyframe import CONFIG_FILE, INDEX_FILE

PARTIAL_PREFIX = ".engine-partial-"
"""Name prefix of partial copies beside the versions (a dot: the version cache lists `v*` only)."""

MAX_PARTIAL_FRACTION = 0.5
"""Above this share of the model's bytes, a partial copy costs about what it saves (the bytes are
read and written once more before the engine reads them again), so the whole directory is loaded."""


@dataclass(frozen=True)
class TensorChoice:
    """The disk tensors to load (None: the whole directory) and why."""

    names: frozenset[str] | None
    nbytes: int
    total_bytes: int
    reason: str


def tensor_bytes(directory: Path) -> dict[str, int]:
    """Stored bytes of every tensor of a materialized version, from the shards' headers (no data read)."""
    weight_map = json.loads((directory / INDEX_FILE).read_text())["weight_map"]
    sizes: dict[str, int] = {}
    for shard in sorted(set(weight_map.values())):
        with open(directory / shard, "rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(header_len))
        for name, info in header.items():
            if name != "__metadata__":
                begin, end = info["data_offsets"]
                sizes[name] = end - begin
    missing = set(weight_map) - set(sizes)
    if missing:
        raise ValueError(f"{directory}: the index names tensors no shard holds: {sorted(missing)[:5]}")
    return sizes


def choose_tensors(directory: Path, changed: Sequence[str]) -> TensorChoice:
    """Which tensors an engine must be sent for `changed`: each changed tensor plus what must change
    with it (a block-fp8 weight and its `_scale_inv`; every expert of a fused expert layer), or the
    whole directory when a partial load would not pay or `changed` does not fit this version."""
    from workers.sampler.engines.weights import affected_disk_tensors

    sizes = tensor_bytes(directory)
    total = sum(sizes.values())
    unknown = set(changed) - set(sizes)
    if unknown:
        return TensorChoice(None, total, total, f"changed names not in this version: {sorted(unknown)[:3]}")
    names = frozenset(affected_disk_tensors(directory, list(changed)))
    nbytes = sum(sizes[n] for n in names)
    if nbytes > MAX_PARTIAL_FRACTION * total:
        return TensorChoice(None, total, total, f"{nbytes} of {total} bytes changed")
    return TensorChoice(names, nbytes, total, f"{len(names)} tensors, {nbytes} of {total} bytes")


def write_partial_checkpoint(directory: Path, names: frozenset[str]) -> Path:
    """Copy `names` (bit for bit, one output shard per source shard, so memory stays within one
    shard) with an index and the config into a new directory beside `directory`; returns it."""
    import torch  # noqa: F401 - safetensors' torch API needs it; imported here to keep the adapters light
    from safetensors import safe_open
    from safetensors.torch import save_file

    sweep_partial_checkpoints(directory.parent)
    out = Path(tempfile.mkdtemp(prefix=PARTIAL_PREFIX, dir=directory.parent))
    try:
        weight_map = json.loads((directory / INDEX_FILE).read_text())["weight_map"]
        by_shard: dict[str, list[str]] = {}
        for name in sorted(names):
            by_shard.setdefault(weight_map[name], []).append(name)
        total = 0
        for shard, shard_names in sorted(by_shard.items()):
            with safe_open(str(directory / shard), framework="pt") as f:
                group = {name: f.get_tensor(name) for name in shard_names}
            save_file(group, str(out / shard), metadata={"format": "pt"})
            total += sum(t.numel() * t.element_size() for t in group.values())
            del group
        index = {"metadata": {"total_size": total}, "weight_map": {n: weight_map[n] for n in sorted(names)}}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
        shutil.copyfile(directory / CONFIG_FILE, out / CONFIG_FILE)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return out


def remove_partial_checkpoint(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def sweep_partial_checkpoints(parent: Path) -> None:
    """Remove partial copies a killed process left behind. One island loads one version at a time
    from its own cache directory, so any copy present when a new one is made is stale."""
    for stale in parent.glob(f"{PARTIAL_PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)
