"""The on-disk checkpoint layout every view emits.

transformers 5 keeps MoE experts fused in memory (`mlp.experts.gate_up_proj [E, 2I, H]`,
`mlp.experts.down_proj [E, H, I]`); checkpoints, vLLM and SGLang use one tensor per expert
(`mlp.experts.<e>.{gate,up,down}_proj.weight`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch


def disk_layout(
    state_dict: Mapping[str, torch.Tensor], *, tie_word_embeddings: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """In-memory transformers names -> on-disk checkpoint names, experts split per expert."""
    for name, tensor in state_dict.items():
        if tie_word_embeddings and name == "lm_head.weight":
            continue  # tied: the checkpoint stores only the embedding
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            half = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                yield f"{prefix}{e}.gate_proj.weight", tensor[e, :half]
                yield f"{prefix}{e}.up_proj.weight", tensor[e, half:]
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e in range(tensor.shape[0]):
                yield f"{prefix}{e}.down_proj.weight", tensor[e]
        else:
            yield name, tensor
