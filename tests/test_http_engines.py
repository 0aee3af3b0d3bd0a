"""vLLM / SGLang adapters: requests and responses mapped per the engines' documented schemas.

The real engines need GPUs (see tests/test_gpu_engines.py and infra/gpu_check.sh); here the
pure mappers are checked against bodies written from the documented formats, and the SGLang
adapter's call sequence against a small HTTP server that answers in those formats.
"""

import base64
import io

import numpy as np
import pytest
from aiohttp import web

from schemas import SamplingParams
from workers.sampler.engines.base import GenerateRequest
from workers.sampler.engines.sglang import SGLangEngine, sglang_generate_payload, sglang_samples
from workers.sampler.engines.vllm import vllm_generate_payload, vllm_samples

REQUEST = GenerateRequest(
    prompt_token_ids=[1, 2, 3],
    n=2,
    stop_token_ids=[0],
    seed=10,
    sampling=SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=4, logprobs_top_k=2),
)
LAYERS, TOP_K = 2, 2


def _sglang_item(tokens: list[int]) -> dict:
    routing = np.arange((3 + len(tokens) - 1) * LAYERS * TOP_K, dtype=np.int32) % 8
    return {
        "text": "",
        "output_ids": tokens,
        "meta_info": {
            "id": "x",
            "finish_reason": {"type": "length", "length": 4},
            "prompt_tokens": 3,
            "completion_tokens": len(tokens),
            "cached_tokens": 0,
            "weight_version": "4",
            "output_token_logprobs": [[-0.5 - i, t, None] for i, t in enumerate(tokens)],
            "output_top_logprobs": [[[-0.1, 9, None], [-0.5 - i, t, None]] for i, t in enumerate(tokens)],
            "output_token_sampling_mask": [[9, t] for t in tokens],
            "output_token_sampling_logprobs": [-0.3 - i for i in range(len(tokens))],
            "routed_experts": base64.b64encode(routing.tobytes()).decode(),
            "weight_versions": [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 4}],
        },
    }


def test_sglang_payload_asks_for_everything_per_sample():
    payload = sglang_generate_payload(REQUEST, routed_experts=True, sampling_mask=True)
    assert payload["input_ids"] == [[1, 2, 3], [1, 2, 3]]
    seeds = [p["sampling_seed"] for p in payload["sampling_params"]]
    assert len(set(seeds)) == 2
    first = payload["sampling_params"][0]
    assert (first["temperature"], first["top_p"], first["max_new_tokens"], first["stop_token_ids"]) == (
        0.7,
        0.9,
        4,
        [0],
    )
    assert payload["return_logprob"] and payload["top_logprobs_num"] == 2
    assert payload["return_routed_experts"] and payload["return_sampling_mask"]
    assert "return_routed_experts" not in sglang_generate_payload(REQUEST, routed_experts=False, sampling_mask=False)


def test_sglang_response_maps_into_samples():
    samples = sglang_samples(
        [_sglang_item([5, 6, 7, 8]), _sglang_item([4, 4, 4, 4])], REQUEST, layers=LAYERS, top_k=TOP_K
    )
    s = samples[0]
    assert s.output_token_ids == [5, 6, 7, 8]
    assert s.logprobs == [-0.3, -1.3, -2.3, -3.3]  # renormalized over the kept set: what was sampled from
    assert s.raw_logprobs == [-0.5, -1.5, -2.5, -3.5]
    assert s.top_ids[0] == [9, 5] and s.top_logprobs[0] == [-0.1, -0.5]
    assert s.kept_ids[1] == [9, 6]
    assert np.array(s.routed_experts).shape == (3 + 4 - 1, LAYERS, TOP_K)
    assert [(v.version, v.start, v.end) for v in s.version_spans] == [(3, 0, 2), (4, 2, 4)]
    assert s.finish_reason == "length"


def _npy_b64(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return base64.b64encode(buffer.getvalue()).decode()


def test_vllm_payload_and_chat_style_logprobs():
    payload = vllm_generate_payload(REQUEST, request_id="r1")
    assert payload["token_ids"] == [1, 2, 3] and payload["request_id"] == "r1"
    assert payload["sampling_params"]["n"] == 2 and payload["sampling_params"]["logprobs"] == 2
    body = {
        "choices": [
            {
                "index": 0,
                "token_ids": [5, 6],
                "finish_reason": "stop",
                "logprobs": {
                    "content": [
                        {
                            "token": "token_id:5",
                            "logprob": -0.2,
                            "top_logprobs": [
                                {"token": "token_id:5", "logprob": -0.2},
                                {"token": "token_id:8", "logprob": -2.0},
                            ],
                        },
                        {
                            "token": "token_id:6",
                            "logprob": -0.4,
                            "top_logprobs": [{"token": "token_id:6", "logprob": -0.4}],
                        },
                    ]
                },
                "routed_experts": _npy_b64(np.zeros((3 + 2 - 1, LAYERS, TOP_K), dtype=np.uint8)),
                "weight_versions": [{"version": 7, "start": 0, "end": 2}],
                "sampling_mask": [[5, 8], [6]],
                "sampling_mask_logprobs": [-0.1, 0.0],
            }
        ]
    }
    (s,) = vllm_samples(body, REQUEST, fallback_version=None)
    assert s.output_token_ids == [5, 6] and s.raw_logprobs == [-0.2, -0.4] and s.logprobs == [-0.1, 0.0]
    assert s.top_ids == [[5, 8], [6]] and s.kept_ids == [[5, 8], [6]]
    assert np.array(s.routed_experts).shape == (4, LAYERS, TOP_K)
    assert [(v.version, v.start, v.end) for v in s.version_spans] == [(7, 0, 2)]


def test_vllm_completion_style_logprobs_and_no_spans():
    body = {
        "choices": [
            {
                "index": 0,
                "token_ids": [5],
                "finish_reason": "length",
                "logprobs": {
                    "tokens": ["token_id:5"],
                    "token_logprobs": [-0.7],
                    "top_logprobs": [{"token_id:5": -0.7, "token_id:2": -1.1}],
                },
            }
        ]
    }
    (s,) = vllm_samples(body, REQUEST, fallback_version=12)
    assert s.top_ids == [[5, 2]] and s.logprobs == [-0.7]
    assert [(v.version, v.start, v.end) for v in s.version_spans] == [(12, 0, 1)]
    assert s.kept_ids is None and s.routed_experts is None


@pytest.fixture
async def fake_sglang(tmp_path):
    """An HTTP server answering like SGLang's documented routes, recording the call order."""
    calls: list[str] = []
    state = {"version": "0"}

    async def handle(request: web.Request) -> web.Response:
        calls.append(request.path)
        body = await request.json() if request.can_read_body else {}
        if request.path == "/server_info":
            return web.json_response(
                {"version": "0.5.9", "server_args": {"enable_return_routed_experts": True, "attention_backend": "fa3"}}
            )
        if request.path == "/model_info":
            return web.json_response({"model_path": "x", "weight_version": state["version"]})
        if request.path == "/update_weights_from_disk":
            state["version"] = body["weight_version"]
            return web.json_response({"success": True, "message": "ok", "num_paused_requests": 0})
        if request.path == "/generate":
            n = len(body["input_ids"]) if isinstance(body["input_ids"][0], list) else 1
            return web.json_response([_sglang_item([5, 6, 7, 8]) for _ in range(n)])
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    model_dir = tmp_path / "v1"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"num_hidden_layers": 2, "num_experts": 4, "num_experts_per_tok": 2}')
    yield f"http://127.0.0.1:{port}", calls, model_dir
    await runner.cleanup()


async def test_sglang_adapter_probes_commits_and_generates(fake_sglang):
    url, calls, model_dir = fake_sglang
    engine = SGLangEngine(url)
    await engine.start()
    caps = await engine.capabilities()
    assert caps.routed_experts and caps.sampling_mask and caps.version_spans and caps.engine_version == "0.5.9"
    assert engine.weight_version() == 0
    pause = await engine.load_weights(model_dir, 1)
    assert pause >= 0 and engine.weight_version() == 1
    commit = calls[calls.index("/pause_generation") :]
    assert commit[:3] == ["/pause_generation", "/update_weights_from_disk", "/continue_generation"]
    samples = await engine.generate(REQUEST)
    assert len(samples) == 2 and samples[0].version_spans[-1].version == 4
    assert np.array(samples[0].routed_experts).shape == (6, 2, 2)
    await engine.set_weight_version(2)
    assert engine.weight_version() == 2 and calls[-1] == "/update_weight_version"
    assert await engine.health()
    await engine.shutdown()
