"""SGLang adapter: drive SGLang's own HTTP server (`/generate`, `update_weights_from_disk`), map its
answers into `Sample`."""

from __future__ import annotations

import base64
import time
from pathlib import Path
from typing import Any

import numpy as np

from workers.sampler.engines.base import Capabilities, EngineError, GenerateRequest, Sample
from workers.sampler.engines.http_base import HTTPEngine, finish_reason, version_spans


def decode_routed_experts_raw(encoded: str, layers: int, top_k: int) -> list[list[list[int]]]:
    """SGLang: base64 of a C-order int32 array (tokens, layers, top_k)."""
    flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    return flat.reshape(-1, layers, top_k).tolist()


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
                version_spans=version_spans(
                    meta.get("weight_versions"),
                    len(output),
                    int(meta["weight_version"]) if str(meta.get("weight_version", "")).isdigit() else None,
                ),
                finish_reason=finish_reason(meta.get("finish_reason")),
            )
        )
    return samples


class SGLangEngine(HTTPEngine):
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
