"""vLLM adapter: drive vLLM's own HTTP server (tokens-in/tokens-out generate, the disk
weight-transfer flow), map its answers into `Sample`.

Always the whole version. The dev-mode RLHF routes (vllm/entrypoints/serve/dev/rlhf/api_router.py:
`/start_weight_update`, `/update_weights` with `{"update_info": {...}}`, `/finish_weight_update`)
hand `update_info` to the configured weight-transfer backend, which builds its typed update info
with `update_info_cls(**update_info)` (`WeightTransferEngine.parse_update_info`, vllm/distributed/
weight_transfer/base.py): an unknown key such as a list of names is refused. The shared-disk
backend's update info is `{"path"}` alone (`DiskWeightTransferUpdateInfo`, vllm/distributed/
weight_transfer/disk_engine.py) and it reloads "one complete safetensors checkpoint": it loads with
`enable_weights_track`, so `DefaultModelLoader.track_weights_loading` raises "Following weights were
not initialized from checkpoint" for a directory holding only some tensors, and under the layerwise
reload (vllm/model_executor/model_loader/reload/layerwise.py) a fused layer given only some of its
parts (q without k and v, gate without up) would be rebuilt with the rest uninitialized. The
backends that do take named subsets (`nccl`, `sparse_nccl`, `ipc`) carry the tensors themselves
over NCCL or CUDA IPC from a process on the engine's GPUs, which an island driving the server over
HTTP is not. vLLM's main branch also documents a `sparse_disk` backend (docs.vllm.ai/en/latest/
training/weight_updates/engines/sparse_disk/) fed with flat-index patches written by vLLM's own
trainer-side engine, not with a directory or names, and it still copies each worker's whole part
into the model. So `load_changed_tensors` is False and `changed` is not sent.
"""

from __future__ import annotations

import base64
import io
import time
from pathlib import Path
from typing import Any

import numpy as np

from workers.sampler.engines.base import Capabilities, GenerateRequest, Sample
from workers.sampler.engines.http_base import HTTPEngine, finish_reason, one_token_sampling, version_spans


def decode_routed_experts_npy(encoded: str) -> list[list[list[int]]]:
    """vLLM: base64 of an .npy array (num_tokens - 1, layers, top_k), uint8 or uint16."""
    return np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False).astype(np.int64).tolist()


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
                version_spans=version_spans(choice.get("weight_versions"), len(output), fallback_version),
                finish_reason=finish_reason(choice.get("finish_reason")),
            )
        )
    return samples


class VLLMEngine(HTTPEngine):
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
                GenerateRequest(prompt_token_ids=[1], n=1, sampling=one_token_sampling()), request_id="sprawl-probe"
            ),
        )
        choice = probe["choices"][0]
        return Capabilities(
            engine="vllm",
            engine_version=str(version.get("version", "")) if isinstance(version, dict) else "",
            load_from_disk=True,
            load_changed_tensors=False,  # no HTTP route of vLLM loads a subset: see the module docstring
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
        """Pause (keeping requests), the disk weight-transfer flow on the whole directory (`changed`
        cannot be passed on: see the module docstring), stamp the version, resume."""
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
