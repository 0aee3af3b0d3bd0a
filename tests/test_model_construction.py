"""Models built on several threads of one process (a trainer and islands in one test process) each get
the dtype they asked for: transformers switches torch's process-wide default dtype while it builds."""

import asyncio

import torch

from tests.tiny_models import tiny_moe
from workers.sampler.engines.reference import ReferenceEngine


async def test_engines_built_at_once_are_each_in_their_own_dtype(tmp_path):
    model = tiny_moe()
    model.config.save_pretrained(tmp_path)
    trials = []
    for _ in range(8):  # unguarded, about every trial mixed float32 layers into a bf16 model
        engines = [ReferenceEngine(dtype=dtype) for dtype in (torch.bfloat16, torch.bfloat16, torch.float32)]
        states = [{k: v.to(engine.dtype) for k, v in model.state_dict().items()} for engine in engines]
        await asyncio.gather(
            *(asyncio.to_thread(e._build, tmp_path, state, 0) for e, state in zip(engines, states, strict=True))
        )
        trials.append([{p.dtype for p in engine.model.parameters()} for engine in engines])
    for dtypes in trials:
        assert dtypes == [{torch.bfloat16}, {torch.bfloat16}, {torch.float32}], trials
