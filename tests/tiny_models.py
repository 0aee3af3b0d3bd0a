"""Tiny real models for tests: built from a transformers config, random init, no downloads."""

from __future__ import annotations

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM


def tiny_moe_config(**overrides) -> Qwen3MoeConfig:
    params = dict(
        vocab_size=96,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    params.update(overrides)
    return Qwen3MoeConfig(**params)


def tiny_moe(seed: int = 0, **overrides) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(tiny_moe_config(**overrides)).eval()


def adam_like_step(state_dict: dict[str, torch.Tensor], lr: float, generator: torch.Generator) -> None:
    """Move every master weight by about `lr` (Adam's per-weight step is ~lr, sign from the gradient)."""
    with torch.no_grad():
        for tensor in state_dict.values():
            if tensor.is_floating_point():
                tensor.add_(torch.randn(tensor.shape, generator=generator).sign() * lr)
