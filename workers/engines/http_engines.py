"""vLLM and SGLang adapters: drive each engine's own HTTP server, map its answers into `Sample`.

What each server can return depends on its version and launch flags (routed experts need
`--enable-return-routed-experts`; vLLM's sampling mask needs `--return-sampling-mask
--logprobs-mode processed_logprobs`; vLLM's control routes need `VLLM_SERVER_DEV_MODE=1`), so
capabilities are probed at start with a one-token request, never assumed. The request builders
and response mappers are pure functions, tested against bodies written from the engines'
documented schemas; `infra/gpu_check.sh` runs the same adapters against real servers.
"""

from __future__ import annotations

import base64
import io
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from schemas import VersionSpan
from workers.engines.base import Capabilities, EngineError, EngineUnavailable, GenerateRequest, Sample

# ---------------------------------------------------------------- shared mapping helpers


def _spans(raw: list[dict] | None, n_tokens: int, fallback: int | None) -> list[VersionSpan]:
    """Engine weight-version spans -> ours; a missing list means one span at the reported version."""
    if raw:
        return [VersionSpan(version=int(s["version"]), start=int(s["start"]), end=int(s["end"])) for s in raw]
    return [VersionSpan(version=fallback if fallback is not None else -1, start=0, end=n_tokens)]


def _finish(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else value
    return {"stop": "stop", "length": "length", "abort": "abort"}.get(str(kind), "stop")


def decode_routed_experts_raw(encoded: str, layers: int, top_k: int) -> list[list[list[int]]]:
    """SGLang: base64 of a C-order int32 array (tokens, layers, top_k)."""
    flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    return flat.reshape(-1, layers, top_k).tolist()


def decode_routed_experts_npy(encoded: str) -> list[list[list[int]]]:
    """vLLM: base64 of an .npy array (num_tokens - 1, layers, top_k), uint8 or uint16."""
    return np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False).astype(np.int64).tolist()


# ---------------------------------------------------------------- SGLang


def sglang_generate_payload(request: GenerateRequest, *, routed_experts: bool, sampling_mask: bool) -> dict:
    sp = request.sampling
    params = []
    for i in range(request.n):
        params.append(
            {
                "temperature": sp.temperature,
                "top_p": sp.top_p,
                "top_k": sp.top_k,
                "max_new_tokens": sp.max_new_tokens,
                "stop_token_ids": list(request.stop_token_ids),
                "sampling_seed": (request.seed + i) & 0x7FFF_FFFF,
                "no_stop_trim": True,
            }
        )
    payload: dict[str, Any] = {
        "input_ids": [list(request.prompt_token_ids)] * request.n,
        "sampling_params": params,
        "return_logprob": True,
        "top_logprobs_num": sp.logprobs_top_k or 32,
        "logprob_start_len": -1,
        "rid": [f"{request.request_id or 'req'}-{i}" for i in range(request.n)],
    }
    if routed_experts:
        payload |= {"return_routed_experts": True, "routed_experts_start_len": 0}
    if sampling_mask:
        payload["return_sampling_mask"] = True
    return payload


def sglang_samples(body: list[dict] | dict, request: GenerateRequest, *, layers: int, top_k: int) -> list[Sample]:
    items = body if isinstance(body, list) else [body]
    samples = []
    for item in items:
        meta = item["meta_info"]
        output = list(item.get("output_ids") or [t[1] for t in meta["output_token_logprobs"]])
        raw = [float(t[0]) for t in meta["output_token_logprobs"]]
        processed = meta.get("output_token_sampling_logprobs")
        tops = meta.get("output_top_logprobs") or [[] for _ in output]
        routed = meta.get("routed_experts")
        samples.append(
            Sample(
                prompt_token_ids=list(request.prompt_token_ids),
                output_token_ids=output,
                logprobs=[float(x) for x in processed] if processed is not None else raw,
                raw_logprobs=raw,
                top_ids=[[int(t[1]) for t in step] for step in tops],
                top_logprobs=[[float(t[0]) for t in step] for step in tops],
                kept_ids=meta.get("output_token_sampling_mask"),
                routed_experts=decode_routed_experts_raw(routed, layers, top_k) if routed else None,
                version_spans=_spans(
                    meta.get("weight_versions"),
                    len(output),
                    int(meta["weight_version"]) if str(meta.get("weight_version", "")).isdigit() else None,
                ),
                finish_reason=_finish(meta.get("finish_reason")),
            )
        )
    return samples


# ---------------------------------------------------------------- vLLM


def vllm_generate_payload(request: GenerateRequest, *, request_id: str) -> dict:
    sp = request.sampling
    return {
        "token_ids": list(request.prompt_token_ids),
        "request_id": request_id,
        "output_mode": "tokens",
        "stream": False,
        "sampling_params": {
            "n": request.n,
            "temperature": sp.temperature,
            "top_p": sp.top_p,
            "top_k": sp.top_k,
            "max_tokens": sp.max_new_tokens,
            "seed": request.seed & 0x7FFF_FFFF,
            "logprobs": sp.logprobs_top_k or 32,
            "stop_token_ids": list(request.stop_token_ids),
            "skip_special_tokens": False,
        },
    }


def _vllm_token_id(key: str | int) -> int:
    return int(key) if isinstance(key, int) or key.isdigit() else int(str(key).rsplit(":", 1)[-1])


def _vllm_logprobs(raw: Any, n_tokens: int) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """Accepts the chat-style `{"content": [{"logprob", "top_logprobs": [{"token", "logprob"}]}]}` and the
    completion-style `{"token_logprobs": [...], "top_logprobs": [{"token_id:N": lp}]}` shapes."""
    if not raw:
        return [0.0] * n_tokens, [[] for _ in range(n_tokens)], [[] for _ in range(n_tokens)]
    if isinstance(raw, dict) and "content" in raw:
        steps = raw["content"]
        chosen = [float(s["logprob"]) for s in steps]
        ids = [[_vllm_token_id(t["token"]) for t in s.get("top_logprobs", [])] for s in steps]
        lps = [[float(t["logprob"]) for t in s.get("top_logprobs", [])] for s in steps]
        return chosen, ids, lps
    chosen = [float(x) for x in raw["token_logprobs"]]
    tops = raw.get("top_logprobs") or [{} for _ in chosen]
    ids = [[_vllm_token_id(k) for k in step] for step in tops]
    lps = [[float(v) for v in step.values()] for step in tops]
    return chosen, ids, lps


def vllm_samples(body: dict, request: GenerateRequest, *, fallback_version: int | None) -> list[Sample]:
    samples = []
    for choice in sorted(body["choices"], key=lambda c: c.get("index", 0)):
        output = [int(t) for t in choice["token_ids"]]
        chosen, ids, lps = _vllm_logprobs(choice.get("logprobs"), len(output))
        routed = choice.get("routed_experts")
        masked = choice.get("sampling_mask_logprobs")
        samples.append(
            Sample(
                prompt_token_ids=list(request.prompt_token_ids),
                output_token_ids=output,
                logprobs=[float(x) for x in masked] if masked is not None else chosen,
                raw_logprobs=chosen,
                top_ids=ids,
                top_logprobs=lps,
                kept_ids=choice.get("sampling_mask"),
                routed_experts=decode_routed_experts_npy(routed) if routed else None,
                version_spans=_spans(choice.get("weight_versions"), len(output), fallback_version),
                finish_reason=_finish(choice.get("finish_reason")),
            )
        )
    return samples


# ---------------------------------------------------------------- engines


class _HTTPEngine:
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
                return json.loads(text) if text.strip().startswith(("{", "[")) else text
        except aiohttp.ClientError as exc:
            raise EngineUnavailable(f"{self.engine} at {self.url} is unreachable: {exc}") from exc

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
        config = json.loads((path / "config.json").read_text())
        layers = int(config.get("num_hidden_layers", 0))
        sparse_step = int(config.get("decoder_sparse_step", 1) or 1)
        moe_layers = len([i for i in range(layers) if (i + 1) % sparse_step == 0]) if config.get("num_experts") else 0
        self._model_shape = (moe_layers, int(config.get("num_experts_per_tok", 0)))

    async def _probe(self) -> Capabilities:
        raise NotImplementedError


class SGLangEngine(_HTTPEngine):
    engine = "sglang"

    async def _probe(self) -> Capabilities:
        info = await self._request("GET", "/server_info")
        model = await self._request("GET", "/model_info")
        version = str(model.get("weight_version", ""))
        self._version = int(version) if version.isdigit() else None
        args = info.get("server_args", info) if isinstance(info, dict) else {}
        probe = await self._request(
            "POST",
            "/generate",
            json={
                "input_ids": [1],
                "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                "return_logprob": True,
                "top_logprobs_num": 1,
                "return_sampling_mask": True,
                "return_routed_experts": bool(args.get("enable_return_routed_experts")),
            },
        )
        meta = (probe[0] if isinstance(probe, list) else probe)["meta_info"]
        return Capabilities(
            engine="sglang",
            engine_version=str(info.get("version", "")),
            load_from_disk=True,
            load_changed_tensors=False,
            pause=True,
            flush_cache=True,
            top_logprobs="output_top_logprobs" in meta,
            sampling_mask="output_token_sampling_mask" in meta,
            routed_experts="routed_experts" in meta,
            version_spans="weight_versions" in meta,
            abort=True,
            accelerator=str(args.get("device", "cuda")),
            kernels={
                k: str(args[k])
                for k in ("attention_backend", "moe_runner_backend", "dtype", "quantization")
                if args.get(k)
            },
        )

    async def pause(self) -> None:
        await self._request("POST", "/pause_generation", json={"mode": "in_place"})

    async def resume(self) -> None:
        await self._request("POST", "/continue_generation", json={})

    async def flush_cache(self) -> None:
        await self._request("POST", "/flush_cache")

    async def set_weight_version(self, version: int) -> None:
        # abort_all_requests defaults to true upstream; false splits running requests into spans.
        await self._request(
            "POST", "/update_weight_version", json={"new_version": str(version), "abort_all_requests": False}
        )
        self._version = version

    async def abort(self, request_id: str) -> None:
        await self._request("POST", "/abort_request", json={"rid": request_id})

    async def load_weights(self, path: Path, version: int, changed: list[str] | None = None) -> float:
        """Pause in place, load from the materialized directory, resume: in-flight requests continue
        under the new version and report it as a new span."""
        self._read_shape(path)
        t0 = time.perf_counter()
        await self.pause()
        try:
            result = await self._request(
                "POST",
                "/update_weights_from_disk",
                json={
                    "model_path": str(path),
                    "weight_version": str(version),
                    "abort_all_requests": False,
                    "flush_cache": True,
                },
            )
            if isinstance(result, dict) and result.get("success") is False:
                raise EngineError(f"sglang refused {path}: {result.get('message')}")
        finally:
            await self.resume()
        self._version = version
        return time.perf_counter() - t0

    async def generate(self, request: GenerateRequest) -> list[Sample]:
        caps = await self.capabilities()
        body = await self._request(
            "POST",
            "/generate",
            json=sglang_generate_payload(request, routed_experts=caps.routed_experts, sampling_mask=caps.sampling_mask),
        )
        layers, top_k = self._model_shape
        return sglang_samples(body, request, layers=layers, top_k=top_k)


class VLLMEngine(_HTTPEngine):
    """vLLM's server started with `VLLM_SERVER_DEV_MODE=1` and `--tokens-only` (tokens-in/tokens-out)."""

    engine = "vllm"

    async def _probe(self) -> Capabilities:
        version = await self._request("GET", "/version")
        info = await self._request("GET", "/weight_info")
        raw = str(info.get("weight_version", "")) if isinstance(info, dict) else ""
        self._version = int(raw) if raw.isdigit() else None
        probe = await self._request(
            "POST",
            "/inference/v1/generate",
            json=vllm_generate_payload(
                GenerateRequest(prompt_token_ids=[1], n=1, sampling=_one_token()), request_id="sprawl-probe"
            ),
        )
        choice = probe["choices"][0]
        return Capabilities(
            engine="vllm",
            engine_version=str(version.get("version", "")) if isinstance(version, dict) else "",
            load_from_disk=True,
            load_changed_tensors=False,
            pause=True,
            flush_cache=True,
            top_logprobs=bool(choice.get("logprobs")),
            sampling_mask="sampling_mask" in choice,
            routed_experts="routed_experts" in choice,
            version_spans="weight_versions" in choice,
            abort=True,
            accelerator="cuda",
        )

    async def pause(self) -> None:
        await self._request("POST", "/pause", params={"mode": "keep", "clear_cache": "false"})

    async def resume(self) -> None:
        await self._request("POST", "/resume")

    async def flush_cache(self) -> None:
        await self._request("POST", "/reset_prefix_cache")

    async def set_weight_version(self, version: int) -> None:
        await self._request("POST", "/update_weight_version", json={"new_version": str(version)})
        self._version = version

    async def abort(self, request_id: str) -> None:
        await self._request("POST", "/abort_requests", json={"request_ids": [request_id]})

    async def load_weights(self, path: Path, version: int, changed: list[str] | None = None) -> float:
        """Pause (keeping requests), the disk weight-transfer flow, stamp the version, resume."""
        self._read_shape(path)
        t0 = time.perf_counter()
        await self.pause()
        try:
            await self._request("POST", "/start_weight_update")
            await self._request("POST", "/update_weights", json={"update_info": {"path": str(path)}})
            await self._request("POST", "/finish_weight_update", json={"weight_version": str(version)})
        finally:
            await self.resume()
        self._version = version
        return time.perf_counter() - t0

    async def generate(self, request: GenerateRequest) -> list[Sample]:
        body = await self._request(
            "POST",
            "/inference/v1/generate",
            json=vllm_generate_payload(request, request_id=request.request_id or "sprawl"),
        )
        return vllm_samples(body, request, fallback_version=self._version)


def _one_token():
    from schemas import SamplingParams

    return SamplingParams(temperature=0.0, max_new_tokens=1, logprobs_top_k=1)
