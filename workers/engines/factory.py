"""Build the engine an island is configured for."""

from __future__ import annotations

from workers.engines.base import Engine


def create_engine(
    kind: str, *, url: str = "", device: str = "cpu", compute_dtype: str = "bfloat16", top_logprobs: int = 32
) -> Engine:
    if kind == "torch":
        import torch

        from workers.engines.reference import ReferenceEngine

        return ReferenceEngine(device=device, dtype=getattr(torch, compute_dtype), top_logprobs=top_logprobs)
    if kind in ("vllm", "sglang"):
        if not url:
            raise ValueError(f"the {kind} engine needs SPRAWL_ISLAND__ENGINE_URL (its HTTP server)")
        from workers.engines.http_engines import SGLangEngine, VLLMEngine

        cls = VLLMEngine if kind == "vllm" else SGLangEngine
        return cls(url, top_logprobs=top_logprobs)
    raise ValueError(f"unknown engine {kind!r}: torch, vllm or sglang")
