"""The trainer worker: trajectories + rewards in, corrected GRPO updates, policy versions out.

Startup: take the run's lease (a second trainer fails fast), load the initial weights, find the
newest checkpoint and the chain head. Versions published after the checkpoint are re-derived from
their recorded lineage (the same batches, the same deterministic update) and checked bit for bit
against the log before anything new is published. Then it follows the trajectory and reward
streams from the checkpoint's positions, joins them into complete groups, and for every B groups
runs one update and publishes the next version with its lineage; every N versions its whole state
goes to S3, blob first, then a checkpoint event.

Publishing runs beside the updates (`publishing.py`): the loop captures each version's weights and
goes on to the next update while a background task writes the lineage, publishes the version and
appends its metrics, in order. The task is one of the trainer's guards: a version it cannot publish
stops the trainer. A checkpoint waits until its version is in the chain (recovery assumes the
checkpoint is never ahead of the head), and a stopping trainer publishes every version it computed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import time
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.batching import BatchAssembler, GroupBatchItem
from pipeline.blobstore import BlobStore, open_blob_store
from pipeline.chain_publish import ChainPublisher
from pipeline.codec.warm import warm_in_background
from pipeline.errors import AppendConflict, SprawlError, TransientError
from pipeline.eventlog import EventLog
from pipeline.lease import RunLease
from pipeline.log_lookup import count_subjects, last_event_on
from pipeline.logs import get_logger
from pipeline.moe_families import RoutingShape, UnsupportedMoeFamily, routing_shape
from pipeline.replay import Follower
from pipeline.topology import (
    METRICS,
    REWARDS,
    TRAJECTORIES,
    Kind,
    Stream,
    follower_name,
    group_rewards_filter,
    group_trajectories_filter,
    rewards_filter,
    run_subject,
    token,
    trajectories_filter,
)
from pipeline.version_log import fetch_version
from pipeline.version_signing import trainer_signing_key, verify_version
from schemas import GroupDropped, Reward, TrainerMetrics, Trajectory
from workers.lifecycle import end_guards, run_connected, run_guarded
from workers.trainer.admission import refusal, refused_trajectory
from workers.trainer.checkpoint import (
    latest_checkpoint,
    restore_any_checkpoint,
    save_checkpoint,
    save_sharded_checkpoint,
)
from workers.trainer.distributed import (
    RankContext,
    blob_store_wait_s,
    init_ranks,
    launched_by_torchrun,
    rank_device,
)
from workers.trainer.drift_guard import DriftChange, DriftGuard
from workers.trainer.launch import die_with_torchrun, report_clean_stop
from workers.trainer.publishing import BackgroundPublisher, Pending
from workers.trainer.ranks import (
    RankPublisher,
    RankTraining,
    extra_files,
    follow_leader,
    source_shapes,
    start_followers,
)
from workers.trainer.recovery import (
    RecoveryMismatch,
    check_rederived,
    check_same_summation,
    put_lineage,
    read_lineage,
    recorded_batch,
)
from workers.trainer.settings import TrainerSettings
from workers.trainer.update import UpdateMetrics, slice_count

log = get_logger(__name__)


@dataclass
class _VersionJob:
    """What publishing a trained version needs besides its weights."""

    batch: list[GroupBatchItem]
    step: int
    metrics: dict[str, float]
    per_group: dict[str, dict[str, float]]
    per_island: dict[str, dict[str, float]]
    quarantined: frozenset[str]
    """Islands the update left out of the loss (recorded in the lineage: recovery applies the same)."""
    drift: list[DriftChange]
    """Verdicts of the drift guard this update changed, appended after the version's metrics."""


class ChainBehindCheckpoint(SprawlError):
    """A checkpoint was about to be written for a version the chain does not hold yet."""


class Trainer:
    def __init__(
        self, settings: TrainerSettings, event_log: EventLog, blobs: BlobStore, ctx: RankContext | None = None
    ):
        """`ctx`: this process's place among the trainer's ranks (rank 0 of several: the others follow
        its commands, `ranks.py`); None is the single-process trainer."""
        self.ctx = ctx or RankContext()
        self.settings = settings
        self.cfg = settings.trainer
        self.log = event_log
        self.blobs = blobs
        self.run_id = token(settings.run_id, "run_id")
        self.holder = self.cfg.trainer_id or socket.gethostname()
        # Read before anything else starts: a trainer with no key (and no explicit opt-out) would publish
        # versions that every pinned island refuses, so it does not start at all.
        self.signing_key = trainer_signing_key(settings.trust)
        self.lease = RunLease(event_log, self.run_id, self.holder, self.cfg.lease_ttl_s)
        # Every append the trainer makes (a version, metrics, a checkpoint, a dropped group) waits out an
        # outage of the log rather than ending the process: a retry reuses the event's Nats-Msg-Id, and
        # the lease guard stops the trainer first if the outage outlasts the lease's margin.
        event_log.append_patience_s = self.cfg.lease_ttl_s
        self.assembler = BatchAssembler(
            groups_per_batch=self.cfg.groups_per_batch,
            default_group_size=self.cfg.group_size,
            max_wait_s=self.cfg.max_group_wait_s,
        )
        self.version = 0
        self.step = 0
        self.next_traj_seq = 1
        self.next_reward_seq = 1
        self.groups_dropped = 0
        self.published: list[int] = []
        self.feeds: dict[str, Follower] = {}
        """The live feeds by stream name (their positions, outages and re-creations)."""
        self.training: RankTraining | None = None
        self.routing: RoutingShape | None = None
        self.slices = slice_count(self.cfg, self.ctx)
        """Slices of every update (checked here, before anything is published: a count the ranks cannot
        share fails the job at once)."""
        self._last_command = time.monotonic()
        self.model = None
        self.optimizer = None
        self.chain: ChainPublisher | None = None
        self.publisher: ChainPublisher | RankPublisher | None = None
        self.guard = DriftGuard(self.cfg.drift)
        """Per-island KL against the fleet's; with `drift.quarantine`, whose trajectories leave the loss."""
        self.background: BackgroundPublisher[_VersionJob] = BackgroundPublisher(
            self._publish_version,
            self.cfg.publish_depth,
            name="the trainer's publisher",
            # Blocked on publishing (a store outage is waited out for minutes), rank 0 sends no command:
            # the other ranks, waiting for the next one in a collective, must hear it is alive.
            while_waiting=self._keep_followers_waiting if self.ctx.distributed else None,
            while_waiting_every_s=self.cfg.collective_timeout_s / 8,
        )

    # ---------------------------------------------------------------- setup

    def _load_model(self) -> None:
        self.training = RankTraining(self.settings, self.ctx, self.blobs)
        self.model, self.optimizer = self.training.model, self.training.optimizer
        self.chain = ChainPublisher(
            self.log,
            self.blobs,
            run_id=self.run_id,
            model_config=self.model.config.to_dict(),
            settings=self.settings.chain,
            extra_files=extra_files(self.cfg.model_dir),
            signing_key=self.signing_key,
            source_shapes=source_shapes(self.model),
        )
        self.training.plan_owners(self.chain)
        # What a recorded route must look like for this model (its MoE family's layers, k and experts).
        # An MoE family sprawl does not know cannot have its routes checked or replayed: it starts only
        # without routing replay, and then refuses trajectories that record routes.
        try:
            self.routing = routing_shape(self.model.config)
        except UnsupportedMoeFamily:
            if self.cfg.routing_replay:
                raise
            self.routing = RoutingShape(0, 0, 0)
        self.publisher = RankPublisher(self.chain, self.training) if self.ctx.distributed else self.chain

    async def _restore_latest(self) -> None:
        ckpt = await latest_checkpoint(self.log, self.run_id)
        if ckpt is None:
            return
        assert self.training is not None
        state = await restore_any_checkpoint(self.blobs, ckpt, self.training)
        self.version, self.step = state.version, state.step
        self.assembler.used = state.used
        self.next_traj_seq, self.next_reward_seq = state.trajectory_position, state.reward_position

    async def _check_restored(self) -> None:
        """The restored weights must be the checkpoint's version's, as the chain recorded it: a checkpoint
        whose blobs are another version's (a forged event, a replaced manifest) would otherwise be
        trained on and its successors signed."""
        assert self.training is not None
        event = await fetch_version(self.log, self.run_id, self.version)
        if event is None:
            raise RecoveryMismatch(f"the checkpoint is of version {self.version}, which the chain does not hold")
        hashes = await asyncio.to_thread(self.training.root_hashes)
        assert hashes is not None  # rank 0
        check_rederived(event, hashes)
        log.info("restored state matches its version's root hashes", version=self.version)

    async def _checkpoint(self) -> None:
        assert self.model is not None and self.optimizer is not None and self.publisher is not None
        if self.publisher.head is None or self.publisher.head < self.version:
            raise ChainBehindCheckpoint(
                f"checkpoint of version {self.version} while the chain's head is {self.publisher.head}",
                hint="a restarted trainer would resume ahead of the chain: drain the publisher first",
            )
        positions = self.assembler.positions(self.next_traj_seq, self.next_reward_seq)
        if self.ctx.distributed:
            await save_sharded_checkpoint(
                self.log,
                self.blobs,
                self.training,
                run_id=self.run_id,
                holder=self.holder,
                version=self.version,
                step=self.step,
                used=self.assembler.used,
                positions=positions,
            )
            return
        await save_checkpoint(
            self.log,
            self.blobs,
            run_id=self.run_id,
            holder=self.holder,
            model=self.model,
            optimizer=self.optimizer,
            version=self.version,
            step=self.step,
            used=self.assembler.used,
            positions=positions,
        )

    async def _catch_up(self, head: int) -> None:
        """Re-derive versions the log has but the checkpoint does not, and prove they match."""
        assert self.model is not None
        # A version's metrics follow its event: a trainer killed between the two left the version without
        # them. Appended in order, so the newest metrics in the log say which re-derived versions lack them.
        newest = await last_event_on(self.log, METRICS.name, run_subject(self.run_id, Kind.METRICS, "trainer"))
        metrics_through = (
            newest.event.version if newest is not None and isinstance(newest.event, TrainerMetrics) else -1
        )
        while self.version < head:
            version = self.version + 1
            event, lineage = await read_lineage(self.log, self.blobs, self.run_id, version)
            check_same_summation(lineage, self.slices, self.ctx.world_size)
            batch, quarantined = await recorded_batch(self.log, lineage), frozenset(lineage.quarantined_islands)
            if self.signing_key is not None:
                # A version in the chain that this trainer's key did not sign was forged: re-deriving on
                # top of it would fork what islands serve, so the trainer stops and says which.
                verify_version(event, self.signing_key.public_key())
            for item in batch:
                self.assembler.used.update(t.trajectory_id for t in item.trajectories)
            metrics = await asyncio.to_thread(self._update, batch, version - 1, quarantined)
            assert self.training is not None
            hashes = await asyncio.to_thread(self.training.root_hashes)
            assert hashes is not None  # rank 0
            check_rederived(event, hashes)
            self.version = version
            # The guard's windows refill from the re-derived updates; what it had flagged going into each
            # is what the lineage says was quarantined (its events were appended when the version was made).
            self._restore_flagged(quarantined)
            changes = self._judge(version, batch, metrics)
            if version > metrics_through:
                metrics.overall["rederived"] = 1.0  # computed again on restart (no publish timings)
                await self.log.append(
                    TrainerMetrics(
                        run_id=self.run_id,
                        step=self.step,
                        version=version,
                        metrics=metrics.overall,
                        per_group=metrics.per_group,
                        per_island=metrics.per_island,
                    )
                )
                for change in changes:
                    await self.log.append(change.event(self.run_id))
            log.info("re-derived version from lineage", version=version, metrics_appended=version > metrics_through)

    # ---------------------------------------------------------------- the loop

    def _update(
        self, batch: list[GroupBatchItem], trainer_version: int, quarantined: frozenset[str] = frozenset()
    ) -> UpdateMetrics:
        assert self.training is not None
        metrics = self.training.update(batch, trainer_version, quarantined)
        self._last_command = time.monotonic()
        assert metrics is not None  # rank 0 gets them
        self.step += 1
        return metrics

    def _restore_flagged(self, quarantined: frozenset[str]) -> None:
        if self.cfg.drift.quarantine:
            self.guard.restore_flagged(quarantined)

    def _judge(self, version: int, batch: list[GroupBatchItem], metrics: UpdateMetrics) -> list[DriftChange]:
        """Feed the update's per-island metrics to the drift guard; its verdicts go into the metrics."""
        views = {t.island.island_id: t.island.view for item in batch for t in item.trajectories}
        changes = self.guard.observe(version, metrics.per_island, views)
        for island, report in self.guard.report().items():
            metrics.per_island.setdefault(island, {}).update(report)
        metrics.overall["islands_flagged"] = float(len(self.guard.flagged))
        # Tokens the guard could not judge (islands under `min_tokens`, e.g. ones that change their id)
        # and ids claimed by more than one sampler identity (ids are self-declared): visible, per update.
        if self.guard.update_tokens > 0:
            metrics.overall["unjudged_token_fraction"] = self.guard.unjudged_tokens / self.guard.update_tokens
        metrics.overall["islands_with_conflicting_identity"] = float(
            sum(m.get("identities", 1.0) > 1 for m in metrics.per_island.values())
        )
        return changes

    async def _feed(self, stream: Stream, filter_subject: str, start: int, stop: asyncio.Event) -> None:
        """Follow `stream` into the assembler until `stop`, through the trainer's own named consumer, so
        a nats-server restart or outage is waited out instead of ending the feed."""
        name = follower_name(self.run_id, "trainer", stream)
        self.feeds[stream.name] = follower = Follower(self.log, stream.name, filter_subject, start, name)
        async for item in follower.events(stop):
            now = time.monotonic()
            if isinstance(item.event, Trajectory):
                if not await self._admitted(item, name):
                    self.next_traj_seq = max(self.next_traj_seq, item.stream_seq + 1)
                    continue
                self.assembler.add_trajectory(item.event, item.stream_seq, now)
                self.next_traj_seq = max(self.next_traj_seq, item.stream_seq + 1)
            elif isinstance(item.event, Reward):
                self.assembler.add_reward(item.event, item.stream_seq, now)
                self.next_reward_seq = max(self.next_reward_seq, item.stream_seq + 1)

    async def _admitted(self, item, consumer: str) -> bool:
        """False (and the trajectory dead-lettered, once) when this model cannot index its ids."""
        assert self.model is not None
        positions = getattr(self.model.config, "max_position_embeddings", None)
        reason = refusal(item.event, self.model.config.vocab_size, routing=self.routing, max_positions=positions)
        if reason is None:
            return True
        log.error("trajectory refused", trajectory_id=item.event.trajectory_id, seq=item.stream_seq, reason=reason)
        dead = refused_trajectory(
            item.event, reason=reason, run_id=self.run_id, consumer=consumer, subject=item.subject, seq=item.stream_seq
        )
        # AppendConflict: dead-lettered already (an earlier run of this trainer, or another consumer)
        with contextlib.suppress(AppendConflict):
            await self.log.append(dead)
        return False

    async def _publish_initial(self) -> None:
        """Version 0, the initial weights: published before any update, so nothing to overlap."""
        assert self.publisher is not None and self.training is not None
        weights = await asyncio.to_thread(self.training.capture)
        await self.publisher.publish(0, weights, trainer_step=self.step)
        self.version = 0
        self.published.append(0)

    async def _keep_followers_waiting(self) -> None:
        """With no batch to train, tell the other ranks so now and then: they wait for the next command in a
        collective, which fails after `collective_timeout_s` (a quiet fleet is not a dead rank)."""
        if not self.ctx.distributed or time.monotonic() - self._last_command < self.cfg.collective_timeout_s / 4:
            return
        assert self.training is not None
        await asyncio.to_thread(self.training.keep_waiting)
        self._last_command = time.monotonic()

    async def _publish_version(self, pending: Pending[_VersionJob]) -> None:
        """The background publisher's work for one version: its lineage, the version (fenced on the
        previous one), then the metrics of the step that made it."""
        assert self.publisher is not None
        job, version = pending.job, pending.version
        started = time.perf_counter()
        lineage = await put_lineage(
            self.blobs, self.run_id, version, job.batch, job.quarantined, self.slices, self.ctx.world_size
        )
        await self.publisher.publish(
            version,
            pending.weights,
            trainer_step=job.step,
            consumed_trajectories=sum(len(item.trajectories) for item in job.batch),
            lineage_uri=lineage.uri,
            lineage_sha256=lineage.checksum,
        )
        self.published.append(version)
        # How long the update loop was blocked on publishing before this version was captured, and how
        # long publishing it took beside the next update.
        metrics = {**job.metrics, "publish_wait_s": pending.blocked_s, "publish_s": time.perf_counter() - started}
        await self.log.append(
            TrainerMetrics(
                run_id=self.run_id,
                step=job.step,
                version=version,
                metrics=metrics,
                per_group=job.per_group,
                per_island=job.per_island,
            )
        )
        for change in job.drift:
            log.warning(
                "drift guard: island " + change.state,
                island=change.island_id,
                view=change.view,
                version=version,
                kl_k3=change.kl_k3,
                baseline_kl_k3=change.baseline_kl_k3,
                quarantined=change.quarantined,
            )
            await self.log.append(change.event(self.run_id))

    async def _drop_expired(self) -> None:
        """Drop the overdue incomplete groups the log says are incomplete too.

        A group the log holds more of than the feeds have delivered is not dropped: the feed is behind
        (a restart, an outage) and the rest is coming. It is given another wait, and dropped after one
        in which the feeds delivered nothing more of it (the rest is not coming to us: e.g. a straggler
        of a group already trained). A count the log does not answer drops nothing."""
        for group in self.assembler.overdue(time.monotonic()):
            try:
                in_log = (
                    await count_subjects(
                        self.log, TRAJECTORIES.name, group_trajectories_filter(self.run_id, group.group_id)
                    ),
                    await count_subjects(self.log, REWARDS.name, group_rewards_filter(self.run_id, group.group_id)),
                )
            except TransientError as exc:
                log.warning(
                    "cannot tell whether an overdue group is incomplete; keeping it",
                    group=group.group_id,
                    error=str(exc),
                )
                return
            have = group.counts()
            behind = in_log[0] > have[0] or in_log[1] > have[1]
            if behind and group.deferred_at != have:
                log.warning(
                    "group overdue, but the log holds more of it than the feeds delivered: waiting for them",
                    group=group.group_id,
                    delivered=have,
                    in_log=in_log,
                )
                self.assembler.defer(group.group_id, time.monotonic())
                continue
            dropped, reason = self.assembler.drop(group.group_id, in_log)
            await self.log.append(
                GroupDropped(
                    run_id=self.run_id,
                    group_id=dropped.group_id,
                    reason=reason,
                    trajectory_ids=sorted(dropped.members),
                    waited_s=time.monotonic() - dropped.first_seen,
                )
            )
            self.groups_dropped += 1

    async def run(self, stop: asyncio.Event) -> None:
        """Train until `stop` (or `max_versions`). The lease and both feeds are guards: if one of them
        ends, the trainer stops at once with WorkerPartFailed naming it, never alive and idle."""
        determinism(self.cfg)
        await self.lease.take()
        guards = [asyncio.create_task(self.lease.keep(), name="the trainer's lease")]
        feeds_stop = asyncio.Event()
        try:
            await run_guarded(self._prepare(), guards)
            guards += [
                self.background.start(),
                asyncio.create_task(
                    self._feed(TRAJECTORIES, trajectories_filter(self.run_id), self.next_traj_seq, feeds_stop),
                    name="the trainer's trajectory feed",
                ),
                asyncio.create_task(
                    self._feed(REWARDS, rewards_filter(self.run_id), self.next_reward_seq, feeds_stop),
                    name="the trainer's reward feed",
                ),
            ]
            await run_guarded(self._train(stop), guards)
            if self.training is not None:
                await asyncio.to_thread(self.training.stop)  # the other ranks return (after their publishing)
        finally:
            feeds_stop.set()  # the feeds end on this even if a cancellation is lost inside a fetch
            await end_guards(guards)
            if self.publisher is not None:
                self.publisher.close()

    async def _prepare(self) -> None:
        """The model, the chain's head, the newest checkpoint; version 0 or the re-derived versions."""
        await asyncio.to_thread(self._load_model)
        assert self.publisher is not None and self.chain is not None
        head = await self.publisher.open()
        start_followers(self.chain, self.ctx)
        await self._restore_latest()
        if self.version > 0:
            await self._check_restored()
        if head is None:
            await self._publish_initial()
        else:
            checkpointed = self.version
            await self._catch_up(head)
            if self.version == checkpointed and self.version > 0 and self.cfg.drift.quarantine:
                # Nothing re-derived: the guard starts with what the head's update had quarantined.
                self._restore_flagged(
                    frozenset((await read_lineage(self.log, self.blobs, self.run_id, head))[1].quarantined_islands)
                )

    async def _train(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if self.cfg.max_versions is not None and self.version >= self.cfg.max_versions:
                break
            await self._drop_expired()
            batch = self.assembler.take_batch()
            if batch is None:
                await self._keep_followers_waiting()
                await asyncio.sleep(0.05)
                continue
            quarantined = self.guard.quarantine_for({t.island.island_id for item in batch for t in item.trajectories})
            metrics = await asyncio.to_thread(self._update, batch, self.version, quarantined)
            self.version += 1
            changes = self._judge(self.version, batch, metrics)
            metrics.overall["groups_dropped_total"] = float(self.groups_dropped)
            job = _VersionJob(
                batch, self.step, metrics.overall, metrics.per_group, metrics.per_island, quarantined, changes
            )
            # The next update may start once the weights are captured; the version is published beside it.
            await self.background.submit(self.version, await asyncio.to_thread(self.training.capture), job)
            if self.version % self.cfg.checkpoint_every == 0:
                await self.background.drain(self.version)  # recovery needs checkpoint <= chain head
                await self._checkpoint()
        await self.background.drain()  # every version computed is published before the trainer returns


def determinism(cfg) -> None:
    """Every RNG seeded, deterministic kernels where the backend has them, fixed thread count."""
    if cfg.device == "cuda":
        # cuBLAS is deterministic only with a fixed workspace, read when CUDA initializes.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cuda.matmul.allow_tf32 = False
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(cfg.threads)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)


async def run_trainer(settings: TrainerSettings) -> None:
    """The trainer process: one rank, or (launched by torchrun) one of several, rank 0 being the one
    connected to the log."""
    warm_in_background()  # its first patch is encoded after version 0
    ctx = RankContext()
    torchrun = launched_by_torchrun()
    if torchrun:
        if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun's agent is this rank's parent
            die_with_torchrun()
        ctx = init_ranks(
            settings.trainer.device,
            settings.trainer.collective_timeout_s,
            blob_store_wait_s(settings.blobs.outage_patience_s),
        )
        if not ctx.is_leader:
            # Rank 0 decides when the job stops (after publishing every computed version) and tells the
            # others; torchrun's SIGTERM to every rank would otherwise cut their last parts short.
            for signum in (signal.SIGTERM, signal.SIGINT):
                signal.signal(signum, signal.SIG_IGN)
            determinism(settings.trainer)
            await asyncio.to_thread(follow_leader, settings, ctx, open_blob_store(settings.blobs))
            return
    elif settings.trainer.device == "cuda":
        ctx = RankContext(device=rank_device("cuda", 0))

    async def body(event_log: EventLog, stop: asyncio.Event) -> None:
        await Trainer(settings, event_log, open_blob_store(settings.blobs), ctx).run(stop)

    await run_connected(settings, "trainer", body)
    if torchrun:
        report_clean_stop()
