"""Served views: master weights cast to what an engine serves, in the on-disk HF layout.

A view is a pure function of the master state dict: the same input gives the
same bits on every run and thread count (casts and per-block scales are
elementwise or order-independent reductions). Samplers never re-quantize:
they receive exactly these bits through the version chain.

On-disk layout: transformers 5 keeps MoE experts fused in memory
(`mlp.experts.gate_up_proj [E, 2I, H]`, `mlp.experts.down_proj [E, H, I]`);
checkpoints, vLLM and SGLang use one tensor per expert
(`mlp.experts.<e>.{gate,up,down}_proj.weight`). Views always emit the latter.

Adding a format (say group-quantized int4) is one `View` subclass and one
`register_view` call.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import torch

FP8_E4M3_MAX = 448.0
FP8_BLOCK = 128


# ---------------------------------------------------------------- layout


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


# ---------------------------------------------------------------- fp8 block quantization


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
    rows, cols = quantized.shape
    expanded = scale_inv.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return quantized.to(torch.float32) * expanded


# ---------------------------------------------------------------- views


class View:
    name: ClassVar[str]

    def tensors(
        self, state_dict: Mapping[str, torch.Tensor], *, tie_word_embeddings: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The served tensors, on-disk names, served dtypes, contiguous CPU tensors."""
        raise NotImplementedError

    def config_overrides(self) -> dict[str, Any]:
        """What config.json must say for an engine to load this view as-is."""
        return {"torch_dtype": "bfloat16", "dtype": "bfloat16"}

    def compute(
        self, state_dict: Mapping[str, torch.Tensor], *, tie_word_embeddings: bool = False
    ) -> dict[str, torch.Tensor]:
        return dict(self.tensors(state_dict, tie_word_embeddings=tie_word_embeddings))


class BF16View(View):
    """Round-to-nearest-even cast of every tensor (torch's float32 -> bfloat16 cast is RNE)."""

    name = "bf16"

    def tensors(self, state_dict, *, tie_word_embeddings=False):
        for name, tensor in disk_layout(state_dict, tie_word_embeddings=tie_word_embeddings):
            yield name, tensor.detach().to("cpu", torch.bfloat16).contiguous()


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
                yield name, tensor.detach().to("cpu", torch.bfloat16).contiguous()

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


VIEWS: dict[str, View] = {}


def register_view(view: View) -> View:
    if view.name in VIEWS:
        raise ValueError(f"view {view.name!r} is already registered")
    VIEWS[view.name] = view
    return view


def get_view(name: str) -> View:
    try:
        return VIEWS[name]
    except KeyError:
        raise ValueError(f"unknown view {name!r}; registered views: {', '.join(sorted(VIEWS))}") from None


register_view(BF16View())
register_view(FP8E4M3View())
