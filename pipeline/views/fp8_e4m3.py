"""The `fp8_e4m3` view: linear projections in float8_e4m3fn with 128x128 block scales, the rest bf16.

The scales are the DeepSeek-V3 `weight_scale_inv` layout that vLLM and SGLang load for block-FP8
checkpoints; the quantizer and its inverse live here with the view.
"""

from __future__ import annotations

import torch

from pipeline.views import View, register_view
from pipeline.views.bf16 import cast_bf16
from pipeline.views.layout import disk_layout

FP8_E4M3_MAX = 448.0
FP8_BLOCK = 128


def quantize_fp8_block(weight: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D weight -> (float8_e4m3fn weight, fp32 weight_scale_inv [ceil(out/b), ceil(in/b)]).

    `weight ≈ q * weight_scale_inv` per block: the DeepSeek-V3 layout vLLM and SGLang load for
    block-FP8 checkpoints. Computed in fp32 from the master weights; an all-zero block gets scale 1.
    """
    rows, cols = weight.shape
    row_blocks, col_blocks = -(-rows // block), -(-cols // block)
    padded = torch.zeros(row_blocks * block, col_blocks * block, dtype=torch.float32)
    padded[:rows, :cols] = weight.detach().to(torch.float32)
    tiles = padded.view(row_blocks, block, col_blocks, block)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    quantized = (tiles / scale[:, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    quantized = quantized.view(row_blocks * block, col_blocks * block)[:rows, :cols].contiguous()
    return quantized, scale.contiguous()


def dequantize_fp8_block(quantized: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """The inverse of `quantize_fp8_block` up to fp8 rounding: fp32 `q * weight_scale_inv` per block."""
    rows, cols = quantized.shape
    expanded = scale_inv.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return quantized.to(torch.float32) * expanded


def is_fp8_linear(name: str, tensor: torch.Tensor) -> bool:
    """Linear projections (attention, MLP, experts) go to fp8; embeddings, lm_head, norms, routers stay bf16."""
    return tensor.dim() == 2 and name.endswith("_proj.weight")


class FP8E4M3View(View):
    name = "fp8_e4m3"

    def tensors(self, state_dict, *, tie_word_embeddings=False):
        for name, tensor in disk_layout(state_dict, tie_word_embeddings=tie_word_embeddings):
            if is_fp8_linear(name, tensor):
                quantized, scale_inv = quantize_fp8_block(tensor)
                yield name, quantized
                yield name.removesuffix("weight") + "weight_scale_inv", scale_inv
            else:
                yield name, cast_bf16(tensor)

    def config_overrides(self):
        return {
            **super().config_overrides(),
            "quantization_config": {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "activation_scheme": "dynamic",
                "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
            },
        }


register_view(FP8E4M3View())
