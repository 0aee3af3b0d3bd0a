"""Real vLLM and SGLang servers (GPU machines only): run through infra/gpu_check.sh, which starts both
engines on a tiny keyframe and sets SPRAWL_TEST_MODEL_DIR, SPRAWL_TEST_SGLANG_URL, SPRAWL_TEST_VLLM_URL.
"""

import json
import os
from pathlib import Path

import pytest
import torch

from pipeline.keyframe import load_shard, read_weight_map, write_checkpoint
from schemas import SamplingParams
from workers.sampler.engines.base import GenerateRequest
from workers.sampler.engines.reference import ReferenceEngine
from workers.sampler.engines.sglang import SGLangEngine
from workers.sampler.engines.vllm import VLLMEngine

pytestmark = pytest.mark.gpu

SAMPLING = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=16, logprobs_top_k=8)
REQUEST = GenerateRequest(prompt_token_ids=[1, 17, 42, 99, 7], n=2, sampling=SAMPLING, seed=3)
GREEDY = GenerateRequest(
    prompt_token_ids=[1, 17, 42, 99, 7],
    n=1,
    sampling=SamplingParams(temperature=0.0, max_new_tokens=16, logprobs_top_k=1),
)


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        pytest.fail(f"{name} is not set: run infra/gpu_check.sh on a GPU machine")
    return value


@pytest.fixture(params=["sglang", "vllm"])
async def engine(request):
    url = _env(f"SPRAWL_TEST_{request.param.upper()}_URL")
    instance = SGLangEngine(url) if request.param == "sglang" else VLLMEngine(url)
    await instance.start()
    yield instance
    await instance.shutdown()


async def test_capabilities_are_probed(engine):
    caps = await engine.capabilities()
    assert caps.top_logprobs and caps.routed_experts
    assert await engine.health()


async def test_generate_returns_everything_and_matches_the_reference(engine):
    model_dir = Path(_env("SPRAWL_TEST_MODEL_DIR"))
    await engine.load_weights(model_dir / "v0", 0)
    samples = await engine.generate(REQUEST)
    assert len(samples) == 2
    reference = ReferenceEngine(device="cuda")
    await reference.start()
    await reference.load_weights(model_dir / "v0", 0)
    for s in samples:
        assert len(s.logprobs) == len(s.output_token_ids) == len(s.top_ids)
        assert s.version_spans[-1].version == 0 and s.version_spans[-1].end == len(s.output_token_ids)
        assert s.routed_experts is not None and len(s.routed_experts[0][0]) == 2
        tokens = torch.tensor([s.prompt_token_ids + s.output_token_ids], device="cuda")
        with torch.no_grad():
            logits = reference.model(input_ids=tokens).logits[0].float()
        start = len(s.prompt_token_ids) - 1
        raw = torch.log_softmax(logits[start : start + len(s.output_token_ids)], dim=-1)
        ours = raw.gather(1, torch.tensor(s.output_token_ids, device="cuda")[:, None]).squeeze(1).cpu()
        assert (torch.tensor(s.raw_logprobs) - ours).abs().mean() < 0.1


async def test_weight_commit_changes_the_version(engine):
    model_dir = Path(_env("SPRAWL_TEST_MODEL_DIR"))
    pause = await engine.load_weights(model_dir / "v1", 1)
    assert pause < 60 and engine.weight_version() == 1
    samples = await engine.generate(REQUEST)
    assert all(s.version_spans[-1].version == 1 for s in samples)
    await engine.load_weights(model_dir / "v0", 0)


def _partly_changed_version(model_dir: Path, names: list[str]) -> Path:
    """v0 with `names` taken from v1: a version in which only those tensors changed."""
    v0, v1 = model_dir / "v0", model_dir / "v1"
    weight_map = read_weight_map(v0)
    tensors = {}
    for shard in sorted(set(weight_map.values())):
        tensors |= load_shard(v0 / shard)
    for shard in sorted({read_weight_map(v1)[n] for n in names}):
        tensors |= {n: t for n, t in load_shard(v1 / shard).items() if n in names}
    path = model_dir / "v0-partly-changed"
    write_checkpoint(path, tensors, json.loads((v0 / "config.json").read_text()), weight_map=weight_map)
    return path


async def test_sglang_partial_load_serves_what_a_full_load_serves():
    """A real SGLang takes the partial copy (the adapter does not fall back) and then serves exactly
    what it serves after loading the same version whole."""
    model_dir = Path(_env("SPRAWL_TEST_MODEL_DIR"))
    engine = SGLangEngine(_env("SPRAWL_TEST_SGLANG_URL"))
    await engine.start()
    try:
        assert (await engine.capabilities()).load_changed_tensors
        names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.experts.3.up_proj.weight"]
        changed_version = _partly_changed_version(model_dir, names)
        await engine.load_weights(model_dir / "v0", 0)
        await engine.load_weights(changed_version, 10, names)
        assert (await engine.capabilities()).load_changed_tensors  # accepted, not answered by a full load
        partly = await engine.generate(GREEDY)
        await engine.load_weights(changed_version, 11)
        whole = await engine.generate(GREEDY)
        assert partly[0].output_token_ids == whole[0].output_token_ids
        assert (torch.tensor(partly[0].raw_logprobs) - torch.tensor(whole[0].raw_logprobs)).abs().max() < 1e-3
        assert partly[0].version_spans[-1].version == 10 and whole[0].version_spans[-1].version == 11
        await engine.load_weights(model_dir / "v0", 0)
    finally:
        await engine.shutdown()


async def test_vllm_never_claims_partial_loads():
    engine = VLLMEngine(_env("SPRAWL_TEST_VLLM_URL"))
    await engine.start()
    try:
        assert not (await engine.capabilities()).load_changed_tensors
    finally:
        await engine.shutdown()
