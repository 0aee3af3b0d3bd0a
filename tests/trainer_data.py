"""Inputs for trainer tests: a tiny initial model on disk and sampler-shaped trajectories + rewards.

Trajectories are what an island at version 0 would have produced: random outputs whose recorded
logprobs and top-k come from the initial model itself (teacher-forced), half from a `bf16` group
and half from an `fp8` group.
"""

from __future__ import annotations

from pathlib import Path

import torch

from schemas import IslandIdentity, Reward, SamplingParams, Trajectory, VersionSpan
from tests.tiny_models import tiny_moe

GROUP_SIZE = 4


def write_initial_model(directory: Path) -> Path:
    model = tiny_moe(seed=11)
    model.save_pretrained(directory)
    return directory


def make_groups(
    directory: Path, run_id: str, groups: int, seed: int = 0
) -> list[tuple[list[Trajectory], list[Reward]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    out = []
    for g in range(groups):
        view = "bf16" if g % 2 == 0 else "fp8_e4m3"
        island = IslandIdentity(island_id=f"isl-{view}", accelerator="cpu", view=view, engine="torch", group=view)
        prompt = torch.randint(2, model.config.vocab_size, (5,), generator=gen).tolist()
        trajectories, rewards = [], []
        for i in range(GROUP_SIZE):
            output = torch.randint(2, model.config.vocab_size, (6,), generator=gen).tolist()
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + output[:-1]])).logits[0, len(prompt) - 1 :]
            logp = torch.log_softmax(logits.float(), -1)
            chosen = logp.gather(-1, torch.tensor(output)[:, None]).squeeze(-1)
            top_lp, top_ids = torch.topk(logp, 4, dim=-1)
            trajectory_id = f"g{g}-{i}"
            trajectories.append(
                Trajectory(
                    run_id=run_id,
                    trajectory_id=trajectory_id,
                    group_id=f"g{g}",
                    sample_index=i,
                    task="synthetic",
                    prompt_token_ids=prompt,
                    output_token_ids=output,
                    logprobs=(chosen - 0.01 * (g % 2)).tolist(),
                    finish_reason="length" if i == 0 else "stop",
                    version_spans=[VersionSpan(version=0, start=0, end=6)],
                    island=island,
                    sampling=SamplingParams(temperature=1.0, max_new_tokens=6, logprobs_top_k=4),
                    top_logprob_ids=top_ids.tolist(),
                    top_logprobs=top_lp.tolist(),
                    group_size=GROUP_SIZE,
                )
            )
            rewards.append(
                Reward(
                    run_id=run_id,
                    trajectory_id=trajectory_id,
                    group_id=f"g{g}",
                    value=float(torch.rand(1, generator=gen) < 0.5),
                    verifier="synthetic",
                    verifier_version="1",
                    duration_s=0.0,
                    format_error=(i == 3),
                )
            )
        out.append((trajectories, rewards))
    return out


async def publish_groups(event_log, groups) -> None:
    for trajectories, _ in groups:
        for t in trajectories:
            await event_log.append(t)
    for _, rewards in groups:
        for r in rewards:
            await event_log.append(r)
