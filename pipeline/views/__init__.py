"""Served views: master weights cast to what an engine serves, in the on-disk HF layout.

A view is a pure function of the master state dict: the same input gives the
same bits on every run and thread count (casts and per-block scales are
elementwise or order-independent reductions). Samplers never re-quantize:
they receive exactly these bits through the version chain.

Views always emit the on-disk layout of the model's family (one tensor per MoE expert under the
family's names, or fused where its checkpoints keep them fused), see `pipeline.views.layout`; which
tensors a quantized view quantizes, and what its config excludes, also follow the family
(`pipeline.views.linears`). So every caller passes the model's `config.model_type`; `None` is the
legacy Qwen3-MoE layout (and refuses a GPT-OSS state dict rather than guess).

Adding a format (say group-quantized int4) is one module here holding a `View`
subclass (and its quantize/dequantize functions) that calls `register_view`,
plus one import line at the bottom of this file.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import torch

from pipeline.errors import SprawlError, UnknownView


class View:
    name: ClassVar[str]

    def tensors(
        self,
        state_dict: Mapping[str, torch.Tensor],
        *,
        tie_word_embeddings: bool = False,
        model_type: str | None = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The served tensors of a `model_type` model: on-disk names, served dtypes, contiguous CPU tensors."""
        raise NotImplementedError

    def config_overrides(self, model_config: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """What config.json must say for an engine to load this view as-is. With the model's config
        (config.json's keys), a quantized view names exactly the modules it keeps unquantized; without
        it, the legacy Qwen3-MoE patterns."""
        return {"torch_dtype": "bfloat16", "dtype": "bfloat16"}

    def compute(
        self,
        state_dict: Mapping[str, torch.Tensor],
        *,
        tie_word_embeddings: bool = False,
        model_type: str | None = None,
    ) -> dict[str, torch.Tensor]:
        return dict(self.tensors(state_dict, tie_word_embeddings=tie_word_embeddings, model_type=model_type))


VIEWS: dict[str, View] = {}
"""The registry: view name -> the view. Filled by the view modules imported at the bottom."""


def register_view(view: View) -> View:
    """Add a view under `view.name`; a second view with the same name is a programming error."""
    if view.name in VIEWS:
        raise SprawlError(
            f"view {view.name!r} is already registered (by {type(VIEWS[view.name]).__name__})",
            hint="give the new view its own name",
        )
    VIEWS[view.name] = view
    return view


def get_view(name: str) -> View:
    """The registered view called `name`; UnknownView (a SprawlError and a ValueError) names the known ones."""
    try:
        return VIEWS[name]
    except KeyError:
        raise UnknownView(name, sorted(VIEWS)) from None


# The views themselves: each module registers its view on import. The re-exports keep
# `from pipeline.views import X` working for everything that used to live in one module.
from pipeline.views.bf16 import BF16View, cast_bf16  # noqa: E402
from pipeline.views.fp8_e4m3 import (  # noqa: E402
    FP8_BLOCK,
    FP8_E4M3_MAX,
    FP8E4M3View,
    dequantize_fp8_block,
    is_fp8_linear,
    quantize_fp8_block,
)
from pipeline.views.layout import disk_layout  # noqa: E402
from pipeline.views.linears import is_quantized_linear, unquantized_modules  # noqa: E402
from pipeline.views.mxfp4 import MX_BLOCK, MXFP4View, dequantize_mxfp4, quantize_mxfp4  # noqa: E402

__all__ = [
    "FP8_BLOCK",
    "FP8_E4M3_MAX",
    "MX_BLOCK",
    "VIEWS",
    "BF16View",
    "FP8E4M3View",
    "MXFP4View",
    "View",
    "cast_bf16",
    "dequantize_fp8_block",
    "dequantize_mxfp4",
    "disk_layout",
    "get_view",
    "is_fp8_linear",
    "is_quantized_linear",
    "quantize_fp8_block",
    "quantize_mxfp4",
    "register_view",
    "unquantized_modules",
]
