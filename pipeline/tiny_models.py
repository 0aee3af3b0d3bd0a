"""Tiny configs of real architectures: toy sizes, built from a transformers config with no downloads.
Tests, the demo task, the GPU check's keyframe and the benchmarks each pick their sizes by overriding
these defaults, so each architecture is spelled once.

Qwen3-MoE is the project's model; Mixtral, GPT-OSS and DeepSeek-V3 are the other MoE families of
`pipeline.moe_families` (each routes differently); Qwen3 is the dense model. Widths are 128 so the fp8
view's 128x128 blocks and mxfp4's 32-wide blocks apply as on a real model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig, Qwen3MoeConfig

TINY_SHARED: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)
"""What every tiny model shares: vocabulary, width, depth, attention."""

TINY_MOE = dict(
    TINY_SHARED,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_experts=4,
    num_experts_per_tok=2,
)

PLAIN_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
"""GPT-OSS and DeepSeek-V3 default to YaRN scaled for their real context; a toy context needs none."""

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_moe": TINY_MOE,
    "qwen3": dict(TINY_SHARED, intermediate_size=256),
    "mixtral": dict(TINY_SHARED, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2),
    "gpt_oss": dict(
        TINY_SHARED,
        intermediate_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        rope_parameters=PLAIN_ROPE,
    ),
    "deepseek_v3": dict(
        TINY_SHARED,
        num_hidden_layers=3,  # layer 0 dense (first_k_dense_replace), layers 1 and 2 MoE
        intermediate_size=256,
        moe_intermediate_size=64,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,  # two groups of two experts, one group chosen per token: the grouped choice at work
        topk_group=1,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        num_key_value_heads=4,  # multi-head latent attention has no grouped KV heads
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        head_dim=16,  # the rotary width: qk_rope_head_dim
        v_head_dim=32,
        rope_parameters=PLAIN_ROPE,
    ),
}
"""model_type -> the toy sizes of that architecture."""


def tiny_config(model_type: str, **overrides: object) -> PretrainedConfig:
    """The tiny config of `model_type` (a key of TINY_CONFIGS), with `overrides`."""
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**TINY_CONFIGS[model_type], **overrides})


def tiny_moe_config(**overrides: object) -> Qwen3MoeConfig:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**{**TINY_MOE, **overrides})
