"""Which served tensors a quantized view quantizes, and which modules its quantization config must
name as unquantized, for a model of a given type: what its family's checkpoints, vLLM and SGLang
agree on (the names come from `pipeline.moe_families`).

Quantized (fp8_e4m3, and mxfp4 where the input dim holds whole MX blocks): the 2-D weight of every
linear layer of attention and MLP, experts included:
- any module whose name ends in `_proj`: q/k/v/o_proj, gate/up/down_proj (dense MLPs, Qwen3-MoE and
  DeepSeek-V3 experts, DeepSeek-V3 shared experts), DeepSeek-V3's q_a_proj/q_b_proj/kv_b_proj;
- the family's per-expert projections, whatever they are called (Mixtral `block_sparse_moe.experts.<e>.
  w1/w3/w2`: vLLM and SGLang map them with `ckpt_gate_proj_name="w1"`, so their `weight_scale_inv`
  loads like any expert's);
- DeepSeek-V3's `kv_a_proj_with_mqa`: vLLM and SGLang fuse it with `q_a_proj` into one linear
  (`fused_qkv_a_proj`) that has one quantization scheme, so the two must be quantized alike (as
  DeepSeek-V3's own FP8 checkpoint has them).

Kept bf16: embeddings, lm_head, norms, biases, every MoE router (the family's `disk_router`: vLLM and
SGLang build routers unquantized, and their weights are tiny), and GPT-OSS's fused 3-D experts. The
last is a gap, not a choice: the one established quantized layout of those experts is OpenAI's own
MXFP4 (`gate_up_proj_blocks [E, 2I, H/32, 16]` + `gate_up_proj_scales [E, 2I, H/32]`, quant_method
"mxfp4", transformers' integrations/mxfp4.py), which neither the block-FP8 config nor the Quark config
describes and the reference engine does not read; no FP8 layout of them is established at all.

A dense model of a type no family lists gets the `_proj` rule alone: a linear named otherwise stays
bf16, which is always loadable, never mislabelled.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from pipeline.moe_families import LEGACY_LAYOUT, MOE_FAMILIES, MoeFamily, SameNames, expert_layout

EXTRA_LINEARS: dict[str, frozenset[str]] = {"deepseek_v3": frozenset({"kv_a_proj_with_mqa"})}
"""Per model type, linear layers named without the `_proj` ending (the last part of the module name)."""

DECODER_LAYERS = "model.layers"
"""Where every registered family's decoder layers live: the prefix of the module names a config excludes."""


def family_of_type(model_type: str | None) -> MoeFamily | None:
    """The MoE family of `model_type`; None: the legacy (Qwen3-MoE) family, whose names a caller that
    names no model type gets from `disk_layout` too."""
    if model_type is None:
        return MOE_FAMILIES["qwen3_moe"]
    return next((f for f in MOE_FAMILIES.values() if model_type in f.model_types), None)


def is_quantized_linear(name: str, tensor: torch.Tensor, model_type: str | None = None) -> bool:
    """Whether the on-disk tensor `name` of a `model_type` model is a linear weight a quantized view
    quantizes (see the module docstring); a quantized view keeps everything else bf16."""
    if tensor.dim() != 2 or not name.endswith(".weight"):
        return False
    module = name.removesuffix(".weight")
    family = family_of_type(model_type)
    if family is not None and module.endswith("." + family.disk_router):
        return False
    layout = expert_layout(model_type) if model_type is not None else LEGACY_LAYOUT
    if layout.expert_of(name) is not None:
        return True
    leaf = module.rsplit(".", 1)[-1]
    return leaf.endswith("_proj") or leaf in EXTRA_LINEARS.get(model_type or "", frozenset())


def unquantized_modules(model_config: Mapping[str, Any]) -> list[str]:
    """The modules of the model `model_config` (a config.json's keys) that a quantized view keeps bf16
    although an engine builds them as linear layers: `lm_head`, each MoE layer's router, and fused
    experts (GPT-OSS). Exact module names, one per layer: the one form every matcher takes (vLLM's fp8
    `ignored_layers` and Quark `exclude` compare for equality unless an entry starts with `re:`; SGLang
    matches substrings; transformers prefixes and suffixes; Quark itself fnmatch patterns)."""
    modules = ["lm_head"]
    family = family_of_type(model_config.get("model_type"))
    if family is None or model_config.get("model_type") is None:
        return modules  # a dense model: nothing but lm_head (and no family's names to guess at)
    for layer in family.moe_layers(config_object(model_config)):
        modules.append(f"{DECODER_LAYERS}.{layer}.{family.disk_router}")
        if isinstance(family.layout, SameNames):  # experts fused on disk: no view quantizes them
            modules.append(f"{DECODER_LAYERS}.{layer}.{family.router.rsplit('.', 1)[0]}.experts")
    return modules


def config_object(model_config: Mapping[str, Any]) -> Any:
    """A transformers config of `model_config`'s type from its keys (its attribute aliases resolved,
    e.g. Qwen3-MoE's `num_experts` read from `num_local_experts`); a quantization config is dropped."""
    from transformers import AutoConfig

    keys = {k: v for k, v in model_config.items() if k not in ("model_type", "quantization_config")}
    return AutoConfig.for_model(model_config["model_type"], **keys)
