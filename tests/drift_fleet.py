"""An in-process mixed fleet with real numerics, for the drift guard's tests and measurements.

Islands are reference engines over materialized views of the trainer's weights (bf16, fp8_e4m3,
mxfp4, and one whose dequantization is deliberately wrong); they sample the demo task's prompts,
the answers are scored like the demo's verifier, and the trainer's real `run_update` trains on
them while a `DriftGuard` watches. No NATS, no S3: what is under test is the numerics and the
guard, not the transport (the slow fleet test covers that).
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline.batching import GroupBatchItem
from pipeline.keyframe import write_checkpoint
from pipeline.views import get_view
from schemas import IslandIdentity, Reward, SamplingParams, Trajectory
from workers.sampler.engines.base import GenerateRequest
from workers.sampler.engines.reference import ReferenceEngine
from workers.trainer.drift_guard import DriftChange, DriftGuard
from workers.trainer.settings import DriftSection, TrainerSection
from workers.trainer.update import UpdateMetrics, run_update
from workers.up.demo_task import EOS, build_tokenizer, problem, warmed_up_model
from workers.up.options import TaskSettings

RUN = "drift-run"
SAMPLING = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=4, logprobs_top_k=16)
"""What `sprawl up`'s prompt driver asks for (its default temperature and top-p; 2-digit sums)."""
TASK = TaskSettings(warmup_steps=150)
"""A shorter warm-up than the demo's 550: a peaked, partly right policy is all the guard needs."""


@dataclass
class Island:
    island_id: str
    view: str
    fault: str = "none"
    engine: ReferenceEngine = field(default_factory=ReferenceEngine)

    def identity(self) -> IslandIdentity:
        return IslandIdentity(island_id=self.island_id, accelerator="cpu", view=self.view, engine="torch")


def fault_engine(fault: str) -> ReferenceEngine:
    """A reference engine with the test-only fault injection, as `SPRAWL_ISLAND__FAULT` sets it."""
    if fault == "none":
        return ReferenceEngine()
    return ReferenceEngine(fault=fault)  # type: ignore[call-arg]


def make_island(island_id: str, view: str, fault: str = "none") -> Island:
    return Island(island_id, view, fault, fault_engine(fault))


class Fleet:
    """Islands + the trainer's model, optimizer and guard, stepping one update at a time."""

    def __init__(
        self,
        root: Path,
        islands: list[Island],
        drift: DriftSection,
        *,
        model_dir: Path | None = None,
        groups_per_island: int = 2,
        group_size: int = 8,
        seed: int = 0,
    ):
        from transformers import AutoModelForCausalLM

        self.root = root
        self.islands = islands
        self.model_dir = model_dir or warmed_up_model(root / "state", TASK)
        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        self.cfg = TrainerSection(learning_rate=3e-4, group_size=group_size, drift=drift)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.learning_rate)
        self.guard = DriftGuard(drift)
        self.groups_per_island = groups_per_island
        self.group_size = group_size
        self.tokenizer = build_tokenizer()
        self.rng = random.Random(seed)
        self.version = 0
        self.history: list[UpdateMetrics] = []
        self.changes: list[DriftChange] = []
        self.quarantined_by_version: dict[int, frozenset[str]] = {}

    async def publish(self) -> None:
        """The current weights, as each island's view, loaded into its engine (what materializing does)."""
        state = self.model.state_dict()
        config = self.model.config.to_dict()
        for island in self.islands:
            view = get_view(island.view)
            path = self.root / island.island_id / f"v{self.version}"
            write_checkpoint(path, view.compute(state), {**config, **view.config_overrides()})
            if island.engine.model is None:
                await island.engine.start()
            await island.engine.load_weights(path, self.version)

    async def sample(self) -> list[GroupBatchItem]:
        batch = []
        for island in self.islands:
            for g in range(self.groups_per_island):
                prompt, answer = problem(self.rng, TASK.digits)
                prompt_ids = [1, *self.tokenizer.encode(prompt).ids]
                group_id = f"v{self.version}-{island.island_id}-{g}"
                samples = await island.engine.generate(
                    GenerateRequest(prompt_ids, self.group_size, SAMPLING, [EOS], seed=self.rng.randrange(1 << 30))
                )
                trajectories, rewards = [], []
                for i, s in enumerate(samples):
                    tid = f"{group_id}-{i}"
                    trajectories.append(
                        Trajectory(
                            run_id=RUN,
                            trajectory_id=tid,
                            group_id=group_id,
                            sample_index=i,
                            task="arith",
                            prompt_token_ids=s.prompt_token_ids,
                            output_token_ids=s.output_token_ids,
                            logprobs=s.logprobs,
                            raw_logprobs=s.raw_logprobs,
                            finish_reason=s.finish_reason,
                            version_spans=s.version_spans,
                            island=island.identity(),
                            sampling=SAMPLING,
                            top_logprob_ids=s.top_ids,
                            top_logprobs=s.top_logprobs,
                            top_p_kept_ids=s.kept_ids,
                            group_size=self.group_size,
                        )
                    )
                    text = self.tokenizer.decode([t for t in s.output_token_ids if t != EOS])
                    rewards.append(
                        Reward(
                            run_id=RUN,
                            trajectory_id=tid,
                            group_id=group_id,
                            value=float(text == answer),
                            verifier="arith",
                            verifier_version="test",
                            duration_s=0.0,
                        )
                    )
                n = len(trajectories)
                batch.append(GroupBatchItem(group_id, trajectories, rewards, list(range(n)), list(range(n))))
        return batch

    async def step(self) -> tuple[UpdateMetrics, list[DriftChange]]:
        """Publish the current version, sample from every island, one update, the guard's verdicts."""
        await self.publish()
        batch = await self.sample()
        quarantined = self.guard.quarantined
        self.quarantined_by_version[self.version + 1] = quarantined
        metrics = await asyncio.to_thread(
            run_update, self.model, self.optimizer, batch, self.cfg, self.version, quarantined
        )
        self.version += 1
        views = {i.island_id: i.view for i in self.islands}
        changes = self.guard.observe(self.version, metrics.per_island, views)
        self.history.append(metrics)
        self.changes += changes
        return metrics, changes
