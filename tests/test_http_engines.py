"""vLLM / SGLang adapters: requests and responses mapped per the engines' documented schemas.

The real engines need GPUs (see tests/test_gpu_engines.py and infra/gpu_check.sh); here the
pure mappers are checked against bodies written from the documented formats, and the adapters'
call sequences and weight loads against small HTTP servers that answer in those formats and
record what they were sent (for a load: the tensors in the directory, read while it exists).
"""

import base64
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from aiohttp import web
from safetensors import safe_open

from pipeline.keyframe import write_checkpoint
from schemas import SamplingParams
from workers.sampler.engines.base import EngineError, GenerateRequest
from workers.sampler.engines.http_base import EngineUnreachable
from workers.sampler.engines.partial_checkpoint import (
    PARTIAL_PREFIX,
    choose_tensors,
    remove_partial_checkpoint,
    write_partial_checkpoint,
)
from workers.sampler.engines.sglang import SGLangEngine, sglang_generate_payload, sglang_samples
from workers.sampler.engines.vllm import VLLMEngine, vllm_generate_payload, vllm_samples

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


# ---------------------------------------------------------------- fake servers and a small version

MODEL_CONFIG = {"model_type": "qwen3_moe", "num_hidden_layers": 2, "num_experts": 3, "num_experts_per_tok": 2}
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    """A small MoE checkpoint in the served layout: big embeddings, two layers of three experts."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": rand(256, 16), "lm_head.weight": rand(256, 16)}
    tensors["model.norm.weight"] = rand(16)
    for layer in range(2):
        prefix = f"model.layers.{layer}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[f"{prefix}.self_attn.{proj}.weight"] = rand(16, 16)
        tensors[f"{prefix}.mlp.gate.weight"] = rand(3, 16)
        for expert in range(3):
            for proj in PROJECTIONS:
                tensors[f"{prefix}.mlp.experts.{expert}.{proj}.weight"] = (
                    rand(8, 16) if proj != "down_proj" else rand(16, 8)
                )
    return tensors


def _version(root: Path, name: str, seed: int = 0, config: dict | None = None) -> Path:
    path = root / name
    write_checkpoint(path, _tensors(seed), config or MODEL_CONFIG, max_shard_bytes=4096)
    return path


def _read_directory(directory: Path) -> dict[str, bytes]:
    """Every tensor a directory holds, as raw bytes (what an engine's disk loader would iterate)."""
    out = {}
    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                out[name] = f.get_tensor(name).contiguous().view(torch.uint8).numpy().tobytes()
    return out


@dataclass
class Loads:
    """What a fake engine was asked to load: per update, the directory and the tensors in it."""

    calls: list[str] = field(default_factory=list)
    updates: list[dict] = field(default_factory=list)
    directories: list[Path] = field(default_factory=list)
    tensors: list[dict[str, bytes]] = field(default_factory=list)

    def record(self, body: dict, directory: Path) -> None:
        self.updates.append(body)
        self.directories.append(directory)
        self.tensors.append(_read_directory(directory))


async def _serve(handle):
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


@dataclass
class FakeSGLang:
    """Answers like SGLang's routes. `refuse` says which disk updates fail as SGLang reports a failed
    one (HTTP 400, `success: false`): "none", "partial" (any directory but a version's own), "all";
    "drop" closes the connection on a partial update without answering."""

    url: str = ""
    loads: Loads = field(default_factory=Loads)
    server_args: dict = field(
        default_factory=lambda: {"enable_return_routed_experts": True, "attention_backend": "fa3"}
    )
    refuse: str = "none"
    answer: dict | None = None
    version: str = "0"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.loads.calls.append(request.path)
        body = await request.json() if request.can_read_body else {}
        if request.path == "/server_info":
            return web.json_response({"version": "0.5.23", "server_args": self.server_args})
        if request.path == "/model_info":
            return web.json_response({"model_path": "x", "weight_version": self.version})
        if request.path == "/update_weights_from_disk":
            directory = Path(body["model_path"])
            self.loads.record(body, directory)
            partial = directory.name.startswith(PARTIAL_PREFIX)
            if partial and self.refuse == "drop":
                request.transport.close()
                return web.Response()
            if self.refuse == "all" or (self.refuse == "partial" and partial):
                return web.json_response(
                    {"success": False, "message": "missing weights", "num_paused_requests": 0}, status=400
                )
            if self.answer is not None:
                return web.json_response(self.answer)
            self.version = body["weight_version"]
            return web.json_response({"success": True, "message": "ok", "num_paused_requests": 0})
        if request.path == "/update_weight_version":
            self.version = body["new_version"]
        if request.path == "/generate":
            n = len(body["input_ids"]) if isinstance(body["input_ids"][0], list) else 1
            return web.json_response([_sglang_item([5, 6, 7, 8]) for _ in range(n)])
        return web.json_response({"status": "ok"})


@pytest.fixture
async def fake_sglang():
    fake = FakeSGLang()
    runner, fake.url = await _serve(fake.handle)
    yield fake
    await runner.cleanup()


@pytest.fixture
async def sglang(fake_sglang):
    engine = SGLangEngine(fake_sglang.url)
    await engine.start()
    yield engine
    await engine.shutdown()


def _partials_left(root: Path) -> list[Path]:
    return list(root.glob(f"{PARTIAL_PREFIX}*"))


# ---------------------------------------------------------------- SGLang


async def test_sglang_adapter_probes_commits_and_generates(fake_sglang, sglang, tmp_path):
    caps = await sglang.capabilities()
    assert caps.routed_experts and caps.sampling_mask and caps.version_spans and caps.engine_version == "0.5.23"
    assert caps.load_changed_tensors  # unquantized, CUDA, default MoE runner
    assert sglang.weight_version() == 0
    model_dir = _version(tmp_path, "v1")
    pause = await sglang.load_weights(model_dir, 1)
    assert pause >= 0 and sglang.weight_version() == 1
    calls = fake_sglang.loads.calls
    assert calls[calls.index("/pause_generation") :][:3] == [
        "/pause_generation",
        "/update_weights_from_disk",
        "/continue_generation",
    ]
    assert fake_sglang.loads.directories == [model_dir]
    samples = await sglang.generate(REQUEST)
    assert len(samples) == 2 and samples[0].version_spans[-1].version == 4
    assert np.array(samples[0].routed_experts).shape == (6, 2, 2)
    await sglang.set_weight_version(2)
    assert sglang.weight_version() == 2 and calls[-1] == "/update_weight_version"
    assert await sglang.health()


async def test_sglang_loads_only_the_changed_tensors_and_what_must_change_with_them(fake_sglang, sglang, tmp_path):
    await sglang.load_weights(_version(tmp_path, "v0"), 0)
    v1 = _version(tmp_path, "v1", seed=1)
    changed = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.experts.2.up_proj.weight"]
    await sglang.load_weights(v1, 1, changed)

    sent_to, sent = fake_sglang.loads.directories[-1], fake_sglang.loads.tensors[-1]
    fused_layer = {f"model.layers.1.mlp.experts.{e}.{p}.weight" for e in range(3) for p in PROJECTIONS}
    assert set(sent) == {changed[0]} | fused_layer  # a fused expert layer goes whole
    source = _read_directory(v1)
    assert all(sent[name] == source[name] for name in sent)  # bit for bit
    assert sent_to.parent == v1.parent and sent_to != v1
    assert json.loads((v1 / "config.json").read_text()) == MODEL_CONFIG  # the version is untouched
    assert not _partials_left(tmp_path)  # removed after the load
    assert fake_sglang.loads.updates[-1]["weight_version"] == "1"
    assert fake_sglang.loads.calls[-3:] == ["/pause_generation", "/update_weights_from_disk", "/continue_generation"]
    assert sglang.weight_version() == 1 and (await sglang.capabilities()).load_changed_tensors


async def test_sglang_refused_partial_update_falls_back_to_the_whole_version(fake_sglang, sglang, tmp_path):
    """A partial update SGLang refuses may have applied some tensors already: the whole version is
    loaded within the same pause, and partial updates are not tried on that server again."""
    fake_sglang.refuse = "partial"
    await sglang.load_weights(_version(tmp_path, "v0"), 0)
    v1 = _version(tmp_path, "v1", seed=1)
    await sglang.load_weights(v1, 1, ["model.norm.weight"])
    assert set(fake_sglang.loads.tensors[-2]) == {"model.norm.weight"}
    assert fake_sglang.loads.directories[-1] == v1 and set(fake_sglang.loads.tensors[-1]) == set(_tensors(1))
    assert fake_sglang.loads.calls[-4:] == [
        "/pause_generation",
        "/update_weights_from_disk",
        "/update_weights_from_disk",
        "/continue_generation",
    ]
    assert sglang.weight_version() == 1 and not _partials_left(tmp_path)
    assert not (await sglang.capabilities()).load_changed_tensors

    v2 = _version(tmp_path, "v2", seed=2)
    await sglang.load_weights(v2, 2, ["model.norm.weight"])
    assert fake_sglang.loads.directories[-2:] == [v1, v2]  # straight to the whole version


async def test_sglang_refusing_partial_and_whole_is_a_clear_error_and_keeps_the_version(fake_sglang, sglang, tmp_path):
    await sglang.load_weights(_version(tmp_path, "v0"), 0)
    fake_sglang.refuse = "all"
    with pytest.raises(EngineError, match="partly updated") as refused:
        await sglang.load_weights(_version(tmp_path, "v1", seed=1), 1, ["model.norm.weight"])
    assert not refused.value.retryable and "missing weights" in str(refused.value)
    assert sglang.weight_version() == 0
    assert fake_sglang.loads.calls[-1] == "/continue_generation"  # requests are not left paused
    assert not _partials_left(tmp_path)


async def test_sglang_refused_whole_version_is_an_error_and_keeps_the_version(fake_sglang, sglang, tmp_path):
    await sglang.load_weights(_version(tmp_path, "v0"), 0)
    fake_sglang.refuse = "all"
    with pytest.raises(EngineError, match=r"sglang refused \S*/v1: .*HTTP 400.*missing weights"):
        await sglang.load_weights(_version(tmp_path, "v1", seed=1), 1)
    assert sglang.weight_version() == 0 and fake_sglang.loads.calls[-1] == "/continue_generation"


async def test_sglang_answer_without_success_is_a_refusal(fake_sglang, sglang, tmp_path):
    fake_sglang.answer = {"message": "queued"}
    with pytest.raises(EngineError, match="queued"):
        await sglang.load_weights(_version(tmp_path, "v0"), 0)
    assert sglang.weight_version() == 0


async def test_sglang_no_answer_to_a_partial_update_is_not_taken_for_a_refusal(fake_sglang, sglang, tmp_path):
    """Without an answer the engine may still be applying the partial update: loading the whole
    version over it would race it, so the load fails as unreachable (retryable) instead."""
    await sglang.load_weights(_version(tmp_path, "v0"), 0)
    fake_sglang.refuse = "drop"
    updates = fake_sglang.loads.calls.count("/update_weights_from_disk")
    with pytest.raises(EngineUnreachable):
        await sglang.load_weights(_version(tmp_path, "v1", seed=1), 1, ["model.norm.weight"])
    assert fake_sglang.loads.calls.count("/update_weights_from_disk") == updates + 1
    assert sglang.weight_version() == 0 and (await sglang.capabilities()).load_changed_tensors
    assert not _partials_left(tmp_path)


@pytest.mark.parametrize(
    ("why", "server_args", "config", "changed"),
    [
        ("fp8 server", {"quantization": "fp8"}, MODEL_CONFIG, ["model.norm.weight"]),
        ("re-shuffling MoE runner", {"moe_runner_backend": "flashinfer_trtllm"}, MODEL_CONFIG, ["model.norm.weight"]),
        (
            "quantized version",
            {},
            {**MODEL_CONFIG, "quantization_config": {"quant_method": "fp8"}},
            ["model.norm.weight"],
        ),
        ("most bytes changed", {}, MODEL_CONFIG, ["model.embed_tokens.weight", "lm_head.weight"]),
        ("names not in the version", {}, MODEL_CONFIG, ["model.layers.9.mlp.gate.weight"]),
        ("no changed list", {}, MODEL_CONFIG, None),
    ],
)
async def test_sglang_loads_the_whole_version_when_a_partial_one_is_unsafe(
    fake_sglang, sglang, tmp_path, why, server_args, config, changed
):
    fake_sglang.server_args = {**fake_sglang.server_args, **server_args}
    await sglang.load_weights(_version(tmp_path, "v0", config=config), 0)
    v1 = _version(tmp_path, "v1", seed=1, config=config)
    await sglang.load_weights(v1, 1, changed)
    assert fake_sglang.loads.directories[-1] == v1, why
    assert set(fake_sglang.loads.tensors[-1]) == set(_tensors(1))
    assert sglang.weight_version() == 1 and not _partials_left(tmp_path)


async def test_sglang_nothing_changed_relabels_without_loading(fake_sglang, sglang, tmp_path):
    await sglang.load_weights(_version(tmp_path, "v0"), 0)
    await sglang.load_weights(_version(tmp_path, "v1"), 1, [])
    assert fake_sglang.loads.calls.count("/update_weights_from_disk") == 1
    assert fake_sglang.loads.calls[-1] == "/update_weight_version" and fake_sglang.version == "1"
    assert sglang.weight_version() == 1


async def test_sglang_partial_copies_left_by_a_killed_process_are_swept(fake_sglang, sglang, tmp_path):
    stale = tmp_path / f"{PARTIAL_PREFIX}stale"
    stale.mkdir()
    (stale / "model-00001-of-00001.safetensors").write_bytes(b"half written")
    (stale / ".owner").touch()  # its owner lock died with the process
    await sglang.load_weights(_version(tmp_path, "v0"), 0)
    await sglang.load_weights(_version(tmp_path, "v1", seed=1), 1, ["model.norm.weight"])
    assert not _partials_left(tmp_path)


def test_a_partial_copy_another_live_island_holds_is_not_swept(tmp_path):
    """Islands of one view on one host share a cache directory: one island's sweep must not delete the
    copy another live island's engine is loading, and must delete it once that process is gone."""
    import subprocess
    import sys

    write_checkpoint(tmp_path / "v3", _tensors(0), MODEL_CONFIG, max_shard_bytes=4096)
    theirs = tmp_path / f"{PARTIAL_PREFIX}theirs"
    theirs.mkdir()
    (theirs / "model-00001-of-00001.safetensors").write_bytes(b"being loaded")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys; f = open(sys.argv[1], 'wb'); fcntl.flock(f, fcntl.LOCK_EX); "
            "print('held', flush=True); sys.stdin.read()",
            str(theirs / ".owner"),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        mine = write_partial_checkpoint(tmp_path / "v3", frozenset({"model.norm.weight"}))
        assert theirs.exists() and (theirs / "model-00001-of-00001.safetensors").read_bytes() == b"being loaded"
        remove_partial_checkpoint(mine)
    finally:
        holder.kill()
        holder.wait()
    mine = write_partial_checkpoint(tmp_path / "v3", frozenset({"model.norm.weight"}))
    assert not theirs.exists()  # its owner is dead: swept
    remove_partial_checkpoint(mine)
    assert not _partials_left(tmp_path)


async def test_sglang_no_room_for_the_partial_copy_loads_the_whole_version(fake_sglang, sglang, tmp_path, monkeypatch):
    import errno

    import workers.sampler.engines.sglang as sglang_module

    def no_room(directory, names):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sglang_module, "write_partial_checkpoint", no_room)
    await sglang.load_weights(_version(tmp_path, "v0"), 0)
    v1 = _version(tmp_path, "v1", seed=1)
    await sglang.load_weights(v1, 1, ["model.norm.weight"])
    assert fake_sglang.loads.directories[-1] == v1 and sglang.weight_version() == 1


def test_partial_copy_keeps_fp8_weights_with_their_scales_bit_for_bit(tmp_path):
    """The partial copy itself: a block-fp8 weight travels with its `_scale_inv` whichever of the two
    changed, and the copied bits are the version's bits."""
    tensors = _tensors(0)
    q = "model.layers.0.self_attn.q_proj.weight"
    tensors[q] = (torch.randn(16, 16) * 3).to(torch.float8_e4m3fn)
    tensors[q + "_scale_inv"] = torch.rand(1, 1)
    write_checkpoint(tmp_path / "v3", tensors, MODEL_CONFIG, max_shard_bytes=4096)
    for changed in ([q], [q + "_scale_inv"]):
        choice = choose_tensors(tmp_path / "v3", changed)
        assert choice.names == {q, q + "_scale_inv"}
        partial = write_partial_checkpoint(tmp_path / "v3", choice.names)
        copied, source = _read_directory(partial), _read_directory(tmp_path / "v3")
        assert copied == {name: source[name] for name in choice.names}
        assert sum(len(b) for b in copied.values()) == choice.nbytes
        remove_partial_checkpoint(partial)
    assert not _partials_left(tmp_path)


async def test_sglang_index_naming_missing_tensors_loads_the_whole_version(fake_sglang, sglang, tmp_path):
    """An index that names tensors no shard holds cannot be sized: no partial copy is guessed at."""
    await sglang.load_weights(_version(tmp_path, "v0"), 0)
    v1 = _version(tmp_path, "v1", seed=1)
    index = json.loads((v1 / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.mlp.ghost.weight"] = next(iter(index["weight_map"].values()))
    (v1 / "model.safetensors.index.json").write_text(json.dumps(index))
    await sglang.load_weights(v1, 1, ["model.norm.weight"])
    assert fake_sglang.loads.directories[-1] == v1 and not _partials_left(tmp_path)


# ---------------------------------------------------------------- vLLM


@dataclass
class FakeVLLM:
    """Answers like vLLM's dev-mode RLHF routes with the shared-disk backend; `refuse` makes
    `/update_weights` fail as vLLM does when the backend raises (HTTP 500)."""

    url: str = ""
    loads: Loads = field(default_factory=Loads)
    refuse: bool = False
    version: str = "0"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.loads.calls.append(request.path)
        body = await request.json() if request.can_read_body else {}
        if request.path == "/version":
            return web.json_response({"version": "0.33.0"})
        if request.path == "/weight_info":
            return web.json_response({"weight_version": self.version})
        if request.path == "/inference/v1/generate":
            return web.json_response(
                {"choices": [{"index": 0, "token_ids": [5], "finish_reason": "length", "logprobs": None}]}
            )
        if request.path == "/update_weights":
            self.loads.record(body, Path(body["update_info"]["path"]))
            if self.refuse:
                return web.json_response(
                    {"error": "Following weights were not initialized from checkpoint"}, status=500
                )
        if request.path == "/finish_weight_update":
            self.version = body["weight_version"]
        return web.json_response({"message": "ok"})


@pytest.fixture
async def vllm(tmp_path):
    fake = FakeVLLM()
    runner, fake.url = await _serve(fake.handle)
    engine = VLLMEngine(fake.url)
    await engine.start()
    yield engine, fake
    await engine.shutdown()
    await runner.cleanup()


async def test_vllm_always_loads_the_whole_version(vllm, tmp_path):
    """vLLM's disk backend takes a path to a complete checkpoint and nothing else: even told what
    changed, the adapter sends the version's own directory, whole."""
    engine, fake = vllm
    assert not (await engine.capabilities()).load_changed_tensors
    await engine.load_weights(_version(tmp_path, "v0"), 0)
    v1 = _version(tmp_path, "v1", seed=1)
    await engine.load_weights(v1, 1, ["model.norm.weight"])
    assert fake.loads.updates[-1] == {"update_info": {"path": str(v1)}}
    assert set(fake.loads.tensors[-1]) == set(_tensors(1))
    assert fake.loads.calls[-5:] == [
        "/pause",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/resume",
    ]
    assert fake.version == "1" and engine.weight_version() == 1
    assert not _partials_left(tmp_path)


async def test_vllm_refused_update_is_an_error_and_keeps_the_version(vllm, tmp_path):
    engine, fake = vllm
    await engine.load_weights(_version(tmp_path, "v0"), 0)
    fake.refuse = True
    with pytest.raises(EngineError, match="not initialized from checkpoint"):
        await engine.load_weights(_version(tmp_path, "v1", seed=1), 1)
    assert engine.weight_version() == 0 and fake.version == "0"
    assert fake.loads.calls[-3:] == ["/start_weight_update", "/update_weights", "/resume"]  # never finished
