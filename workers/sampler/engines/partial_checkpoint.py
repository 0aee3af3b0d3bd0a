"""A partial checkpoint: only the changed tensors of a materialized version, for an engine whose
disk reload loads whatever tensors a directory holds and leaves the others as they are.

The version directory itself is never touched (it is the verified, hashed copy); the partial copy
is written next to it, where the engine can already read, and removed after the load. Which
tensors go in is decided here, conservatively: anything odd about `changed` means the whole
directory is loaded instead, never a guess.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from pipeline.keyframe import CONFIG_FILE, INDEX_FILE

PARTIAL_PREFIX = ".engine-partial-"
OWNER_FILE = ".owner"
"""Locked by the process that made the copy (see `_hold`); not a safetensors file, so engines skip it."""
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
    _hold(out)
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
        remove_partial_checkpoint(out)
        raise
    return out


def remove_partial_checkpoint(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    owner = _held.pop(path, None)
    if owner is not None:
        owner.close()


_held: dict[Path, IO[bytes]] = {}
"""The partial copies this process is writing or an engine is loading, each with its owner lock held."""


def _hold(path: Path) -> None:
    """Lock the copy's owner file for as long as this process uses it: islands of one view on one host
    share a cache directory, and the lock (released by the kernel when a process dies) is how a
    sweep tells another live island's copy from a killed one's."""
    owner = open(path / OWNER_FILE, "wb")  # noqa: SIM115 - held open until the copy is removed
    fcntl.flock(owner, fcntl.LOCK_EX)
    _held[path] = owner


def sweep_partial_checkpoints(parent: Path) -> None:
    """Remove partial copies that killed processes left behind: those whose owner lock nobody holds.
    A copy still being made (no owner file yet) is left alone unless it is older than an hour."""
    for stale in parent.glob(f"{PARTIAL_PREFIX}*"):
        if stale in _held:
            continue
        try:
            with open(stale / OWNER_FILE, "rb") as owner:
                fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
                shutil.rmtree(stale, ignore_errors=True)
        except BlockingIOError:
            continue  # another live island's copy
        except FileNotFoundError:
            with contextlib.suppress(OSError):
                if time.time() - stale.stat().st_mtime > 3600:
                    shutil.rmtree(stale, ignore_errors=True)
