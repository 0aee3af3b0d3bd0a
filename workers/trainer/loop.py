"""The trainer worker: trajectories + rewards in, corrected GRPO updates, policy versions out.

Startup: take the run's lease (a second trainer fails fast), load the initial weights, find the
newest checkpoint and the chain head. Versions published after the checkpoint are re-derived from
their recorded lineage (the same batches, the same deterministic update) and checked bit for bit
against the log before anything new is published. Then it follows the trajectory and reward
streams from the checkpoint's positions, joins them into complete groups, and for every B groups
runs one update and publishes the next version with its lineage; every N versions its whole state
goes to S3, blob first, then a checkpoint event.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import random
import socket
import time
from pathlib import Path

import numpy as np
import torch

from pipeline.batching import BatchAssembler, GroupBatchItem
from pipeline.blobstore import BlobStore, open_blob_store
from pipeline.chain_publish import ChainPublisher
from pipeline.config import ChainSettings, Section, SprawlSettings
from pipeline.errors import AppendConflict, SprawlError
from pipeline.eventlog import EventLog
from pipeline.logs import get_logger
from pipeline.off_policy import LossConfig
from pipeline.replay import tail
from pipeline.subjects import token
from pipeline.version_log import fetch_version
from schemas import GroupDropped, Reward, TrainerCheckpoint, TrainerLease, TrainerMetrics, Trajectory
from workers.lifecycle import run_connected
from workers.trainer.update import UpdateConfig, run_update

log = get_logger(__name__)

TRAINER_STREAM = "TRAINER"


class LossSection(Section):
    surrogate: str = "pg"
    """`pg` (policy gradient) or `ppo` (clipped)."""
    importance: str = "mis"
    """`none`, `tis` or `mis` importance weights between trainer and sampler."""
    importance_level: str = "token"
    """`token` or `sequence`."""
    geometric_rejection: bool = False
    """Drop sequences whose geometric-mean ratio leaves [geometric_low, geometric_high]."""
    score_centering: bool = True
    """Subtract the expected score under the sampling policy (top-k form)."""
    mask_replay: bool = True
    """Renormalize the trainer's distribution over the sampler's kept top-p set."""
    length_normalization: bool = False
    """Weigh sequences equally instead of tokens."""
    mis_low: float = 0.5
    """MIS lower bound on the token ratio."""
    mis_high: float = 5.0
    """MIS upper bound on the token ratio."""
    tis_cap: float = 2.0
    """TIS cap."""

    def config(self) -> LossConfig:
        return LossConfig(**self.model_dump())  # type: ignore[arg-type]


class TrainerSection(Section):
    model_dir: Path = Path(".sprawl/model")
    """HF checkpoint of the initial policy (the warm-up's output)."""
    trainer_id: str = ""
    """Stable identity for the run's lease (default: the host name); a restart with the same id takes over."""
    groups_per_batch: int = 4
    """B: prompt groups per update."""
    group_size: int = 8
    """n: samples per group, when trajectories do not say."""
    max_group_wait_s: float = 300.0
    """Incomplete groups older than this are dropped, with a reason in the log."""
    learning_rate: float = 1e-5
    """Adam learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient clipping."""
    normalize_std: bool = True
    """GRPO: divide group-centered rewards by the group std."""
    routing_replay: bool = False
    """Force the experts the sampler routed to (MoE)."""
    max_staleness: int | None = None
    """Tokens staler than this leave the loss; None: unbounded."""
    checkpoint_every: int = 10
    """Checkpoint the full trainer state every N versions."""
    max_versions: int | None = None
    """Stop after publishing this version (None: run until stopped)."""
    seed: int = 0
    """Seed of every RNG (runs are deterministic on CPU)."""
    threads: int = 1
    """torch threads; fixed so that results are bitwise reproducible."""
    lease_ttl_s: float = 15.0
    """A lease not renewed for this long may be taken over."""
    loss: LossSection = LossSection()
    """The corrected surrogate."""


class TrainerSettings(SprawlSettings):
    trainer: TrainerSection = TrainerSection()
    """The update."""
    chain: ChainSettings = ChainSettings()
    """Which views are published and how."""


class SecondTrainer(SprawlError):
    def __init__(self, run_id: str, holder: str, seconds: float):
        super().__init__(
            f"run {run_id} already has a trainer ({holder}), seen {seconds:.1f}s ago",
            hint="one trainer per run: stop the other one, or wait for its lease to expire",
        )


class RecoveryMismatch(SprawlError):
    pass


class Trainer:
    def __init__(self, settings: TrainerSettings, event_log: EventLog, blobs: BlobStore):
        self.settings = settings
        self.cfg = settings.trainer
        self.log = event_log
        self.blobs = blobs
        self.run_id = token(settings.run_id, "run_id")
        self.holder = self.cfg.trainer_id or socket.gethostname()
        self.assembler = BatchAssembler(
            groups_per_batch=self.cfg.groups_per_batch,
            default_group_size=self.cfg.group_size,
            max_wait_s=self.cfg.max_group_wait_s,
        )
        self.version = 0
        self.step = 0
        self.next_traj_seq = 1
        self.next_reward_seq = 1
        self.update_cfg = UpdateConfig(
            loss=self.cfg.loss.config(),
            normalize_std=self.cfg.normalize_std,
            max_grad_norm=self.cfg.max_grad_norm,
            routing_replay=self.cfg.routing_replay,
            max_staleness=self.cfg.max_staleness,
        )
        self._lease_seq = 0
        self.groups_dropped = 0
        self.published: list[int] = []
        self.model = None
        self.optimizer = None
        self.publisher: ChainPublisher | None = None

    # ---------------------------------------------------------------- setup

    def _determinism(self) -> None:
        torch.use_deterministic_algorithms(True)
        torch.set_num_threads(self.cfg.threads)
        random.seed(self.cfg.seed)
        np.random.seed(self.cfg.seed)
        torch.manual_seed(self.cfg.seed)

    def _load_model(self) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(self.cfg.model_dir, dtype=torch.float32)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=self.cfg.learning_rate, weight_decay=self.cfg.weight_decay
        )
        extra = {
            p.name: p.read_bytes()
            for p in self.cfg.model_dir.iterdir()
            if p.name.startswith(("tokenizer", "generation_config", "special_tokens")) and p.is_file()
        }
        self.publisher = ChainPublisher(
            self.log,
            self.blobs,
            run_id=self.run_id,
            model_config=self.model.config.to_dict(),
            settings=self.settings.chain,
            extra_files=extra,
        )

    async def _take_lease(self) -> None:
        subject = f"rl.{self.run_id}.trainer.lease"
        try:
            last = await self.log.js.get_last_msg(TRAINER_STREAM, subject)
            lease = await self.log.resolve(last.data)
            seq = last.seq
        except Exception:
            lease, seq = None, 0
        now = time.time()
        if isinstance(lease, TrainerLease) and lease.holder != self.holder and lease.expires_at > now:
            raise SecondTrainer(self.run_id, lease.holder, now - (lease.expires_at - self.cfg.lease_ttl_s))
        await self._renew_lease(seq)

    async def _renew_lease(self, expected_seq: int) -> None:
        lease = TrainerLease(run_id=self.run_id, holder=self.holder, expires_at=time.time() + self.cfg.lease_ttl_s)
        try:
            result = await self.log.append(lease, expected_last_subject_seq=expected_seq)
        except AppendConflict as exc:
            raise SecondTrainer(self.run_id, "another trainer", 0.0) from exc
        self._lease_seq = result.seq

    async def _keep_lease(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.lease_ttl_s / 3)
            await self._renew_lease(self._lease_seq)

    # ---------------------------------------------------------------- checkpoints

    async def _latest_checkpoint(self) -> TrainerCheckpoint | None:
        try:
            msg = await self.log.js.get_last_msg(TRAINER_STREAM, f"rl.{self.run_id}.trainer.checkpoint")
        except Exception:
            return None
        event = await self.log.resolve(msg.data)
        return event if isinstance(event, TrainerCheckpoint) else None

    async def _restore(self, ckpt: TrainerCheckpoint) -> None:
        data = await asyncio.to_thread(self.blobs.get_bytes, ckpt.uri, expected=ckpt.sha256)
        state = torch.load(io.BytesIO(data), weights_only=False)
        assert self.model is not None and self.optimizer is not None
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        np.random.set_state(state["numpy_rng"])
        self.version, self.step = state["version"], state["step"]
        self.assembler.used = set(state["used"])
        self.next_traj_seq, self.next_reward_seq = ckpt.trajectory_position, ckpt.reward_position
        log.info("restored checkpoint", version=self.version, step=self.step)

    async def _checkpoint(self) -> None:
        assert self.model is not None and self.optimizer is not None
        traj_pos, reward_pos = self.assembler.positions(self.next_traj_seq, self.next_reward_seq)
        buffer = io.BytesIO()
        torch.save(
            {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "torch_rng": torch.get_rng_state(),
                "python_rng": random.getstate(),
                "numpy_rng": np.random.get_state(),
                "version": self.version,
                "step": self.step,
                "used": sorted(self.assembler.used),
            },
            buffer,
        )
        key = f"runs/{self.run_id}/trainer/ckpt-v{self.version:08d}-{self.holder}.pt"
        ref = await asyncio.to_thread(self.blobs.put_bytes, buffer.getvalue(), key)
        await self.log.append(
            TrainerCheckpoint(
                run_id=self.run_id,
                version=self.version,
                step=self.step,
                uri=ref.uri,
                sha256=ref.checksum,
                bytes=ref.bytes,
                trajectory_position=traj_pos,
                reward_position=reward_pos,
            )
        )
        log.info("checkpointed", version=self.version, bytes=ref.bytes)

    # ---------------------------------------------------------------- lineage and recovery

    async def _put_lineage(self, version: int, batch: list[GroupBatchItem]) -> str:
        lineage = {
            "version": version,
            "groups": [
                {
                    "group_id": item.group_id,
                    "members": [
                        [t.trajectory_id, ts, rs]
                        for t, ts, rs in zip(item.trajectories, item.trajectory_seqs, item.reward_seqs, strict=True)
                    ],
                }
                for item in batch
            ],
        }
        ref = await asyncio.to_thread(
            self.blobs.put_bytes, json.dumps(lineage).encode(), f"runs/{self.run_id}/lineage/v{version:08d}.json"
        )
        return ref.uri

    async def _batch_from_lineage(self, version: int) -> list[GroupBatchItem]:
        event = await fetch_version(self.log, self.run_id, version)
        if event is None or event.lineage_uri is None:
            raise RecoveryMismatch(f"version {version} has no lineage: it cannot be re-derived")
        lineage = json.loads(await asyncio.to_thread(self.blobs.get_bytes, event.lineage_uri))
        batch = []
        for group in lineage["groups"]:
            trajectories, rewards, tseqs, rseqs = [], [], [], []
            for trajectory_id, tseq, rseq in group["members"]:
                traj = await self.log.resolve((await self.log.js.get_msg("TRAJECTORIES", tseq)).data)
                reward = await self.log.resolve((await self.log.js.get_msg("REWARDS", rseq)).data)
                if not isinstance(traj, Trajectory) or traj.trajectory_id != trajectory_id:
                    raise RecoveryMismatch(f"lineage of v{version}: TRAJECTORIES seq {tseq} is not {trajectory_id}")
                assert isinstance(reward, Reward)
                trajectories.append(traj)
                rewards.append(reward)
                tseqs.append(tseq)
                rseqs.append(rseq)
                self.assembler.used.add(trajectory_id)
            batch.append(GroupBatchItem(group["group_id"], trajectories, rewards, tseqs, rseqs))
        return batch

    def _root_hashes(self) -> dict[str, str]:
        from pipeline.bits import checksum, dtype_name, root_hash, to_bits
        from pipeline.views import get_view

        assert self.model is not None
        tie = bool(self.model.config.to_dict().get("tie_word_embeddings", False))
        out = {}
        for name in self.settings.chain.views:
            tensors = get_view(name).compute(self.model.state_dict(), tie_word_embeddings=tie)
            out[name] = root_hash(
                [(n, dtype_name(t.dtype), tuple(t.shape), checksum(to_bits(t))) for n, t in tensors.items()]
            )
        return out

    async def _catch_up(self, head: int) -> None:
        """Re-derive versions the log has but the checkpoint does not, and prove they match."""
        while self.version < head:
            version = self.version + 1
            batch = await self._batch_from_lineage(version)
            await asyncio.to_thread(self._update, batch, version - 1)
            event = await fetch_version(self.log, self.run_id, version)
            assert event is not None
            ours = self._root_hashes()
            for view in event.views:
                if ours.get(view.view) != view.root_hash:
                    raise RecoveryMismatch(
                        f"re-derived v{version} {view.view} hashes to {ours.get(view.view)}, the log says "
                        f"{view.root_hash}: the update is not deterministic or the inputs changed"
                    )
            self.version = version
            log.info("re-derived version from lineage", version=version)

    # ---------------------------------------------------------------- the loop

    def _update(self, batch: list[GroupBatchItem], trainer_version: int):
        assert self.model is not None and self.optimizer is not None
        metrics = run_update(self.model, self.optimizer, batch, self.update_cfg, trainer_version)
        self.step += 1
        return metrics

    async def _feed(self, stream: str, filter_subject: str, start: int, stop: asyncio.Event) -> None:
        async for item in tail(self.log, stream, filter_subject, start, stop):
            now = time.monotonic()
            if isinstance(item.event, Trajectory):
                self.assembler.add_trajectory(item.event, item.stream_seq, now)
                self.next_traj_seq = max(self.next_traj_seq, item.stream_seq + 1)
            elif isinstance(item.event, Reward):
                self.assembler.add_reward(item.event, item.stream_seq, now)
                self.next_reward_seq = max(self.next_reward_seq, item.stream_seq + 1)

    async def _publish(self, batch: list[GroupBatchItem] | None) -> None:
        assert self.publisher is not None and self.model is not None
        version = self.version + 1 if batch is not None else 0
        lineage = await self._put_lineage(version, batch) if batch is not None else None
        consumed = sum(len(item.trajectories) for item in batch) if batch else 0
        await self.publisher.publish(
            version,
            self.model.state_dict(),
            trainer_step=self.step,
            consumed_trajectories=consumed,
            lineage_uri=lineage,
        )
        self.version = version
        self.published.append(version)

    async def run(self, stop: asyncio.Event) -> None:
        self._determinism()
        await self._take_lease()
        lease = asyncio.create_task(self._keep_lease())
        feeds: list[asyncio.Task] = []
        feeds_stop = asyncio.Event()
        try:
            await asyncio.to_thread(self._load_model)
            assert self.publisher is not None
            head = await self.publisher.open()
            ckpt = await self._latest_checkpoint()
            if ckpt is not None:
                await self._restore(ckpt)
            if head is None:
                await self._publish(None)  # version 0: the initial weights
            else:
                await self._catch_up(head)
            feeds = [
                asyncio.create_task(
                    self._feed("TRAJECTORIES", f"rl.{self.run_id}.traj.>", self.next_traj_seq, feeds_stop)
                ),
                asyncio.create_task(
                    self._feed("REWARDS", f"rl.{self.run_id}.reward.>", self.next_reward_seq, feeds_stop)
                ),
            ]
            while not stop.is_set():
                if self.cfg.max_versions is not None and self.version >= self.cfg.max_versions:
                    break
                for group, reason in self.assembler.expire(time.monotonic()):
                    await self.log.append(
                        GroupDropped(
                            run_id=self.run_id,
                            group_id=group.group_id,
                            reason=reason,
                            trajectory_ids=sorted(group.members),
                            waited_s=time.monotonic() - group.first_seen,
                        )
                    )
                batch = self.assembler.take_batch()
                if batch is None:
                    await asyncio.sleep(0.05)
                    continue
                overall, per_group = await asyncio.to_thread(self._update, batch, self.version)
                overall["groups_dropped_total"] = float(self.groups_dropped)
                await self._publish(batch)
                await self.log.append(
                    TrainerMetrics(
                        run_id=self.run_id, step=self.step, version=self.version, metrics=overall, per_group=per_group
                    )
                )
                if self.version % self.cfg.checkpoint_every == 0:
                    await self._checkpoint()
        finally:
            feeds_stop.set()  # the feeds end on this even if a cancellation is lost inside a fetch
            for task in [*feeds, lease]:
                task.cancel()
            for task in [*feeds, lease]:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            if self.publisher is not None:
                self.publisher.close()


async def run_trainer(settings: TrainerSettings) -> None:
    async def body(event_log: EventLog, stop: asyncio.Event) -> None:
        await Trainer(settings, event_log, open_blob_store(settings.blobs)).run(stop)

    await run_connected(settings, "trainer", body)
