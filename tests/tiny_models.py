"""Tiny real models for tests: built from a transformers config, random init, no downloads."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen3MoeForCausalLM

from pipeline.tiny_models import tiny_config, tiny_moe_config


def tiny_moe(seed: int = 0, **overrides) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(tiny_moe_config(**overrides)).eval()


def tiny_model(model_type: str, seed: int = 0, **overrides) -> PreTrainedModel:
    """A tiny fp32 model of `model_type` (see `pipeline.tiny_models.TINY_CONFIGS`), in eval mode."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides)).eval()


def adam_like_step(state_dict: dict[str, torch.Tensor], lr: float, generator: torch.Generator) -> None:
    """Move every master weight by about `lr` (Adam's per-weight step is ~lr, sign from the gradient)."""
    with torch.no_grad():
        for tensor in state_dict.values():
            if tensor.is_floating_point():
                tensor.add_(torch.randn(tensor.shape, generator=generator).sign() * lr)
