"""The `bf16` view: every tensor cast round-to-nearest-even to bfloat16."""

from __future__ import annotations

import torch

from pipeline.views import View, register_view
from pipeline.views.layout import disk_layout


def cast_bf16(tensor: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even cast to a contiguous CPU bfloat16 tensor (torch's float32 -> bfloat16 is RNE)."""
    return tensor.detach().to("cpu", torch.bfloat16).contiguous()


class BF16View(View):
    """Round-to-nearest-even cast of every tensor."""

    name = "bf16"

    def tensors(self, state_dict, *, tie_word_embeddings=False, model_type=None):
        for name, tensor in disk_layout(state_dict, tie_word_embeddings=tie_word_embeddings, model_type=model_type):
            yield name, cast_bf16(tensor)


register_view(BF16View())
