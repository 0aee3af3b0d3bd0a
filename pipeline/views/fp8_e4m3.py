"""The `fp8_e4m3` view: linear projections in float8_e4m3fn with 128x128 block scales, the rest bf16.

The scales are the DeepSeek-V3 `weight_scale_inv` layout that vLLM and SGLang load for block-FP8
checkpoints; the quantizer and its inverse live here with the view.

Which tensors are linears follows the model's family (`pipeline.views.linears`): attention and MLP
projections, experts under the family's own names (Mixtral's `w1/w3/w2`), DeepSeek-V3's
`kv_a_proj_with_mqa`. Routers, embeddings, lm_head and norms stay bf16, and so do GPT-OSS's fused 3-D
experts: no block-FP8 layout of them is established (vLLM and SGLang load GPT-OSS experts as bf16 or
OpenAI's MXFP4), so they stay bf16 and the config's `modules_to_not_convert` names them, with the
routers and lm_head, when the model's config is given (`config_overrides(model_config)`).

Checked against transformers' own FP8 loader (`FineGrainedFP8HfQuantizer`, dequantizing on a CPU):
for tiny Qwen3, Qwen3-MoE, Mixtral, DeepSeek-V3 and GPT-OSS models it loads this view's names with no
missing or unexpected tensor and rebuilds the weights this module's `dequantize_fp8_block` gives,
except where a dimension is not a multiple of 128 and spans more than one block: transformers' CPU
dequantizer divides the tensor evenly among the scale grid's blocks, whereas this layout, like
DeepSeek-V3's checkpoints and vLLM, has 128-wide blocks and a short last one.
"""

from __future__ import annotations

import torch

from pipeline.views import View, register_view
from pipeline.views.bf16 import cast_bf16
from pipeline.views.layout import disk_layout
from pipeline.views.linears import is_quantized_linear, unquantized_modules

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


def is_fp8_linear(name: str, tensor: torch.Tensor, model_type: str | None = None) -> bool:
    """Linear projections (attention, MLP, experts) go to fp8; embeddings, lm_head, norms, routers stay bf16."""
    return is_quantized_linear(name, tensor, model_type)


class FP8E4M3View(View):
    name = "fp8_e4m3"

    def tensors(self, state_dict, *, tie_word_embeddings=False, model_type=None):
        for name, tensor in disk_layout(state_dict, tie_word_embeddings=tie_word_embeddings, model_type=model_type):
            if is_fp8_linear(name, tensor, model_type):
                quantized, scale_inv = quantize_fp8_block(tensor)
                yield name, quantized
                yield name.removesuffix("weight") + "weight_scale_inv", scale_inv
            else:
                yield name, cast_bf16(tensor)

    def config_overrides(self, model_config=None):
        quantization = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
        }
        if model_config is not None:
            # transformers' FP8 loader, vLLM (`ignored_layers` or this) and SGLang read this key. Once it
            # is given, transformers no longer skips lm_head by default: the list names it too.
            quantization["modules_to_not_convert"] = unquantized_modules(model_config)
        return {**super().config_overrides(model_config), "quantization_config": quantization}


register_view(FP8E4M3View())
