"""The sidecar: an HTTP front for one engine that makes it version-aware.

Routes
- `POST /v1/completions`, `POST /v1/chat/completions`: OpenAI-compatible, for environments that
  drive multi-turn episodes; responses add a `sprawl` object (token ids, logprobs, top-k, kept
  sets, routed experts, version spans, island identity).
- `POST /v1/tokens`: tokens in, tokens out, everything the trainer needs.
- `GET /healthz` (the process is up), `/readyz` (serving a verified version, even an older one
  while the head cannot be built: the body says which head is blocked and why), `/metrics`
  (Prometheus text).

Version constraints (`min_version`, `exact_version`, `max_staleness`) come in the body or as
`X-Sprawl-Min-Version` / `X-Sprawl-Exact-Version` / `X-Sprawl-Max-Staleness` headers. At an
acceptable version the request is served; behind but reachable, the island catches up first
(materialize while serving, then a short commit pause); not reachable: 409 with the current and
wanted version and Retry-After; engine down or no version yet: 503. Every response carries
`X-Sprawl-Versions` (the spans that produced it).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from pathlib import Path

from aiohttp import web

from pipeline.codec.warm import warm_in_background
from pipeline.eventlog import EventLog
from pipeline.logs import get_logger
from pipeline.version_signing import island_trust
from schemas import SamplingParams, VersionConstraint
from workers.lifecycle import run_beside, stop_on_signals
from workers.sampler.engines.base import EngineError, GenerateRequest, Sample
from workers.sampler.island import Island, VersionUnreachable, build_island
from workers.sampler.settings import HTTPSection as HTTPSection  # re-exported: they lived here
from workers.sampler.settings import IslandSection as IslandSection
from workers.sampler.settings import SidecarSettings

log = get_logger(__name__)

RETRY_AFTER_S = "1"


def _int(value: object) -> int | None:
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise web.HTTPBadRequest(text=f"version constraints are integers, got {value!r}")
    try:
        return int(value)
    except ValueError:
        raise web.HTTPBadRequest(text=f"version constraints are integers, got {value!r}") from None


def constraint_of(request: web.Request, body: dict) -> VersionConstraint:
    def pick(field: str, header: str) -> int | None:
        return _int(body.get(field, request.headers.get(header)))

    return VersionConstraint(
        min_version=pick("min_version", "X-Sprawl-Min-Version"),
        exact_version=pick("exact_version", "X-Sprawl-Exact-Version"),
        max_staleness=pick("max_staleness", "X-Sprawl-Max-Staleness"),
    )


def sampling_of(body: dict, max_tokens_key: str = "max_tokens") -> SamplingParams:
    try:
        return SamplingParams(
            temperature=float(body.get("temperature", 1.0)),
            top_p=float(body.get("top_p", 1.0)),
            top_k=int(body.get("top_k", -1)),
            max_new_tokens=int(body.get(max_tokens_key, 16)),
            logprobs_top_k=int(body.get("logprobs") or body.get("top_logprobs") or 0),
            seed=int(body["seed"]) if body.get("seed") is not None else None,
        )
    except (TypeError, ValueError) as exc:
        raise web.HTTPBadRequest(text=f"bad sampling parameters: {exc}") from exc


def spans_header(samples: list[Sample]) -> str:
    versions = sorted({s.version for sample in samples for s in sample.version_spans})
    return ",".join(map(str, versions))


class Sidecar:
    def __init__(self, island: Island):
        self.island = island
        self.requests: Counter[int] = Counter()
        self.tokens = 0
        self._tokenizer = None
        self._tokenizer_dir: Path | None = None

    # ---------------------------------------------------------------- app

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._count])
        app.add_routes(
            [
                web.get("/healthz", self.healthz),
                web.get("/readyz", self.readyz),
                web.get("/metrics", self.metrics),
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat),
                web.post("/v1/tokens", self.tokens_route),
            ]
        )
        return app

    @web.middleware
    async def _count(self, request: web.Request, handler):
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            self.requests[exc.status] += 1
            raise
        self.requests[response.status] += 1
        return response

    # ---------------------------------------------------------------- probes

    async def healthz(self, _request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def readyz(self, _request: web.Request) -> web.Response:
        healthy = await self._engine_healthy()
        # Catching up, the engine still serves its last verified version: ready, and the body says so.
        serving = self.island.state in ("serving", "catching_up")
        ready = healthy and self.island.version is not None and serving
        blocked = self.island.blocked
        body = {
            "ready": ready,
            "version": self.island.version,
            "head": self.island.head,
            "state": self.island.state,
            "engine": healthy,
            "blocked": None if blocked is None else {"head": blocked.head, "reason": blocked.reason},
        }
        return web.json_response(body, status=200 if ready else 503)

    async def metrics(self, _request: web.Request) -> web.Response:
        stats = self.island.stats  # lifetime counters: a Prometheus summary never shrinks
        lines = [
            "# HELP sprawl_island_version Policy version the engine serves.",
            "# TYPE sprawl_island_version gauge",
            f"sprawl_island_version {self.island.version if self.island.version is not None else -1}",
            "# HELP sprawl_island_head_version Newest version seen in the log.",
            "# TYPE sprawl_island_head_version gauge",
            f"sprawl_island_head_version {self.island.head if self.island.head is not None else -1}",
            "# HELP sprawl_requests_total Requests by HTTP status.",
            "# TYPE sprawl_requests_total counter",
            *(f'sprawl_requests_total{{code="{code}"}} {n}' for code, n in sorted(self.requests.items())),
            "# HELP sprawl_generated_tokens_total Output tokens generated.",
            "# TYPE sprawl_generated_tokens_total counter",
            f"sprawl_generated_tokens_total {self.tokens}",
            "# HELP sprawl_commit_pause_seconds Engine pause per weight commit.",
            "# TYPE sprawl_commit_pause_seconds summary",
            f"sprawl_commit_pause_seconds_count {stats.commits}",
            f"sprawl_commit_pause_seconds_sum {stats.pause_total_s:.6f}",
            "# HELP sprawl_island_blocked_head Newest version the island cannot build yet (-1: none).",
            "# TYPE sprawl_island_blocked_head gauge",
            f"sprawl_island_blocked_head {self.island.blocked.head if self.island.blocked is not None else -1}",
            "# HELP sprawl_route_failures_total Failed parts of routes to a version (corrupt or missing blobs).",
            "# TYPE sprawl_route_failures_total counter",
            f"sprawl_route_failures_total {self.island.materializer.failures.total}",
            "# HELP sprawl_island_follow_failures_total Failed rounds of following the chain.",
            "# TYPE sprawl_island_follow_failures_total counter",
            f"sprawl_island_follow_failures_total {self.island.follow_failures}",
            "# HELP sprawl_island_refused_versions_total Versions refused: unsigned, signed by another key, "
            "or a blob differing from its signed digest (each one dead-lettered).",
            "# TYPE sprawl_island_refused_versions_total counter",
            f"sprawl_island_refused_versions_total {self.island.refused_versions}",
            "# HELP sprawl_cached_versions Versions materialized on disk.",
            "# TYPE sprawl_cached_versions gauge",
            f"sprawl_cached_versions {len(self.island.materializer.cached_versions())}",
            "# HELP sprawl_materialize_written_bytes_total Bytes materializing committed versions wrote to disk.",
            "# TYPE sprawl_materialize_written_bytes_total counter",
            f"sprawl_materialize_written_bytes_total {stats.written_bytes_total}",
            "# HELP sprawl_materialize_changed_tensor_bytes_total Bytes of the tensors those versions changed.",
            "# TYPE sprawl_materialize_changed_tensor_bytes_total counter",
            f"sprawl_materialize_changed_tensor_bytes_total {stats.changed_tensor_bytes_total}",
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8")

    async def _engine_healthy(self) -> bool:
        try:
            return await self.island.engine.health()
        except EngineError:  # unreachable or refusing: not ready, and /readyz says so
            return False

    # ---------------------------------------------------------------- generation

    async def _generate(
        self, request: web.Request, body: dict, prompt_ids: list[int], sampling: SamplingParams, n: int
    ) -> tuple[list[Sample], int]:
        if not await self._engine_healthy() or self.island.version is None:
            raise web.HTTPServiceUnavailable(
                text='{"error": "engine is not serving"}',
                content_type="application/json",
                headers={"Retry-After": RETRY_AFTER_S},
            )
        try:
            version = await self.island.ensure_version(constraint_of(request, body), wait_for_log=False)
        except VersionUnreachable as exc:
            raise web.HTTPConflict(
                text=_json({"error": "version_unavailable", "current_version": exc.current, "wanted": exc.wanted}),
                content_type="application/json",
                headers={"Retry-After": RETRY_AFTER_S},
            ) from exc
        try:
            samples = await self.island.engine.generate(
                GenerateRequest(
                    prompt_token_ids=prompt_ids,
                    n=n,
                    sampling=sampling,
                    stop_token_ids=self._stop_tokens(),
                    seed=sampling.seed if sampling.seed is not None else uuid.uuid4().int >> 65,
                    request_id=uuid.uuid4().hex,
                )
            )
        except EngineError as exc:
            status = web.HTTPServiceUnavailable if exc.retryable else web.HTTPBadGateway
            raise status(
                text=_json({"error": str(exc)}), content_type="application/json", headers={"Retry-After": RETRY_AFTER_S}
            ) from exc
        self.tokens += sum(len(s.output_token_ids) for s in samples)
        return samples, version

    async def tokens_route(self, request: web.Request) -> web.Response:
        body = await _body(request)
        prompt = body.get("prompt_token_ids")
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            raise web.HTTPBadRequest(text="prompt_token_ids must be a list of ints")
        samples, _ = await self._generate(
            request, body, prompt, sampling_of(body, "max_new_tokens"), int(body.get("n", 1))
        )
        payload = {"island": _struct(self.island.identity()), "samples": [_sample(s) for s in samples]}
        return web.json_response(payload, headers={"X-Sprawl-Versions": spans_header(samples)})

    async def completions(self, request: web.Request) -> web.Response:
        body = await _body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            prompt_ids = prompt
        elif isinstance(prompt, str):
            prompt_ids = self._encode(prompt)
        else:
            raise web.HTTPBadRequest(text="prompt must be a string or a list of token ids")
        sampling = sampling_of(body)
        samples, _ = await self._generate(request, body, prompt_ids, sampling, int(body.get("n", 1)))
        choices = [
            {
                "index": i,
                "text": self._decode(s.output_token_ids),
                "finish_reason": s.finish_reason,
                "logprobs": {
                    "tokens": [self._decode([t]) for t in s.output_token_ids],
                    "token_logprobs": s.logprobs,
                    "top_logprobs": [
                        dict(zip(map(str, ids), lps, strict=True))
                        for ids, lps in zip(s.top_ids, s.top_logprobs, strict=True)
                    ],
                },
            }
            for i, s in enumerate(samples)
        ]
        return web.json_response(
            self._openai("text_completion", body, prompt_ids, samples, choices),
            headers={"X-Sprawl-Versions": spans_header(samples)},
        )

    async def chat(self, request: web.Request) -> web.Response:
        body = await _body(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise web.HTTPBadRequest(text="messages must be a non-empty list")
        text = "".join(f"{m.get('role', 'user')}: {m.get('content', '')}\n" for m in messages) + "assistant: "
        prompt_ids = self._encode(text)
        sampling = sampling_of(body, "max_tokens" if "max_tokens" in body else "max_completion_tokens")
        samples, _ = await self._generate(request, body, prompt_ids, sampling, int(body.get("n", 1)))
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": self._decode(s.output_token_ids)},
                "finish_reason": s.finish_reason,
            }
            for i, s in enumerate(samples)
        ]
        return web.json_response(
            self._openai("chat.completion", body, prompt_ids, samples, choices),
            headers={"X-Sprawl-Versions": spans_header(samples)},
        )

    def _openai(self, kind: str, body: dict, prompt_ids: list[int], samples: list[Sample], choices: list) -> dict:
        completion_tokens = sum(len(s.output_token_ids) for s in samples)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": body.get("model") or self.island.settings.view,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": completion_tokens,
                "total_tokens": len(prompt_ids) + completion_tokens,
            },
            "sprawl": {"island": _struct(self.island.identity()), "samples": [_sample(s) for s in samples]},
        }

    # ---------------------------------------------------------------- tokenizer

    def _tokenizer_for(self):
        directory = self.island.materializer.current()
        if directory is None or not (directory / "tokenizer.json").exists():
            raise web.HTTPBadRequest(text="this model ships no tokenizer.json: send token ids to /v1/tokens")
        if self._tokenizer is None or self._tokenizer_dir != directory:
            from tokenizers import Tokenizer

            self._tokenizer, self._tokenizer_dir = Tokenizer.from_file(str(directory / "tokenizer.json")), directory
        return self._tokenizer

    def _encode(self, text: str) -> list[int]:
        return self._tokenizer_for().encode(text).ids

    def _decode(self, tokens: list[int]) -> str:
        try:
            return self._tokenizer_for().decode(tokens)
        except web.HTTPBadRequest:
            return ""

    def _stop_tokens(self) -> list[int]:
        import json

        directory = self.island.materializer.current()
        if directory is None or not (directory / "config.json").exists():
            return []
        eos = json.loads((directory / "config.json").read_text()).get("eos_token_id")
        return eos if isinstance(eos, list) else ([eos] if isinstance(eos, int) else [])


def _json(value: object) -> str:
    import json

    return json.dumps(value)


def _struct(value: object) -> dict:
    import msgspec

    return msgspec.to_builtins(value)


def _sample(s: Sample) -> dict:
    return {
        "prompt_token_ids": s.prompt_token_ids,
        "output_token_ids": s.output_token_ids,
        "logprobs": s.logprobs,
        "raw_logprobs": s.raw_logprobs,
        "top_ids": s.top_ids,
        "top_logprobs": s.top_logprobs,
        "kept_ids": s.kept_ids,
        "routed_experts": s.routed_experts,
        "version_spans": [{"version": v.version, "start": v.start, "end": v.end} for v in s.version_spans],
        "finish_reason": s.finish_reason,
    }


async def _body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except ValueError as exc:
        raise web.HTTPBadRequest(text=f"body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text="body must be a JSON object")
    return body


async def serve(sidecar: Sidecar, host: str, port: int) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(sidecar.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, bound


async def run_sidecar(settings: SidecarSettings) -> None:
    trust = island_trust(settings.trust)  # before connecting: no key and no opt-out, no island
    warm_in_background()
    event_log = await EventLog.connect(settings, worker=f"sidecar-{settings.island.view}")
    island = build_island(event_log, settings.blobs, settings.run_id, settings.island, trust)
    await island.start()
    runner, port = await serve(Sidecar(island), settings.http.host, settings.http.port)
    log.info("sidecar listening", host=settings.http.host, port=port, view=settings.island.view)
    stop = stop_on_signals()
    # A revoked or expired identity ends the sidecar with one line (as `run_connected` does for workers),
    # instead of serving ever older weights behind a connection that can never come back.
    watch = asyncio.create_task(event_log.wait_identity_refused())
    try:
        await run_beside(stop.wait(), watch, stop, "the connection to the log")
    finally:
        await runner.cleanup()
        await island.stop()
        await island.engine.shutdown()
        await event_log.close()
