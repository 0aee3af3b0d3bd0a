"""The engine registry: one entry per engine, each building its engine from the island's settings."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pipeline.errors import SprawlError
from workers.sampler.engines.base import Engine


@dataclass(frozen=True)
class EngineOptions:
    url: str = ""
    device: str = "cpu"
    compute_dtype: str = "bfloat16"
    top_logprobs: int = 32
    fault: str = "none"
    """Test-only fault injection (`IslandSection.fault`); only the reference engine implements one."""


def _reference(options: EngineOptions) -> Engine:
    import torch

    from workers.sampler.engines.reference import ReferenceEngine

    return ReferenceEngine(
        device=options.device,
        dtype=getattr(torch, options.compute_dtype),
        top_logprobs=options.top_logprobs,
        fault=options.fault,  # type: ignore[arg-type]  # validated by IslandSection
    )


def _no_fault(kind: str, options: EngineOptions) -> None:
    if options.fault != "none":
        raise SprawlError(
            f"the {kind} engine has no fault injection (island.fault={options.fault!r})",
            hint="fault injection is test-only and implemented by the torch reference engine; "
            "set island.fault=none (SPRAWL_ISLAND__FAULT)",
        )


def _needs_url(kind: str, options: EngineOptions) -> str:
    if not options.url:
        raise SprawlError(
            f"the {kind} engine needs the URL of its HTTP server",
            hint="set island.engine_url (SPRAWL_ISLAND__ENGINE_URL)",
        )
    return options.url


def _vllm(options: EngineOptions) -> Engine:
    from workers.sampler.engines.vllm import VLLMEngine

    _no_fault("vllm", options)
    return VLLMEngine(_needs_url("vllm", options), top_logprobs=options.top_logprobs)


def _sglang(options: EngineOptions) -> Engine:
    from workers.sampler.engines.sglang import SGLangEngine

    _no_fault("sglang", options)
    return SGLangEngine(_needs_url("sglang", options), top_logprobs=options.top_logprobs)


ENGINES: dict[str, Callable[[EngineOptions], Engine]] = {"torch": _reference, "vllm": _vllm, "sglang": _sglang}


def create_engine(kind: str, **options: object) -> Engine:
    try:
        build = ENGINES[kind]
    except KeyError:
        raise SprawlError(f"unknown engine {kind!r}", hint=f"one of {', '.join(sorted(ENGINES))}") from None
    return build(EngineOptions(**options))  # type: ignore[arg-type]
