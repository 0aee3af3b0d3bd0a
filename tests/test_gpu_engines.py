"""Real vLLM and SGLang servers (GPU machines only): run through infra/gpu_check.sh, which starts both
engines on a tiny keyframe and sets SPRAWL_TEST_MODEL_DIR, SPRAWL_TEST_SGLANG_URL, SPRAWL_TEST_VLLM_URL.
"""

import os
from pathlib import Path

import pytest
import torch

from schemas import SamplingParams
from workers.sampler.engines.base import GenerateRequest
from workers.sampler.engines.reference import ReferenceEngine
from workers.sampler.engines.sglang import SGLangEngine
from workers.sampler.engines.vllm import VLLMEngine

pytestmark = pytest.mark.gpu

SAMPLING = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=16, logprobs_top_k=8)
REQUEST = GenerateRequest(prompt_token_ids=[1, 17, 42, 99, 7], n=2, sampling=SAMPLING, seed=3)


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
