"""The trainer's step with two ranks: how long rank 0's update loop is blocked on publishing.

Two forked gloo ranks run the sharded trainer's own pieces, as `sprawl trainer --trainer.ranks 2`
does: rank 0 builds `RankTraining` (the FSDP-sharded model), publishes version 0, then loops like
`Trainer._train` (the update on every rank, `RankTraining.capture` gathering each rank's owned full
tensors, `BackgroundPublisher.submit` queueing rank 0's share for `RankPublisher.publish`); rank 1
runs `follow_leader`, the non-leader trainer itself (same commands, its own publish thread). Only
the log's feeds, lineage, metrics events and checkpoints are left out.

Blocked, per step, is what the loop waits for besides the update: the capture (a gather across the
ranks that exists only to publish) and the submit (copying the share into a snapshot, waiting for a
free one). The fraction is that over the step, totals over the loop, as `publish_fraction` is for
one process; the last version's drain is not part of any step.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

from pipeline.batching import GroupBatchItem
from pipeline.blobstore import open_blob_store
from pipeline.chain_publish import ChainPublisher
from pipeline.eventlog import EventLog
from workers.bench.forked_ranks import answer, init_gloo, receive_all, start_workers, stop_workers
from workers.lifecycle import end_guards, run_guarded
from workers.trainer.settings import TrainerSettings


@dataclass
class RankLoopTimes:
    """Rank 0's loop, per step."""

    update: list[float] = field(default_factory=list)
    capture: list[float] = field(default_factory=list)
    submit: list[float] = field(default_factory=list)
    shard_copy: list[float] = field(default_factory=list)
    """Not part of the step: copying rank 0's own FSDP shards into a reused snapshot, timed after the
    submit. What the capture would cost if each rank only copied its shards and the gather to the
    owners ran in the publish thread, on the publish group."""

    @property
    def blocked(self) -> list[float]:
        return [c + s for c, s in zip(self.capture, self.submit, strict=True)]

    @property
    def steps(self) -> list[float]:
        return [u + b for u, b in zip(self.update, self.blocked, strict=True)]

    @property
    def fraction(self) -> float:
        """Blocked on publishing over the step, totals over the loop (as `LoopTimes.fraction`)."""
        return sum(self.blocked) / sum(self.steps)

    def median(self, what: str) -> float:
        return statistics.median(getattr(self, what))


@dataclass
class _Setup:
    settings: TrainerSettings
    batch: list[GroupBatchItem]
    repeats: int
    store_path: str


async def _leader_loop(setup: _Setup, ctx) -> RankLoopTimes:
    """Rank 0: `Trainer._prepare` and `Trainer._train` reduced to the update, the capture and the publish."""
    from workers.trainer.distributed import local_tensor
    from workers.trainer.publishing import BackgroundPublisher, Pending, copy_weights
    from workers.trainer.ranks import RankPublisher, RankTraining, extra_files, source_shapes, start_followers

    settings, cfg = setup.settings, setup.settings.trainer
    blobs = open_blob_store(settings.blobs)
    event_log = await EventLog.connect(settings, worker="bench-trainer")
    training = await asyncio.to_thread(RankTraining, settings, ctx, blobs)
    chain = ChainPublisher(
        event_log,
        blobs,
        run_id=settings.run_id,
        model_config=training.model.config.to_dict(),
        settings=settings.chain,
        extra_files=extra_files(cfg.model_dir),
        source_shapes=source_shapes(training.model),
    )
    times = RankLoopTimes()
    try:
        training.plan_owners(chain)
        publisher = RankPublisher(chain, training)
        await publisher.open()
        start_followers(chain, ctx)
        await publisher.publish(0, await asyncio.to_thread(training.capture))

        async def publish(pending: Pending[None]) -> None:
            await publisher.publish(pending.version, pending.weights)

        background: BackgroundPublisher[None] = BackgroundPublisher(publish, cfg.publish_depth, name="bench publisher")
        shards: dict = {}
        model_state = training.model.state_dict

        async def loop() -> None:
            for version in range(setup.repeats):
                started = time.perf_counter()
                await asyncio.to_thread(training.update, setup.batch, version, frozenset())
                updated = time.perf_counter()
                weights = await asyncio.to_thread(training.capture)
                captured = time.perf_counter()
                submit = await background.submit(version + 1, weights, None)
                times.update.append(updated - started)
                times.capture.append(captured - updated)
                times.submit.append(submit)
                copied = time.perf_counter()
                await asyncio.to_thread(copy_weights, shards, {n: local_tensor(t) for n, t in model_state().items()})
                times.shard_copy.append(time.perf_counter() - copied)
            await background.drain()

        guards = [background.start()]
        try:
            await run_guarded(loop(), guards)
        finally:
            await end_guards(guards)
        await asyncio.to_thread(training.stop)  # rank 1 returns after publishing its last part
    finally:
        chain.close()
        await event_log.close()
    return times


def _rank_main(setup: _Setup, rank: int):
    def main(conn: Connection) -> None:
        import torch.distributed as dist

        from workers.trainer.loop import determinism
        from workers.trainer.ranks import follow_leader

        ctx = init_gloo(rank, 2, setup.store_path)
        determinism(setup.settings.trainer)  # as `run_trainer` sets every rank up
        if rank == 0:
            answer(conn, asyncio.run(_leader_loop(setup, ctx)))
        else:
            follow_leader(setup.settings, ctx, open_blob_store(setup.settings.blobs))
            answer(conn, None)
        dist.destroy_process_group()

    return main


def time_two_rank_loop(
    settings: TrainerSettings, batch: list[GroupBatchItem], repeats: int, scratch: Path
) -> RankLoopTimes:
    """Run the two ranks (the model from `settings.trainer.model_dir`) for `repeats` steps."""
    setup = _Setup(settings=settings, batch=batch, repeats=repeats, store_path=str(scratch / "loop-store"))
    workers = start_workers({"loop-rank0": _rank_main(setup, 0), "loop-rank1": _rank_main(setup, 1)})
    try:
        times, _ = receive_all(workers)
    finally:
        stop_workers(workers)
    return times
