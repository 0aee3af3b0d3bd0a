"""Tiny Qwen3-MoE configs: real architectures at toy sizes, built from a transformers config with
no downloads. Tests, the demo task, the GPU check's keyframe and the benchmarks each pick their
sizes by overriding these defaults, so the architecture is spelled once."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import Qwen3MoeConfig

TINY_MOE = dict(
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


def tiny_moe_config(**overrides: object) -> Qwen3MoeConfig:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**{**TINY_MOE, **overrides})
