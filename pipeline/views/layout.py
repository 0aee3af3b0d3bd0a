"""The on-disk checkpoint layout every view emits: the names the model's HF checkpoints use.

transformers 5 keeps MoE experts fused in memory (`mlp.experts.gate_up_proj [E, 2I, H]`,
`mlp.experts.down_proj [E, H, I]`); most families' checkpoints, and so vLLM and SGLang, hold one
tensor per expert under the family's own names (Qwen3-MoE `mlp.experts.<e>.gate_proj.weight`, Mixtral
`block_sparse_moe.experts.<e>.w1.weight`), some keep them fused (GPT-OSS). The family's entry in
`pipeline.moe_families` says which; dense models keep their in-memory names.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from pipeline.errors import SprawlError
from pipeline.moe_families import expert_layout


def disk_layout(
    state_dict: Mapping[str, torch.Tensor], *, tie_word_embeddings: bool = False, model_type: str | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """In-memory transformers names -> on-disk checkpoint names of `model_type` (its config's).

    `model_type=None` keeps the layout every caller got before MoE families: Qwen3-MoE's names (the
    experts split per expert under `mlp.experts.<e>.`), right for Qwen3-MoE, DeepSeek-V3 and dense
    models, wrong for Mixtral and GPT-OSS: callers that know the model should pass its type. (A GPT-OSS
    state dict is refused there: splitting its [E, H, 2I] experts as Qwen's would write garbage.)"""
    layout = expert_layout(model_type)
    for name, tensor in state_dict.items():
        if model_type is None and name.endswith(".mlp.router.weight"):
            raise SprawlError(
                f"{name} is a GPT-OSS-style router, but no model type was given to lay its experts out",
                hint="pass the model's config.model_type to the view (disk_layout(..., model_type=...))",
            )
        if tie_word_embeddings and name == "lm_head.weight":
            continue  # tied: the checkpoint stores only the embedding
        yield from layout.to_disk(name, tensor)
