"""Loading a materialized version into a transformers model, in the view's numerics.

Disk layout -> transformers 5 in-memory layout (experts fused per layer). The fp8 view's linear
weights are dequantized with their block scales into the compute dtype, so an fp8 island computes
with the fp8-rounded weights, not with the master weights: islands of different views really are
numerically different, as they are on real hardware.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from pipeline.errors import SprawlError
from pipeline.keyframe import INDEX_FILE
from pipeline.views import dequantize_fp8_block


class CheckpointLayoutError(SprawlError):
    """A materialized version's tensors cannot be arranged into the model's layout."""

    def __init__(self, detail: str):
        super().__init__(detail, hint="the version on disk is incomplete or not this model's; re-materialize it")


_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts\.)(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def read_served_tensors(directory: Path, only: set[str] | None = None) -> dict[str, torch.Tensor]:
    """The served tensors of a materialized version; `only` reads just those names."""
    weight_map = json.loads((directory / INDEX_FILE).read_text())["weight_map"]
    wanted = set(weight_map) if only is None else set(weight_map) & only
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted({weight_map[n] for n in wanted}):
        with safe_open(str(directory / shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                if name in wanted:
                    tensors[name] = f.get_tensor(name)
    return tensors


def affected_disk_tensors(directory: Path, changed: list[str]) -> set[str]:
    """Disk tensors to read so every in-memory tensor touched by `changed` can be rebuilt: a changed
    expert brings its whole fused layer along, a changed fp8 weight its scale (and the reverse)."""
    names = set(json.loads((directory / INDEX_FILE).read_text())["weight_map"])
    layers = {m["prefix"] for n in changed if (m := _EXPERT.match(n.removesuffix("_scale_inv")))}
    out = set(changed)
    for name in names:
        base = name.removesuffix("_scale_inv")
        match = _EXPERT.match(base)
        if match and match["prefix"] in layers:
            out.add(name)
        if base in out or name.removesuffix("weight") + "weight" in out:
            out.add(name)
    for name in list(out):
        out.add(name.removesuffix("weight") + "weight_scale_inv" if name.endswith(".weight") else name)
        out.add(name.removesuffix("_scale_inv"))
    return out & names


def to_compute_dtype(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Dequantize block-fp8 weights (`weight` + `weight_scale_inv`) and cast everything to `dtype`."""
    out = {}
    for name, tensor in tensors.items():
        if name.endswith(".weight_scale_inv"):
            continue
        scale = tensors.get(name.removesuffix("weight") + "weight_scale_inv")
        if scale is not None and tensor.dtype == torch.float8_e4m3fn:
            out[name] = dequantize_fp8_block(tensor, scale).to(dtype)
        else:
            out[name] = tensor.to(dtype)
    return out


def fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors -> transformers 5 fused `gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, tensor in tensors.items():
        match = _EXPERT.match(name)
        if match is None:
            out[name] = tensor
            continue
        experts.setdefault(match["prefix"], {}).setdefault(int(match["e"]), {})[match["proj"]] = tensor
    for prefix, by_expert in experts.items():
        ids = sorted(by_expert)
        if ids != list(range(len(ids))):
            raise CheckpointLayoutError(f"{prefix}: experts {ids} are not 0..{len(ids) - 1}")
        out[f"{prefix}gate_up_proj"] = torch.stack(
            [torch.cat([by_expert[e]["gate_proj"], by_expert[e]["up_proj"]], dim=0) for e in ids]
        )
        out[f"{prefix}down_proj"] = torch.stack([by_expert[e]["down_proj"] for e in ids])
    return out


def model_state_dict(
    directory: Path, dtype: torch.dtype = torch.bfloat16, changed: list[str] | None = None
) -> dict[str, torch.Tensor]:
    """A materialized version as a transformers state dict in `dtype` (only what `changed` touches)."""
    only = affected_disk_tensors(directory, changed) if changed is not None else None
    return fuse_experts(to_compute_dtype(read_served_tensors(directory, only), dtype))


def load_config(directory: Path):
    from transformers import AutoConfig

    config = json.loads((directory / "config.json").read_text())
    config.pop("quantization_config", None)  # we dequantize ourselves; transformers' fp8 path needs a GPU
    model_type = config.pop("model_type")
    return AutoConfig.for_model(model_type, **config)
