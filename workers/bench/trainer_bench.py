"""`sprawl bench trainer`: where an update's time goes, against the bare forward/backward/step.

For a demo-sized Qwen3-MoE and a batch shaped like the demo run's, the same update is timed bare
(plain policy gradient), with each correction alone, and with the default set together; then the
version publish that follows an update (bf16 + fp8 views, diff against the previous version,
upload, fenced append) on a private stack. Figures are medians of repeated runs in one process.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import torch

from infra.streams import apply
from pipeline.batching import GroupBatchItem
from pipeline.blobstore import open_blob_store
from pipeline.chain_publish import ChainPublisher
from pipeline.config import ChainSettings
from pipeline.eventlog import EventLog
from pipeline.logs import configure_logging
from pipeline.off_policy import LossSection, apply_spec
from schemas import IslandIdentity, Reward, SamplingParams, Trajectory, VersionSpan
from workers.bench.private_stack import private_stack
from workers.trainer.settings import TrainerSection
from workers.trainer.update import run_update

BARE = LossSection(importance="none", score_centering=False, mask_replay=False)
DEFAULT = LossSection()  # MIS (token) + score centering + mask replay, as the trainer runs by default
CORRECTIONS = {
    "mis_token": "mis",
    "tis_sequence": "tis+seq",
    "geometric_rejection": "geo",
    "score_centering": "sc",
    "mask_replay": "mask",
}
"""Each correction alone, as a `--correction` spec (`pipeline.off_policy.registry`)."""


def demo_model(quick: bool):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=128 if quick else 256,
        intermediate_size=256 if quick else 512,
        moe_intermediate_size=64 if quick else 128,
        num_hidden_layers=2 if quick else 4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32 if quick else 64,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    return Qwen3MoeForCausalLM(config)


def synthetic_batch(model, groups: int, n: int, prompt_len: int, out_len: int) -> list[GroupBatchItem]:
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    layers, k = model.config.num_hidden_layers, model.config.num_experts_per_tok
    island = IslandIdentity(island_id="bench", accelerator="cpu", view="bf16", engine="torch")
    batch = []
    for g in range(groups):
        prompt = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
        trajectories, rewards = [], []
        for i in range(n):
            output = torch.randint(0, vocab, (out_len,), generator=gen).tolist()
            top = [torch.randperm(vocab, generator=gen)[:8].tolist() for _ in range(out_len)]
            kept = [sorted(set(ids[:6]) | {tok}) for ids, tok in zip(top, output, strict=True)]
            routed = torch.randint(0, model.config.num_experts, (prompt_len + out_len - 1, layers, k), generator=gen)
            trajectories.append(
                Trajectory(
                    run_id="bench",
                    trajectory_id=f"g{g}-{i}",
                    group_id=f"g{g}",
                    sample_index=i,
                    task="bench",
                    prompt_token_ids=prompt,
                    output_token_ids=output,
                    logprobs=[-1.5] * out_len,
                    finish_reason="stop",
                    version_spans=[VersionSpan(version=0, start=0, end=out_len)],
                    island=island,
                    sampling=SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=out_len, logprobs_top_k=8),
                    top_logprob_ids=top,
                    top_logprobs=[[-1.0 - 0.2 * j for j in range(8)] for _ in range(out_len)],
                    top_p_kept_ids=kept,
                    routed_experts=routed.tolist(),
                    group_size=n,
                )
            )
            rewards.append(
                Reward(
                    run_id="bench",
                    trajectory_id=f"g{g}-{i}",
                    group_id=f"g{g}",
                    value=float(i % 2),
                    verifier="bench",
                    verifier_version="1",
                    duration_s=0.0,
                )
            )
        batch.append(GroupBatchItem(f"g{g}", trajectories, rewards, list(range(n)), list(range(n))))
    return batch


def _time_updates(model, batch, configs: dict[str, TrainerSection], repeats: int) -> dict[str, float]:
    """Median time per configuration, rounds interleaved so drift on a shared machine hits all alike."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    times: dict[str, list[float]] = {name: [] for name in configs}
    for cfg in configs.values():
        run_update(model, optimizer, batch, cfg, 0)  # warm-up every code path once
    for _ in range(repeats):
        for name, cfg in configs.items():
            t0 = time.perf_counter()
            run_update(model, optimizer, batch, cfg, 0)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(values) for name, values in times.items()}


async def _time_publish(model, repeats: int) -> float:
    with private_stack("benchtrainer") as settings:
        event_log = await EventLog.connect(settings, worker="bench-trainer")
        try:
            await apply(event_log.js, settings.streams, "benchtrainer")
            publisher = ChainPublisher(
                event_log,
                open_blob_store(settings.blobs),
                run_id="benchtrainer",
                model_config=model.config.to_dict(),
                settings=ChainSettings(views=["bf16", "fp8_e4m3"], keyframe_every=1000),
            )
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            await publisher.publish(0, state)
            times = []
            for version in range(1, repeats + 1):
                with torch.no_grad():
                    for tensor in state.values():
                        tensor.add_(torch.randn(tensor.shape).sign() * 1e-6)
                t0 = time.perf_counter()
                await publisher.publish(version, state)
                times.append(time.perf_counter() - t0)
            publisher.close()
            return statistics.median(times)
        finally:
            await event_log.close()


def bench_trainer(quick: bool) -> tuple[list[dict], dict]:
    configure_logging("bench", fmt="json", level="WARNING")
    torch.set_num_threads(2)
    model = demo_model(quick)
    groups, n = (2, 4) if quick else (4, 8)
    batch = synthetic_batch(model, groups, n, prompt_len=16, out_len=24 if quick else 48)
    repeats = 5 if quick else 9
    configs = {"bare": TrainerSection(loss=BARE)}
    configs |= {name: TrainerSection(loss=apply_spec(BARE, spec)) for name, spec in CORRECTIONS.items()}
    configs["routing_replay"] = TrainerSection(loss=BARE, routing_replay=True)
    configs["default"] = TrainerSection(loss=DEFAULT)
    timed = _time_updates(model, batch, configs, repeats)
    bare, full = timed["bare"], timed["default"]
    rows = [{"what": "bare forward/backward/step", "seconds": bare, "vs_bare": 1.0}]
    rows += [
        {"what": f"+ {name}", "seconds": timed[name], "vs_bare": timed[name] / bare}
        for name in [*CORRECTIONS, "routing_replay"]
    ]
    rows.append({"what": "default corrections (MIS + SC + mask replay)", "seconds": full, "vs_bare": full / bare})
    publish = asyncio.run(_time_publish(model, repeats))
    rows.append(
        {"what": "publish (bf16 + fp8 views, diff, upload, append)", "seconds": publish, "vs_bare": publish / bare}
    )
    step = full + publish
    summary = {
        "quick": quick,
        "parameters": sum(p.numel() for p in model.parameters()),
        "groups": groups,
        "samples_per_group": n,
        "step_s": round(step, 4),
        "bare_s": round(bare, 4),
        "publish_fraction": round(publish / step, 4),
        "corrections_fraction": round((full - bare) / step, 4),
        "per_correction_overhead": {
            r["what"].removeprefix("+ "): round(r["vs_bare"] - 1, 4) for r in rows if r["what"].startswith("+ ")
        },
    }
    table = [{"what": r["what"], "seconds": f"{r['seconds']:.4f}", "vs bare": f"{r['vs_bare']:.3f}"} for r in rows]
    return table, summary
