"""What the vLLM and SGLang adapters share: an HTTP client for an engine's own server, and the
mapping helpers both use (version spans, finish reasons).

What each server can return depends on its version and launch flags (routed experts need
`--enable-return-routed-experts`; vLLM's sampling mask needs `--return-sampling-mask
--logprobs-mode processed_logprobs`; vLLM's control routes need `VLLM_SERVER_DEV_MODE=1`), so
capabilities are probed at start with a one-token request, never assumed. The request builders
and response mappers are pure functions, tested against bodies written from the engines'
documented schemas; `infra/gpu_check.sh` runs the same adapters against real servers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp

from schemas import SamplingParams, VersionSpan
from workers.sampler.engines.base import Capabilities, EngineError, EngineUnavailable


def version_spans(raw: list[dict] | None, n_tokens: int, fallback: int | None) -> list[VersionSpan]:
    """Engine weight-version spans -> ours; a missing list means one span at the reported version."""
    if raw:
        return [VersionSpan(version=int(s["version"]), start=int(s["start"]), end=int(s["end"])) for s in raw]
    return [VersionSpan(version=fallback if fallback is not None else -1, start=0, end=n_tokens)]


def finish_reason(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else value
    return {"stop": "stop", "length": "length", "abort": "abort"}.get(str(kind), "stop")


LEGACY_MODEL_TYPE = "qwen3_moe"
"""What a config.json without `model_type` is read as: the only model before MoE families."""


class EngineUnreachable(EngineUnavailable):
    """No HTTP answer at all (connection refused, reset, timed out): nothing is known about what the
    engine did with the request, so it is never taken for a refusal."""


class HTTPEngine:
    engine = ""

    def __init__(self, url: str, *, top_logprobs: int = 32, timeout_s: float = 600.0):
        self.url = url.rstrip("/")
        self.top_logprobs = top_logprobs
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._version: int | None = None
        self._caps: Capabilities | None = None
        self._model_shape = (0, 0)  # (MoE layers, experts per token), read from the served config

    async def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        return self._session

    async def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        session = await self._http()
        try:
            async with session.request(method, f"{self.url}{path}", **kwargs) as response:
                text = await response.text()
                if response.status >= 500:
                    raise EngineUnavailable(f"{self.engine} {path}: HTTP {response.status}: {text[:300]}")
                if response.status >= 400:
                    raise EngineError(f"{self.engine} {path}: HTTP {response.status}: {text[:300]}")
                if not text.strip().startswith(("{", "[")):
                    return text
                try:
                    return json.loads(text)
                except json.JSONDecodeError as exc:
                    raise EngineError(f"{self.engine} {path}: malformed JSON answer: {text[:300]!r}") from exc
        except (aiohttp.ClientError, TimeoutError) as exc:  # aiohttp's timeout is asyncio's TimeoutError
            raise EngineUnreachable(f"{self.engine} at {self.url} is unreachable: {exc}") from exc

    async def start(self) -> None:
        await self._http()

    async def shutdown(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def health(self) -> bool:
        try:
            await self._request("GET", "/health")
        except EngineError:
            return False
        return True

    async def capabilities(self) -> Capabilities:
        if self._caps is None:
            self._caps = await self._probe()
        return self._caps

    def weight_version(self) -> int | None:
        return self._version

    def _read_shape(self, path: Path) -> None:
        """(MoE layers, experts per token) of the version in `path`, as its model's MoE family counts
        them (`routing_shape`): transformers 5 writes Qwen3-MoE's expert count as `num_local_experts`,
        DeepSeek-V3's first layers are dense, Qwen3-MoE may skip layers. A config naming no model type
        is read as the legacy Qwen3-MoE (as `disk_layout(model_type=None)` lays it out); an MoE model
        of no registered family is refused (UnsupportedMoeFamily), never guessed at."""
        from pipeline.moe_families import routing_shape  # imports torch: only once a version is loaded

        shape = routing_shape(served_config(path))
        self._model_shape = (shape.layers, shape.top_k)

    async def _probe(self) -> Capabilities:
        raise NotImplementedError


def served_config(path: Path) -> Any:
    """The transformers config of the version in `path` (its quantization config dropped: it is not
    the model's shape, and transformers would try to set up the quantizer)."""
    from transformers import AutoConfig

    config = json.loads((path / "config.json").read_text())
    config.pop("quantization_config", None)
    model_type = config.pop("model_type", None) or LEGACY_MODEL_TYPE
    return AutoConfig.for_model(model_type, **config)


def one_token_sampling() -> SamplingParams:
    """The capability probe's request: one greedy token with one top logprob."""
    return SamplingParams(temperature=0.0, max_new_tokens=1, logprobs_top_k=1)
