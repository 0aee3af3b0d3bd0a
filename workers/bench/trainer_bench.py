"""`sprawl bench trainer`: where an update's time goes, against the bare forward/backward/step.

For a demo-sized Qwen3-MoE and a batch shaped like the demo run's, the same update is timed bare
(plain policy gradient), with each correction alone, and with the default set together. Then the
trainer's step as it runs, update and version publish (bf16 + fp8 views, diff against the previous
version, upload, fenced append) on a private stack, twice in one chain: publishing synchronously
after each update (the baseline: `publish_fraction_sync`), and through the trainer's background
publisher (`workers/trainer/publishing.py`), where the update loop is blocked only to capture the
weights or when `publish_depth` versions are in flight (`publish_fraction`: that time over the step's).
Figures are medians of repeated runs in one process; fractions are totals over the loop.

Two ranks, first (forked gloo processes, on a private stack of their own): the same versions of the
non-quick demo model published by one process and by two ranks that each hold their own units
(`publish_speedup_2_ranks`, with a profile of where each process's time and CPU went:
`rank_publish_bench.py`), and rank 0's loop of the sharded trainer with its background publisher
(`publish_fraction_2_ranks`: `rank_training_bench.py`).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from infra.streams import apply
from pipeline.batching import GroupBatchItem
from pipeline.blobstore import open_blob_store
from pipeline.chain_publish import ChainPublisher
from pipeline.config import ChainSettings
from pipeline.eventlog import EventLog
from pipeline.logs import configure_logging
from pipeline.off_policy import LossSection, apply_spec
from pipeline.views import get_view
from schemas import IslandIdentity, Reward, SamplingParams, Trajectory, VersionSpan
from workers.bench.private_stack import private_stack
from workers.bench.rank_publish_bench import PublishComparison, apply_streams, compare_publishing, default_arms
from workers.bench.rank_training_bench import RankLoopTimes, time_two_rank_loop
from workers.lifecycle import end_guards, run_guarded
from workers.trainer.publishing import BackgroundPublisher, Pending, copy_weights
from workers.trainer.settings import TrainerSection, TrainerSettings
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
            # k distinct experts a position, as a router picks them (admission refuses a repeated one).
            scores = torch.rand((prompt_len + out_len - 1, layers, model.config.num_experts), generator=gen)
            routed = scores.argsort(dim=-1)[..., :k]
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


VIEWS = ["bf16", "fp8_e4m3"]


@dataclass
class LoopTimes:
    """Per step of one training loop: the update, and the time the loop was blocked on publishing."""

    update: list[float] = field(default_factory=list)
    blocked: list[float] = field(default_factory=list)

    def add(self, update: float, blocked: float) -> None:
        self.update.append(update)
        self.blocked.append(blocked)

    @property
    def steps(self) -> list[float]:
        return [u + b for u, b in zip(self.update, self.blocked, strict=True)]

    @property
    def fraction(self) -> float:
        """Blocked on publishing over the step, totals over the loop (a keyframe's spike counts in full)."""
        return sum(self.blocked) / sum(self.steps)


async def _time_training_loops(model, batch, cfg: TrainerSection, repeats: int) -> tuple[LoopTimes, LoopTimes]:
    """The trainer's step, update then publish, in one chain: synchronously, then through the trainer's
    background publisher with its default depth. Updates run in a thread, as the trainer runs them."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate)
    sync, background = LoopTimes(), LoopTimes()
    with private_stack("benchtrainer") as settings:
        event_log = await EventLog.connect(settings, worker="bench-trainer")
        try:
            await apply(event_log.js, settings.streams, "benchtrainer")
            publisher = ChainPublisher(
                event_log,
                open_blob_store(settings.blobs),
                run_id="benchtrainer",
                model_config=model.config.to_dict(),
                settings=ChainSettings(views=VIEWS, keyframe_every=1000),
            )
            await publisher.publish(0, model.state_dict())
            version = 0
            for _ in range(repeats):
                t0 = time.perf_counter()
                await asyncio.to_thread(run_update, model, optimizer, batch, cfg, version)
                t1 = time.perf_counter()
                version += 1
                await publisher.publish(version, model.state_dict())
                sync.add(t1 - t0, time.perf_counter() - t1)

            async def publish(pending: Pending[None]) -> None:
                await publisher.publish(pending.version, pending.weights)

            queue: BackgroundPublisher[None] = BackgroundPublisher(publish, cfg.publish_depth, name="bench publisher")

            async def loop(version: int) -> None:
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    await asyncio.to_thread(run_update, model, optimizer, batch, cfg, version)
                    update = time.perf_counter() - t0
                    version += 1
                    background.add(update, await queue.submit(version, model.state_dict(), None))
                await queue.drain()  # after the last step: its publish is not part of any step

            guards = [queue.start()]
            try:
                await run_guarded(loop(version), guards)
            finally:
                await end_guards(guards)
            publisher.close()
            return sync, background
        finally:
            await event_log.close()


def _time_capture(model, repeats: int) -> tuple[float, float]:
    """Median seconds to capture the weights (a copy into a reused snapshot), and to compute the views
    instead (the other way to let the next update start): why the trainer copies."""
    state = model.state_dict()
    snapshot: dict[str, torch.Tensor] = {}
    copy_weights(snapshot, state)
    tie = bool(model.config.to_dict().get("tie_word_embeddings", False))
    copies, views = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        copy_weights(snapshot, state)
        t1 = time.perf_counter()
        for name in VIEWS:
            get_view(name).compute(state, tie_word_embeddings=tie)
        views.append(time.perf_counter() - t1)
        copies.append(t1 - t0)
    return statistics.median(copies), statistics.median(views)


def _time_two_ranks(
    model, batch, cfg: TrainerSection, repeats: int, quick: bool
) -> tuple[PublishComparison, RankLoopTimes]:
    """Two ranks, on one private stack: publishing the same versions as one process (the non-quick demo
    model even under --quick: smaller, fixed costs would hide the split), and rank 0's training loop
    (`model`, `batch`, `cfg`: those of the 1-process loops)."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # the ranks load the model: no bars between the tables
    # The pinned arms (one core against a core a rank) say what sharding gives with cores of its own.
    arms = default_arms()[:2] if quick else default_arms()
    with private_stack("benchranks") as stack, tempfile.TemporaryDirectory(prefix="sprawl-bench-ranks-") as tmp:
        asyncio.run(apply_streams(stack))
        comparison = compare_publishing(
            stack,
            demo_model(quick=False),
            versions=10 if quick else 24,
            keyframe_every=5 if quick else 8,
            views=VIEWS,
            scratch=Path(tmp),
            arms=arms,
        )
        model.save_pretrained(Path(tmp) / "model")
        settings = TrainerSettings(
            **stack.model_dump(include={"run_id", "nats", "blobs", "log", "streams"}),
            trainer=cfg.model_copy(
                update={"model_dir": Path(tmp) / "model", "ranks": 2, "groups_per_batch": len(batch)}
            ),
            chain=ChainSettings(views=VIEWS, keyframe_every=1000),
        )
        loop = time_two_rank_loop(settings, batch, repeats, Path(tmp))
    return comparison, loop


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
    # First: the ranks are forked before this process's own thread pools have run anything.
    ranked, ranked_loop = _time_two_ranks(model, batch, configs["default"], repeats, quick)
    timed = _time_updates(model, batch, configs, repeats)
    bare, full = timed["bare"], timed["default"]
    rows = [{"what": "bare forward/backward/step", "seconds": bare, "vs_bare": 1.0}]
    rows += [
        {"what": f"+ {name}", "seconds": timed[name], "vs_bare": timed[name] / bare}
        for name in [*CORRECTIONS, "routing_replay"]
    ]
    rows.append({"what": "default corrections (MIS + SC + mask replay)", "seconds": full, "vs_bare": full / bare})
    sync, background = asyncio.run(_time_training_loops(model, batch, configs["default"], repeats))
    capture, views = _time_capture(model, repeats)
    publish = statistics.median(sync.blocked)
    step_sync = statistics.median(sync.steps)
    step = statistics.median(background.steps)
    rows.append(
        {"what": "publish (bf16 + fp8 views, diff, upload, append)", "seconds": publish, "vs_bare": publish / bare}
    )
    rows += [
        {"what": "capture the weights (copy into a snapshot)", "seconds": capture, "vs_bare": capture / bare},
        {"what": "compute both views instead", "seconds": views, "vs_bare": views / bare},
        {"what": "step, publishing synchronously", "seconds": step_sync, "vs_bare": step_sync / bare},
        {"what": "step, publishing in the background", "seconds": step, "vs_bare": step / bare},
        {
            "what": "  of which blocked on publishing",
            "seconds": statistics.median(background.blocked),
            "vs_bare": statistics.median(background.blocked) / bare,
        },
        {
            "what": "publish a version, 1 process (non-quick demo model)",
            "seconds": ranked.seconds("1_rank"),
            "vs_bare": ranked.seconds("1_rank") / bare,
        },
        {
            "what": "publish the same version, 2 ranks",
            "seconds": ranked.seconds("2_ranks"),
            "vs_bare": ranked.seconds("2_ranks") / bare,
        },
        {
            "what": "step with 2 ranks, publishing in the background",
            "seconds": ranked_loop.median("steps"),
            "vs_bare": ranked_loop.median("steps") / bare,
        },
        {
            "what": "  of which blocked on publishing (capture gather + submit)",
            "seconds": ranked_loop.median("blocked"),
            "vs_bare": ranked_loop.median("blocked") / bare,
        },
    ]
    summary = {
        "quick": quick,
        "parameters": sum(p.numel() for p in model.parameters()),
        "groups": groups,
        "samples_per_group": n,
        "step_s": round(step, 4),
        "step_s_sync": round(step_sync, 4),
        "bare_s": round(bare, 4),
        "publish_fraction": round(background.fraction, 4),
        "publish_fraction_sync": round(sync.fraction, 4),
        "publish_s": round(publish, 4),
        "publish_wait_s": round(statistics.median(background.blocked), 4),
        "publish_wait_max_s": round(max(background.blocked), 4),
        "publish_depth": configs["default"].publish_depth,
        # The update itself in each loop: beside a background publish it shares the CPU (and the GIL)
        # with it, so on a machine without spare cores the step is not shorter even when nothing blocks.
        "update_s": round(statistics.median(background.update), 4),
        "update_s_sync": round(statistics.median(sync.update), 4),
        "capture_s": round(capture, 4),
        "views_s": round(views, 4),
        # Against the update and publish timed as the corrections are (not the loop's step, measured apart).
        "corrections_fraction": round((full - bare) / (full + publish), 4),
        "per_correction_overhead": {
            r["what"].removeprefix("+ "): round(r["vs_bare"] - 1, 4) for r in rows if r["what"].startswith("+ ")
        },
        # Two ranks (`workers/bench/rank_publish_bench.py`): one version of the same model (the non-quick
        # demo model) published by one process and by two ranks holding their own units, medians per
        # version taken in turns. The speedup is single over two ranks, both as the scheduler places them
        # on this machine (the trainer's case); `_core_each` pins one process to one core against two
        # ranks on a core each (None under --quick, or with fewer than two cores). CPU seconds are per
        # version, the ranks' summed. The profile says where each one's time went (patches, keyframes).
        "publish_speedup_2_ranks": round(ranked.speedup("1_rank", "2_ranks"), 4),
        "publish_s_1_rank": round(ranked.seconds("1_rank"), 4),
        "publish_s_2_ranks": round(ranked.seconds("2_ranks"), 4),
        "publish_cpu_s_1_rank": round(ranked.cpu_s("1_rank"), 4),
        "publish_cpu_s_2_ranks": round(ranked.cpu_s("2_ranks"), 4),
        "publish_speedup_2_ranks_core_each": (
            round(ranked.speedup("1_rank_1_core", "2_ranks_core_each"), 4)
            if "2_ranks_core_each" in ranked.timings
            else None
        ),
        "publish_profile_2_ranks": {
            "units": ranked.units,
            "unit_share": ranked.unit_share,
            **{arm: ranked.profile(arm) for arm in ranked.timings},
        },
        # Rank 0's loop with two ranks (`workers/bench/rank_training_bench.py`): the FSDP update, the
        # capture (a gather of each rank's owned tensors) and the background publish of both ranks'
        # parts, as the sharded trainer runs them; blocked = capture + submit, over the step (totals).
        "publish_fraction_2_ranks": round(ranked_loop.fraction, 4),
        "step_s_2_ranks": round(ranked_loop.median("steps"), 4),
        "update_s_2_ranks": round(ranked_loop.median("update"), 4),
        "capture_s_2_ranks": round(ranked_loop.median("capture"), 4),
        "publish_wait_s_2_ranks": round(ranked_loop.median("submit"), 4),
        # Not part of the step: rank 0 copying only its own shards, what the capture would cost if the
        # gather to the owners ran in the publish thread instead of the update loop.
        "shard_copy_s_2_ranks": round(ranked_loop.median("shard_copy"), 4),
    }
    table = [{"what": r["what"], "seconds": f"{r['seconds']:.4f}", "vs bare": f"{r['vs_bare']:.3f}"} for r in rows]
    return table, summary
