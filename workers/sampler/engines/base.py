"""The engine interface every island uses, and the result type every engine maps into.

Capabilities are probed when an engine starts (`capabilities()`), never assumed: a sampler asks
before relying on routed experts, sampling masks or in-place weight updates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from schemas import SamplingParams, VersionSpan


class EngineError(Exception):
    """The engine failed or refused; `retryable` says whether trying again later can help."""

    def __init__(self, message: str, *, retryable: bool = False):
        self.retryable = retryable
        super().__init__(message)


class EngineUnavailable(EngineError):
    def __init__(self, message: str):
        super().__init__(message, retryable=True)


@dataclass(frozen=True)
class Capabilities:
    engine: str
    engine_version: str
    load_from_disk: bool
    load_changed_tensors: bool
    pause: bool
    flush_cache: bool
    top_logprobs: bool
    sampling_mask: bool
    routed_experts: bool
    version_spans: bool
    abort: bool
    accelerator: str = "cpu"
    kernels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class GenerateRequest:
    prompt_token_ids: list[int]
    n: int
    sampling: SamplingParams
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int = 0
    """Sample i uses seed (seed, i): a redo of a prompt group reproduces its samples."""
    request_id: str = ""


@dataclass
class Sample:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    logprobs: list[float]
    """log mu(y_t): the sampled token under the processed distribution it was drawn from."""
    raw_logprobs: list[float]
    """log softmax of the unscaled logits (temperature 1, no truncation)."""
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    kept_ids: list[list[int]] | None
    """The kept (top-k/top-p) set per token; None when the whole vocabulary was kept."""
    routed_experts: list[list[list[int]]] | None
    """Per processed token (prompt and output, all but the last output token), per MoE layer."""
    version_spans: list[VersionSpan]
    finish_reason: str


class Engine(Protocol):
    async def start(self) -> None: ...
    async def health(self) -> bool: ...
    async def shutdown(self) -> None: ...
    async def capabilities(self) -> Capabilities: ...
    async def pause(self) -> None: ...
    async def resume(self) -> None: ...
    async def load_weights(self, path: Path, version: int, changed: list[str] | None = None) -> float:
        """Commit weights from a materialized directory; returns the pause it cost, in seconds."""
        ...

    def weight_version(self) -> int | None: ...
    async def set_weight_version(self, version: int) -> None:
        """Relabel the weights the engine holds (e.g. bits identical across versions)."""
        ...

    async def flush_cache(self) -> None: ...
    async def generate(self, request: GenerateRequest) -> list[Sample]: ...
    async def abort(self, request_id: str) -> None: ...
