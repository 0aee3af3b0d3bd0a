"""SGLang adapter: drive SGLang's own HTTP server (`/generate`, `update_weights_from_disk`), map its
answers into `Sample`.

Loading only the changed tensors. `POST /update_weights_from_disk` takes a directory
(`UpdateWeightFromDiskReqInput.model_path`; no list of names) and `ModelRunner.
update_weights_from_disk` (python/sglang/srt/model_executor/model_runner.py) iterates whatever
safetensors that directory holds (`DefaultModelLoader._get_weights_iterator`, filtered by its
index) into `model.load_weights`, which copies each tensor into the live parameter in place:
parameters it is not given keep their values. SGLang accepts such partial updates on purpose
(sgl-project/sglang#9663, "flexible validation for partial weight updates", Aug 2025). So a
directory of just the changed tensors, written beside the version, is a partial update.

Two limits, both handled by loading the whole directory instead:
- after loading, every module's `quant_method.process_weights_after_loading` runs again, also on
  layers that were not reloaded. That is a no-op for unquantized layers on CUDA with the default
  MoE runners, but not for quantized checkpoints (fp8 scales re-packed, weights transposed:
  sgl-project/sglang#30749) nor for kernels that re-shuffle weights in place (other MoE runners,
  CPU/NPU backends). `takes_partial_checkpoints` reads the server's arguments at start, and a
  version whose config declares a quantization is always loaded whole.
- some models' `load_weights` still insist on a complete checkpoint (sgl-project/sglang#28585).
  Such a refusal is answered by loading the whole directory within the same pause (a refused
  partial update may have applied some tensors before failing, and only a full load puts every
  parameter back at a known version), and partial loads are not tried again on that server.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError

from pipeline.logs import get_logger
from workers.sampler.engines.base import Capabilities, EngineError, GenerateRequest, Sample
from workers.sampler.engines.http_base import EngineUnreachable, HTTPEngine, finish_reason, version_spans
from workers.sampler.engines.partial_checkpoint import (
    TensorChoice,
    choose_tensors,
    remove_partial_checkpoint,
    write_partial_checkpoint,
)

log = get_logger(__name__)

PARTIAL_SAFE_MOE_RUNNERS = frozenset({"auto", "triton"})
"""MoE runners whose post-load step leaves loaded expert weights as they are (others re-shuffle)."""


def takes_partial_checkpoints(server_args: dict) -> bool:
    """Whether a partial update leaves the layers it does not reload exactly as they were, judged
    from the server's launch arguments (see the module docstring)."""
    return (
        not server_args.get("quantization")
        and str(server_args.get("device") or "cuda") == "cuda"
        and str(server_args.get("moe_runner_backend") or "auto") in PARTIAL_SAFE_MOE_RUNNERS
        and not server_args.get("cpu_offload_gb")
    )


def declares_quantization(directory: Path) -> bool:
    return "quantization_config" in json.loads((directory / "config.json").read_text())


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
            load_changed_tensors=takes_partial_checkpoints(args),
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
        """Pause in place, load from the materialized directory (or from a partial copy holding only
        what `changed` touches), resume: in-flight requests continue under the new version and
        report it as a new span. Returns the pause in seconds."""
        self._read_shape(path)
        if changed is not None and not changed:
            t0 = time.perf_counter()
            await self.set_weight_version(version)  # bits identical to what the engine holds
            return time.perf_counter() - t0
        choice = await self._choose(path, changed)
        partial = await self._write_partial(path, choice)
        try:
            t0 = time.perf_counter()
            await self.pause()
            try:
                if partial is None:
                    await self._update_from_disk(path, version)
                else:
                    await self._update_partially(partial, path, version, choice)
            finally:
                await self.resume()
            pause = time.perf_counter() - t0
        finally:
            if partial is not None:
                await asyncio.to_thread(remove_partial_checkpoint, partial)
        self._version = version
        return pause

    async def _choose(self, path: Path, changed: list[str] | None) -> TensorChoice:
        caps = await self.capabilities()
        if changed is None or not caps.load_changed_tensors:
            return TensorChoice(None, 0, 0, "whole directory")
        try:
            if declares_quantization(path):
                return TensorChoice(None, 0, 0, "quantized checkpoint")
            choice = await asyncio.to_thread(choose_tensors, path, changed)
        except (OSError, ValueError, KeyError) as exc:
            log.warning("cannot pick the changed tensors; loading the whole version", path=str(path), error=repr(exc))
            return TensorChoice(None, 0, 0, repr(exc))
        if choice.names is None:
            log.info("loading the whole version", path=str(path), reason=choice.reason)
        return choice

    async def _write_partial(self, path: Path, choice: TensorChoice) -> Path | None:
        """The partial copy to load, written before the pause; None: load the whole version."""
        if not choice.names:
            return None
        try:
            return await asyncio.to_thread(write_partial_checkpoint, path, choice.names)
        except (OSError, ValueError, SafetensorError) as exc:  # e.g. no room beside the versions
            log.warning("cannot write the changed tensors; loading the whole version", path=str(path), error=repr(exc))
            return None

    async def _update_partially(self, partial: Path, path: Path, version: int, choice: TensorChoice) -> None:
        try:
            await self._update_from_disk(partial, version)
        except EngineUnreachable:
            raise  # no answer: the engine may still be applying it, and a full load would race it
        except EngineError as refused:
            self._stop_partial_loads(str(refused))
            try:
                await self._update_from_disk(path, version)
            except EngineError as exc:
                raise EngineError(
                    f"sglang refused the partial update ({refused}) and then the whole version {path} ({exc});"
                    " its weights are now partly updated: restart the engine",
                    retryable=False,
                ) from exc
            return
        log.info(
            "loaded the changed tensors only",
            version=version,
            tensors=len(choice.names or ()),
            bytes=choice.nbytes,
            model_bytes=choice.total_bytes,
        )

    def _stop_partial_loads(self, reason: str) -> None:
        log.warning("sglang refused a partial update; loading whole versions from now on", reason=reason)
        if self._caps is not None:
            self._caps = dataclasses.replace(self._caps, load_changed_tensors=False)

    async def _update_from_disk(self, directory: Path, version: int) -> None:
        try:
            result = await self._request(
                "POST",
                "/update_weights_from_disk",
                json={
                    "model_path": str(directory),
                    "weight_version": str(version),
                    "abort_all_requests": False,
                    "flush_cache": True,
                },
            )
        except EngineUnreachable:
            raise
        except EngineError as exc:  # SGLang answers a failed update with HTTP 400 and `success: false`
            raise EngineError(f"sglang refused {directory}: {exc}", retryable=exc.retryable) from exc
        if not (isinstance(result, dict) and result.get("success") is True):
            message = result.get("message") if isinstance(result, dict) else result
            raise EngineError(f"sglang refused {directory}: {str(message)[:300]}")

    async def generate(self, request: GenerateRequest) -> list[Sample]:
        caps = await self.capabilities()
        body = await self._request(
            "POST",
            "/generate",
            json=sglang_generate_payload(request, routed_experts=caps.routed_experts, sampling_mask=caps.sampling_mask),
        )
        layers, top_k = self._model_shape
        return sglang_samples(body, request, layers=layers, top_k=top_k)
