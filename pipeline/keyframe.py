"""Keyframes on disk: HF-layout safetensors shards + index + config.json, loadable as-is.

The same layout is used for materialized versions in a sampler's cache, so an
engine loads a version from disk without knowing about sprawl.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"


def plan_shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Group tensor names into shards of at most `max_shard_bytes` (a big tensor gets its own).

    For checkpoints written without a plan of their own; the chain publisher cuts its keyframes along
    its `PublishLayout` (`pipeline/publish_layout.py`) instead, the same files whatever the rank count."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def shard_file(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def write_checkpoint(
    directory: Path,
    tensors: dict[str, torch.Tensor],
    config: dict[str, Any],
    *,
    weight_map: dict[str, str] | None = None,
    max_shard_bytes: int = 2 * 1024**3,
    extra_files: dict[str, bytes] | None = None,
) -> list[str]:
    """Write shards, index and config; returns the file names (relative to `directory`).

    `weight_map` reuses an existing shard assignment (materialized versions keep their keyframe's).
    """
    directory.mkdir(parents=True, exist_ok=True)
    if weight_map is None:
        groups = plan_shards(tensors, max_shard_bytes)
        weight_map = {name: shard_file(i, len(groups)) for i, group in enumerate(groups) for name in group}
    missing = set(tensors) ^ set(weight_map)
    if missing:
        raise ValueError(f"weight map and tensors disagree on {sorted(missing)[:5]}")
    by_file: dict[str, dict[str, torch.Tensor]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, {})[name] = tensors[name]
    total = sum(write_shard(directory / file, group) for file, group in sorted(by_file.items()))
    return [*sorted(by_file), *write_metadata_files(directory, weight_map, total, config, extra_files)]


def write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> int:
    """One safetensors shard (the same bytes whatever the dict's order: safetensors orders the tensors
    itself); returns the bytes of its tensors, what the index's `total_size` adds up."""
    save_file(tensors, str(path), metadata={"format": "pt"})
    return sum(t.numel() * t.element_size() for t in tensors.values())


def write_metadata_files(
    directory: Path,
    weight_map: dict[str, str],
    total_size: int,
    config: dict[str, Any],
    extra_files: dict[str, bytes] | None = None,
) -> list[str]:
    """The files of a checkpoint that are not shards: index (weight map sorted by tensor name), config,
    extra files. Returns their names in the order a keyframe lists them."""
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2))
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))
    for name, data in (extra_files or {}).items():
        (directory / name).write_bytes(data)
    return [INDEX_FILE, CONFIG_FILE, *sorted(extra_files or {})]


def read_weight_map(directory: Path) -> dict[str, str]:
    return json.loads((directory / INDEX_FILE).read_text())["weight_map"]


def load_shard(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of one shard, as owned CPU tensors (safe to modify in place: `get_tensor` copies
    out of the file mapping, so no extra clone is needed)."""
    out = {}
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            out[name] = f.get_tensor(name)
    return out
