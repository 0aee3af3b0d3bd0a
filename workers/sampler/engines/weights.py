"""Loading a materialized version into a transformers model, in the view's numerics.

Disk layout -> transformers 5 in-memory layout (experts fused per layer), named as the version's
config's MoE family says (`pipeline.moe_families`). A quantized view's linear
weights are dequantized with their scales into the compute dtype: block-fp8 (`weight` float8_e4m3fn +
`weight_scale_inv`) and MXFP4 (`weight` uint8, two E2M1 codes a byte, + E8M0 `weight_scale`). So an
fp8 or mxfp4 island computes with the rounded weights, not with the master weights: islands of
different views really are numerically different, as they are on real hardware.

`fault="wrong_dequant"` is a test-only fault injection (`island.fault`): it dequantizes the way a real
bug would, so a drift guard can be shown to catch a broken island.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open

from pipeline.bits import all_finite
from pipeline.errors import SprawlError
from pipeline.keyframe import INDEX_FILE
from pipeline.moe_families import LEGACY_LAYOUT, ExpertLayout, expert_layout
from pipeline.views import dequantize_fp8_block, dequantize_mxfp4
from pipeline.views.fp8_e4m3 import FP8_BLOCK
from pipeline.views.mxfp4 import E8M0_NAN, MX_BLOCK

Fault = Literal["none", "wrong_dequant"]
"""Test-only fault injection of the reference engine (`IslandSection.fault`)."""

SCALE_SUFFIXES = ("_scale_inv", "_scale")
"""What a quantized `<name>.weight` brings along: fp8 `weight_scale_inv`, mxfp4 `weight_scale`."""


class CheckpointLayoutError(SprawlError):
    """A materialized version's tensors cannot be arranged into the model's layout."""

    def __init__(self, detail: str):
        super().__init__(detail, hint="the version on disk is incomplete or not this model's; re-materialize it")


def checkpoint_layout(directory: Path) -> ExpertLayout:
    """How the version in `directory` names its tensors: its config's MoE family's layout."""
    try:
        model_type = json.loads((directory / "config.json").read_text()).get("model_type")
    except FileNotFoundError:
        raise CheckpointLayoutError(f"{directory} has no config.json to say which model it holds") from None
    if not model_type:
        raise CheckpointLayoutError(f"{directory}/config.json names no model_type")
    return expert_layout(model_type)


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


class FaultNotApplicable(SprawlError):
    """`wrong_dequant` was asked of a version with nothing to dequantize (a bf16 view)."""

    def __init__(self, directory: Path):
        super().__init__(
            f"island.fault=wrong_dequant, but {directory} holds no quantized weights to dequantize wrongly",
            hint="the fault injection needs a quantized view (fp8_e4m3, mxfp4); set island.fault=none "
            "(SPRAWL_ISLAND__FAULT) for a bf16 island",
        )


def weight_of(name: str) -> str:
    """A scale's weight (`x.weight_scale_inv`, `x.weight_scale` -> `x.weight`); any other name itself."""
    for suffix in SCALE_SUFFIXES:
        if name.endswith(".weight" + suffix):
            return name.removesuffix(suffix)
    return name


def affected_disk_tensors(directory: Path, changed: list[str]) -> set[str]:
    """Disk tensors to read so every in-memory tensor touched by `changed` can be rebuilt: a changed
    expert brings its whole fused layer along, a changed quantized weight its scale (and the reverse)."""
    layout = checkpoint_layout(directory)
    names = set(json.loads((directory / INDEX_FILE).read_text())["weight_map"])
    weights = {weight_of(n) for n in changed}
    layers = {expert.fused_prefix for w in weights if (expert := layout.expert_of(w))}
    for name in names:
        expert = layout.expert_of(weight_of(name))
        if expert is not None and expert.fused_prefix in layers:
            weights.add(weight_of(name))
    return {n for n in names if weight_of(n) in weights}


class UnservableWeights(SprawlError):
    """A materialized version holds a value no engine may compute with (NaN or infinity)."""

    def __init__(self, detail: str):
        super().__init__(
            detail,
            hint="the version's bits are what its publisher wrote (materialization verified them), so the "
            "trainer published a non-finite weight or a forged checkpoint; serve an earlier version",
        )


def _two_dims(name: str, tensor: torch.Tensor) -> tuple[int, int]:
    if tensor.dim() != 2:
        raise CheckpointLayoutError(f"{name} is quantized ({tensor.dtype}) but not 2-D: {tuple(tensor.shape)}")
    return tensor.shape[0], tensor.shape[1]


def _fp8_scale_shape(name: str, tensor: torch.Tensor) -> tuple[int, int]:
    rows, cols = _two_dims(name, tensor)
    return -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)


def _mxfp4_scale_shape(name: str, tensor: torch.Tensor) -> tuple[int, int]:
    rows, half_cols = _two_dims(name, tensor)
    if (2 * half_cols) % MX_BLOCK:
        raise CheckpointLayoutError(
            f"{name} packs {2 * half_cols} inputs a row, not whole MX blocks of {MX_BLOCK} (the mxfp4 view "
            "keeps such a linear in bf16)"
        )
    return rows, 2 * half_cols // MX_BLOCK


def _check_scale(name: str, tensor: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, shape: tuple) -> None:
    """A scale that does not fit its weight would be broadcast, truncated or cast into wrong values
    without a word (a float read as E8M0 bytes, a grid cut to size): refuse it instead."""
    if scale.dtype != dtype or tuple(scale.shape) != shape:
        raise CheckpointLayoutError(
            f"the scale of {name} is {scale.dtype} {tuple(scale.shape)}; its weight "
            f"{tensor.dtype} {tuple(tensor.shape)} needs {dtype} {shape}"
        )


def _dequantize(name: str, tensor: torch.Tensor, tensors: dict[str, torch.Tensor], fault: Fault) -> torch.Tensor | None:
    """fp32 values of a quantized weight, or None when `name` is not one."""
    fp8_scale_inv, mx_scale = tensors.get(name + "_scale_inv"), tensors.get(name + "_scale")
    if fp8_scale_inv is not None and mx_scale is not None:
        raise CheckpointLayoutError(f"{name} has both an fp8 `_scale_inv` and an mxfp4 `_scale`")
    if tensor.dtype == torch.float8_e4m3fn and fp8_scale_inv is not None:
        _check_scale(name, tensor, fp8_scale_inv, torch.float32, _fp8_scale_shape(name, tensor))
        if fault == "wrong_dequant":
            # The bits read as e4m3fnuz (ROCm's fp8, exponent bias 8 not 7), the confusion vLLM's
            # normalize_e4m3fn_to_e4m3fnuz exists to undo: every value halves. (A transposed or rolled
            # scale grid would be a no-op here: the tiny models' linears are one 128x128 block.)
            return dequantize_fp8_block(tensor, fp8_scale_inv * 0.5)
        return dequantize_fp8_block(tensor, fp8_scale_inv)
    if tensor.dtype == torch.uint8 and mx_scale is not None:
        _check_scale(name, tensor, mx_scale, torch.uint8, _mxfp4_scale_shape(name, tensor))
        if bool((mx_scale == E8M0_NAN).any()):
            # 0xFF is the E8M0 NaN: the whole block reads as NaN (our quantizer writes it for a master
            # block holding NaN/inf). Never computed with, whatever the fault injection says.
            raise UnservableWeights(f"{name} has an E8M0 scale 0xFF (NaN): its block is not a number")
        if fault == "wrong_dequant":
            tensor = ((tensor & 0x0F) << 4) | (tensor >> 4)  # the two nibbles of each byte swapped
        return dequantize_mxfp4(tensor, mx_scale)
    if tensor.dtype in (torch.float8_e4m3fn, torch.uint8) and name.endswith(".weight"):
        raise CheckpointLayoutError(f"{name} is quantized ({tensor.dtype}) but its scale is missing")
    if fp8_scale_inv is not None or mx_scale is not None:
        raise CheckpointLayoutError(f"{name} is {tensor.dtype}, not quantized, yet it has a scale")
    return None


def to_compute_dtype(
    tensors: dict[str, torch.Tensor], dtype: torch.dtype, fault: Fault = "none"
) -> dict[str, torch.Tensor]:
    """Dequantize block-fp8 (`weight` + `weight_scale_inv`) and MXFP4 (`weight` + `weight_scale`)
    weights and cast everything to `dtype`; scales are consumed, never loaded into the model.

    Refused, never served: a scale without its weight, a scale that does not fit its weight, and any
    value that is not finite once in `dtype` (an E8M0 NaN scale, an fp8 NaN code, a bf16 NaN, or a large
    E8M0 byte whose product overflows): generation fed a NaN would sample garbage without a word."""
    out = {}
    for name, tensor in tensors.items():
        weight = weight_of(name)
        if weight != name:
            if weight not in tensors:
                raise CheckpointLayoutError(f"{name} is a scale without its weight {weight}")
            continue
        values = _dequantize(name, tensor, tensors, fault)
        out[name] = (values if values is not None else tensor).to(dtype)
        # A widening cast keeps every value, finite or not: the narrower source is checked (half the bytes
        # of bf16 -> fp32, every commit). Anything dequantized or narrowed is checked as it will be served.
        checked = tensor if values is None and (tensor.dtype, dtype) in _WIDENING else out[name]
        if not all_finite(checked):
            raise UnservableWeights(f"{name} holds a non-finite value once dequantized to {dtype}")
    return out


_WIDENING = {(d, d) for d in (torch.bfloat16, torch.float16, torch.float32, torch.float64)} | {
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float64),
    (torch.float16, torch.float64),
    (torch.float32, torch.float64),
}
"""Casts that map every value exactly (an inf stays an inf, a NaN a NaN, nothing finite overflows)."""


def has_quantized_weights(tensors: dict[str, torch.Tensor]) -> bool:
    return any(weight_of(name) != name for name in tensors)


def fuse_experts(tensors: dict[str, torch.Tensor], layout: ExpertLayout = LEGACY_LAYOUT) -> dict[str, torch.Tensor]:
    """Checkpoint tensors (named as `layout` says) -> the transformers 5 in-memory state dict: per-expert
    tensors fused into `gate_up_proj [E, 2I, H]` and `down_proj [E, H, I]`, every other name mapped back."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, tensor in tensors.items():
        expert = layout.expert_of(name)
        if expert is None:
            out[layout.memory_name(name)] = tensor
            continue
        experts.setdefault(expert.fused_prefix, {}).setdefault(expert.expert, {})[expert.role] = tensor
    for prefix, by_expert in experts.items():
        ids = sorted(by_expert)
        if ids != list(range(len(ids))):
            raise CheckpointLayoutError(f"{prefix}: experts {ids} are not 0..{len(ids) - 1}")
        try:
            gate_up = [[by_expert[e]["gate"], by_expert[e]["up"]] for e in ids]
            down = [[by_expert[e]["down"]] for e in ids]
        except KeyError as missing:
            raise CheckpointLayoutError(f"{prefix}: an expert has no {missing.args[0]} projection") from None
        out[f"{prefix}gate_up_proj"] = _fused(prefix, gate_up)
        out[f"{prefix}down_proj"] = _fused(prefix, down)
    return out


def _fused(prefix: str, parts: list[list[torch.Tensor]]) -> torch.Tensor:
    """`[E, sum of rows, cols]`: expert e's parts stacked along rows, written once into one tensor (a
    cat then a stack would copy every expert weight twice, on every commit). Experts of different
    shapes are refused: a copy into a slice would broadcast a mis-shaped one without a word."""
    shapes = [tuple(p.shape) for p in parts[0]]
    for e, expert in enumerate(parts):
        if [tuple(p.shape) for p in expert] != shapes or any(p.dim() != 2 for p in expert):
            raise CheckpointLayoutError(
                f"{prefix}: the experts' shapes differ (expert {e}: {[tuple(p.shape) for p in expert]}, "
                f"expert 0: {shapes})"
            )
        if {p.dtype for p in expert} != {parts[0][0].dtype}:
            raise CheckpointLayoutError(f"{prefix}: the experts' dtypes differ")
    if len({cols for _, cols in shapes}) != 1:
        raise CheckpointLayoutError(f"{prefix}: the experts' projections differ in width ({shapes})")
    rows = sum(r for r, _ in shapes)
    fused = torch.empty((len(parts), rows, shapes[0][1]), dtype=parts[0][0].dtype)
    for e, expert in enumerate(parts):
        at = 0
        for part in expert:
            fused[e, at : at + part.shape[0]].copy_(part)
            at += part.shape[0]
    return fused


def model_state_dict(
    directory: Path,
    dtype: torch.dtype = torch.bfloat16,
    changed: list[str] | None = None,
    fault: Fault = "none",
) -> dict[str, torch.Tensor]:
    """A materialized version as a transformers state dict in `dtype` (only what `changed` touches).
    With `fault="wrong_dequant"` a whole version must hold quantized weights (FaultNotApplicable)."""
    only = affected_disk_tensors(directory, changed) if changed is not None else None
    tensors = read_served_tensors(directory, only)
    if fault != "none" and changed is None and not has_quantized_weights(tensors):
        raise FaultNotApplicable(directory)
    return fuse_experts(to_compute_dtype(tensors, dtype, fault), checkpoint_layout(directory))


def load_config(directory: Path):
    from transformers import AutoConfig

    config = json.loads((directory / "config.json").read_text())
    config.pop("quantization_config", None)  # we dequantize ourselves; transformers' fp8/quark paths need a GPU
    model_type = config.pop("model_type")
    return AutoConfig.for_model(model_type, **config)
