"""The sidecar's paths: proxy, catch-up, 409, 503, probes, metrics and bad input."""

import aiohttp
import pytest
import torch

from pipeline.config import MaterializeSettings
from tests.chain_helpers import publisher, reference_island
from tests.tiny_models import adam_like_step, tiny_moe
from workers.sampler.island import IslandSection
from workers.sampler.sidecar import Sidecar, serve

pytestmark = pytest.mark.integration


@pytest.fixture
async def served(event_log, settings, tmp_path):
    model = tiny_moe(seed=6)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    pub = publisher(event_log, settings, model)
    await pub.publish(0, state)
    section = IslandSection(island_id="sidecar-test", materialize=MaterializeSettings(cache_dir=tmp_path))
    island = reference_island(event_log, settings, section)
    await island.start(follow=False)  # versions move only when a request asks
    await island.commit(0)
    runner, port = await serve(Sidecar(island), "127.0.0.1", 0)
    async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}") as http:
        yield http, island, pub, state
    await runner.cleanup()


TOKENS = {"prompt_token_ids": [1, 2, 3], "n": 2, "max_new_tokens": 5, "temperature": 1.0, "seed": 3}


async def test_at_an_acceptable_version_the_request_is_served(served):
    http, _, _, _ = served
    async with http.post("/v1/tokens", json={**TOKENS, "max_staleness": 0}) as r:
        assert r.status == 200
        assert r.headers["X-Sprawl-Versions"] == "0"
        body = await r.json()
    assert len(body["samples"]) == 2 and body["island"]["island_id"] == "sidecar-test"
    sample = body["samples"][0]
    assert len(sample["output_token_ids"]) == len(sample["logprobs"]) == 5
    assert sample["version_spans"] == [{"version": 0, "start": 0, "end": 5}]


async def test_behind_but_reachable_catches_up_then_serves(served):
    http, island, pub, state = served
    adam_like_step(state, 1e-3, torch.Generator().manual_seed(1))
    await pub.publish(1, state)
    async with http.post("/v1/tokens", json=TOKENS, headers={"X-Sprawl-Min-Version": "1"}) as r:
        assert r.status == 200
        assert r.headers["X-Sprawl-Versions"] == "1"
    assert island.version == 1 and island.stats.commits == 2


async def test_unreachable_versions_get_409_with_current_and_wanted(served):
    http, _, _, _ = served
    async with http.post("/v1/tokens", json={**TOKENS, "min_version": 7}) as r:
        assert r.status == 409
        assert r.headers["Retry-After"] == "1"
        body = await r.json()
    assert body["current_version"] == 0 and "7" in body["wanted"]
    async with http.post("/v1/tokens", json={**TOKENS, "exact_version": 5}) as r:
        assert r.status == 409


async def test_engine_down_is_503_and_not_ready(served):
    http, island, _, _ = served
    async with http.get("/readyz") as r:
        assert r.status == 200
    await island.engine.shutdown()
    async with http.post("/v1/tokens", json=TOKENS) as r:
        assert r.status == 503 and r.headers["Retry-After"] == "1"
    async with http.get("/readyz") as r:
        assert r.status == 503
    async with http.get("/healthz") as r:
        assert r.status == 200


async def test_openai_completions_and_metrics(served):
    http, _, _, _ = served
    async with http.post("/v1/completions", json={"prompt": [4, 5, 6], "max_tokens": 3, "logprobs": 2}) as r:
        assert r.status == 200
        body = await r.json()
    assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 3
    assert len(body["choices"][0]["logprobs"]["token_logprobs"]) == 3
    assert body["sprawl"]["samples"][0]["version_spans"][0]["version"] == 0
    async with http.get("/metrics") as r:
        text = await r.text()
    assert "sprawl_island_version 0" in text and 'sprawl_requests_total{code="200"} 1' in text
    assert "sprawl_generated_tokens_total 3" in text


async def test_bad_input_gets_a_clear_400(served):
    http, _, _, _ = served
    async with http.post("/v1/tokens", data=b"{not json") as r:
        assert r.status == 400 and "not JSON" in await r.text()
    async with http.post("/v1/tokens", json={**TOKENS, "min_version": "soon"}) as r:
        assert r.status == 400 and "integers" in await r.text()
    async with http.post("/v1/tokens", json={"prompt_token_ids": "hello"}) as r:
        assert r.status == 400
    async with http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}) as r:
        assert r.status == 400 and "tokenizer" in await r.text()
