"""Served views: master weights cast to what an engine serves, in the on-disk HF layout.

A view is a pure function of the master state dict: the same input gives the
same bits on every run and thread count (casts and per-block scales are
elementwise or order-independent reductions). Samplers never re-quantize:
they receive exactly these bits through the version chain.

Views always emit the on-disk layout (one tensor per MoE expert), see
`pipeline.views.layout`.

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
    "quantize_fp8_block",
    "quantize_mxfp4",
    "register_view",
]
