"""One version published by one process against the same version published by two ranks.

The same model and the same sequence of versions (a keyframe every `keyframe_every`, sparse patches
between, views bf16 + fp8) go to one chain per *arm* on the bench's private stack. An arm of one
process publishes with `ChainPublisher.publish` (the 1-rank trainer's path); an arm of two forked gloo
ranks has each rank hold only the full tensors it owns (`layout.owned(rank, 2)`) and call the
trainer's `RankPublisher.publish` (keyframe agreement, `publish_part`, the parts' gather on the
publish group, rank 0's `append_parts`, rank 1's `advance`). Arms take turns one version at a time,
the order rotated every version, so all see the same machine; an arm idles while another works.
Every process runs torch with the trainer's thread count (`trainer.threads`, as `determinism` sets
it) and the publisher's own pools as they are. An arm may pin each of its processes to cores
(`os.sched_setaffinity`): the bench pins a 1-rank arm to one core and a 2-rank arm to one core a
rank, which is what sharding gives when every rank brings its own cores.

A version's time runs from the start of publishing to the appended event (two ranks leave a barrier
together first; rank 0 times it). Each process also reports where its time went: its part (views,
diff, upload), the parts' gather (rank 0: includes waiting for rank 1's part), the append, the
uploads (summed over the threads that run them side by side), the CPU seconds it used (all its
threads), and the seconds its threads were ready to run but waited for a core (Linux schedstat).
Around each version the parent also reads what the stack's servers and the whole machine spent.

A version after the first is an Adam-sized step of the trainer's default learning rate in a random
direction per element, as Adam's first steps are (deterministic per tensor and version, so every
process computes the same bits of the tensors it holds; the profile reports the fraction of each
view's elements that changed: about a quarter in bf16, 3% in fp8 for the demo model). Every arm must
publish every version with the same root hashes, or the comparison fails.
"""

from __future__ import annotations

import asyncio
import os
import re
import statistics
import threading
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.distributed as dist

from infra.stack import StackSettings
from infra.stack_state import read_state, stack_dir
from infra.streams import apply
from pipeline.blobstore import open_blob_store
from pipeline.chain_publish import ChainPublisher
from pipeline.config import ChainSettings
from pipeline.eventlog import EventLog
from pipeline.publish_layout import PublishLayout
from schemas import PolicyVersion
from workers.bench.forked_ranks import (
    BenchWorkerFailed,
    Worker,
    answer,
    init_gloo,
    receive_all,
    start_workers,
    stop_workers,
)
from workers.trainer.distributed import RankContext
from workers.trainer.settings import TrainerSection


@dataclass
class VersionTiming:
    """One version on one publishing process."""

    version: int
    keyframe: bool
    seconds: float
    """Start of publishing to return (on rank 0 and a single process: to the appended event)."""
    part_s: float = 0.0
    """`publish_part`: this process's views, diffs and uploads."""
    gather_s: float = 0.0
    """The parts' gather on the publish group (rank 0: includes waiting for the other rank's part)."""
    append_s: float = 0.0
    """`append_parts`: joining the parts, a keyframe's metadata files, the fenced event."""
    cpu_s: float = 0.0
    """CPU seconds this process used meanwhile, all threads."""
    upload_s: float = 0.0
    """Seconds spent in the blob store's puts, summed over the threads that upload side by side."""
    uploads: int = 0
    runqueue_s: float = 0.0
    """Seconds this process's threads were ready to run but waited for a core, summed over threads:
    the cost of sharing the cores, as opposed to waiting on I/O or a lock."""
    thread_cpu_s: dict[str, float] = field(default_factory=dict)
    """CPU seconds by thread group (`THREAD_GROUPS`; `native` for threads Python did not start, gloo's
    and torch's): which part of the publisher keeps the cores busy."""
    stack_cpu_s: float = 0.0
    """CPU seconds of the stack's servers (SeaweedFS, nats-server) meanwhile (measured by the parent)."""
    machine_busy_s: float = 0.0
    """CPU seconds the whole machine was busy meanwhile, every process (measured by the parent)."""
    root_hashes: dict[str, str] = field(default_factory=dict)
    """Per view, the appended version's root hash (rank 0): every arm must publish the same bits."""
    changed: dict[str, float] = field(default_factory=dict)
    """Per view, the fraction of elements that changed from the previous version (rank 0)."""


@dataclass(frozen=True)
class Arm:
    """One way of publishing: `ranks` processes (1 or 2), each pinned to `cores[rank]` if given."""

    name: str
    ranks: int
    cores: tuple[frozenset[int], ...] | None = None


@dataclass
class PublishComparison:
    timings: dict[str, list[list[VersionTiming]]] = field(default_factory=dict)
    """Per arm, per rank, per version."""
    units: int = 0
    unit_share: list[float] = field(default_factory=list)
    """Each of two ranks' share of the estimated bytes (the layout's balance)."""

    def seconds(self, arm: str) -> float:
        """Median seconds a version took (rank 0 of the arm), keyframes among them."""
        return statistics.median(t.seconds for t in self.timings[arm][0])

    def speedup(self, single: str, ranks: str) -> float:
        return self.seconds(single) / self.seconds(ranks)

    def cpu_s(self, arm: str) -> float:
        """Median CPU seconds a version cost the arm's processes together."""
        return statistics.median(sum(per_rank) for per_rank in zip(*self._of(arm, "cpu_s"), strict=True))

    def _of(self, arm: str, what: str) -> list[list[float]]:
        return [[getattr(t, what) for t in rank] for rank in self.timings[arm]]

    def profile(self, arm: str) -> dict[str, dict[str, float]]:
        """Medians of every measured part, patches and keyframes apart: where a version's time goes."""
        out: dict[str, dict[str, float]] = {}
        for kind, keyframe in (("patch", False), ("keyframe", True)):
            row: dict[str, float] = {}
            for rank, timings in enumerate(self.timings[arm]):
                chosen = [t for t in timings if t.keyframe == keyframe]
                if not chosen:
                    continue
                prefix = f"rank{rank}_" if len(self.timings[arm]) > 1 else ""
                stages = ["seconds", "part_s", "append_s", "cpu_s", "runqueue_s", "upload_s", "uploads"]
                if len(self.timings[arm]) > 1:
                    stages.insert(2, "gather_s")
                if rank == 0:
                    stages += ["stack_cpu_s", "machine_busy_s"]
                for what in stages:
                    row[prefix + what] = round(statistics.median(getattr(t, what) for t in chosen), 4)
                if not keyframe:
                    for group in sorted({g for t in chosen for g in t.thread_cpu_s}):
                        cpu = statistics.median(t.thread_cpu_s.get(group, 0.0) for t in chosen)
                        row[f"{prefix}cpu_s_{group}"] = round(cpu, 4)
                if rank == 0 and not keyframe:
                    for view in chosen[0].changed:
                        row[f"changed_{view}"] = round(statistics.median(t.changed[view] for t in chosen), 5)
            out[kind] = row
        return out


def next_weights(weights: Mapping[str, torch.Tensor], version: int, step: float) -> dict[str, torch.Tensor]:
    """Version `version` from its predecessor: every element moved by `step` up or down. Seeded by the
    tensor's name and the version, so a rank holding some tensors computes exactly the single process's."""
    out = {}
    for name, tensor in weights.items():
        gen = torch.Generator().manual_seed(zlib.crc32(f"{version}/{name}".encode()))
        sign = torch.randint(0, 2, tensor.shape, generator=gen, dtype=torch.int8).to(tensor.dtype) * 2 - 1
        out[name] = tensor + step * sign
    return out


class _Stopwatch:
    """Times the publisher's stages by wrapping its methods on the instance: the measured path is the
    publisher's own code, called as it calls itself. Uploads run in several threads at once: their
    time is summed (a lock keeps the sums whole)."""

    STAGES = ("part", "gather", "append", "upload")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.spent: dict[str, float] = {}
        self.reset()

    def wrap_async(self, owner: object, method: str, stage: str) -> None:
        inner = getattr(owner, method)

        async def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return await inner(*args, **kwargs)
            finally:
                self._add(stage, time.perf_counter() - started)

        setattr(owner, method, timed)

    def wrap_sync(self, owner: object, method: str, stage: str) -> None:
        inner = getattr(owner, method)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self._add(stage, time.perf_counter() - started)

        setattr(owner, method, timed)

    def _add(self, stage: str, seconds: float) -> None:
        with self._lock:
            self.spent[stage] += seconds
            self.spent[f"{stage}_count"] += 1

    def reset(self) -> None:
        with self._lock:
            self.spent = dict.fromkeys(self.STAGES, 0.0) | {f"{s}_count": 0 for s in self.STAGES}

    def timing(self, version: int, keyframe: bool, seconds: float, cpu_s: float, runqueue_s: float) -> VersionTiming:
        s = self.spent
        return VersionTiming(
            version=version,
            keyframe=keyframe,
            seconds=seconds,
            part_s=s["part"],
            gather_s=s["gather"],
            append_s=s["append"],
            cpu_s=cpu_s,
            upload_s=s["upload"],
            uploads=int(s["upload_count"]),
            runqueue_s=runqueue_s,
        )


@dataclass
class _Setup:
    """What every publishing process needs; inherited through the fork."""

    settings: StackSettings
    chain: ChainSettings
    model_config: dict
    initial: dict[str, torch.Tensor]
    step: float
    threads: int
    scratch: Path


@dataclass(frozen=True)
class _Role:
    """One publishing process: rank `rank` of `arm`."""

    arm: Arm
    rank: int
    writer_id: str

    @property
    def run_id(self) -> str:
        return f"benchpublish-{self.arm.name.replace('_', '-')}"


def _worker_main(setup: _Setup, role: _Role):
    def main(conn: Connection) -> None:
        if role.arm.cores is not None:
            os.sched_setaffinity(0, role.arm.cores[role.rank])  # before any thread: they inherit it
        torch.set_num_threads(setup.threads)
        ctx = None
        if role.arm.ranks > 1:
            ctx = init_gloo(role.rank, role.arm.ranks, str(setup.scratch / f"{role.run_id}-store"))
        asyncio.run(_serve(conn, setup, role, ctx))
        if ctx is not None:
            dist.destroy_process_group()
        answer(conn, "done")

    return main


async def _serve(conn: Connection, setup: _Setup, role: _Role, ctx: RankContext | None) -> None:
    from workers.trainer.ranks import RankPublisher

    leader = role.rank == 0
    event_log = await EventLog.connect(setup.settings, worker="bench-trainer") if leader else None
    chain = ChainPublisher(
        event_log,  # type: ignore[arg-type]  # rank 1 never touches the log, as in the trainer
        open_blob_store(setup.settings.blobs),
        run_id=role.run_id,
        model_config=setup.model_config,
        settings=setup.chain,
        writer_id=role.writer_id,
        source_shapes={n: tuple(t.shape) for n, t in setup.initial.items()},
    )
    try:
        if leader:
            await chain.open()
        else:
            chain.start_at(None)
        stopwatch = _Stopwatch()
        stopwatch.wrap_async(chain, "publish_part", "part")
        stopwatch.wrap_async(chain, "append_parts", "append")
        stopwatch.wrap_sync(chain.blobs, "put_bytes", "upload")
        stopwatch.wrap_sync(chain.blobs, "put_file", "upload")
        if ctx is None:
            publish: Callable[[int, Mapping[str, torch.Tensor]], Awaitable[object]] = chain.publish
            owned = list(setup.initial)
        else:
            # Each rank already holds the full tensors it owns: the gather from shards that the trainer's
            # publish starts with (`RankTraining.gather_captured`) is left out here and timed inside the
            # training loop's figures (`publish_fraction_2_ranks`).
            publisher = RankPublisher(chain, _HoldsOwned(ctx))
            stopwatch.wrap_sync(publisher, "_gather", "gather")
            publish = publisher.publish
            owned = chain.layout.owned(ctx.rank, ctx.world_size)
        await _publish_versions(conn, setup, chain, publish, stopwatch, owned=owned, ranked=ctx is not None)
    finally:
        chain.close()
        if event_log is not None:
            await event_log.close()


class _HoldsOwned:
    """What `RankPublisher` needs of the training when the rank's weights are its owned tensors already."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx

    def gather_captured(self, captured: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        return captured


async def _publish_versions(
    conn: Connection,
    setup: _Setup,
    chain: ChainPublisher,
    publish: Callable[[int, Mapping[str, torch.Tensor]], Awaitable[object]],
    stopwatch: _Stopwatch,
    *,
    owned: list[str],
    ranked: bool,
) -> None:
    """Answer "ready", then for each version the parent names: ("prepare", v) computes its weights,
    ("publish", v) publishes them; None ends. Preparing apart keeps that work out of any measurement.
    `owned`: the tensors this process holds; `ranked`: ranks leave a barrier together before each
    version (on the training's group: the publish group is the one measured)."""
    weights = {n: setup.initial[n] for n in owned}
    answer(conn, "ready")
    while (command := await asyncio.to_thread(conn.recv)) is not None:
        what, version = command
        if what == "prepare":
            if version > 0:
                weights = next_weights(weights, version, setup.step)
            answer(conn, "prepared")
            continue
        keyframe = chain.needs_keyframe(version)
        if ranked:
            await asyncio.to_thread(dist.barrier)
        stopwatch.reset()
        before, cpu, started = _thread_stats(), time.process_time(), time.perf_counter()
        event = await publish(version, weights)
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        after = _thread_stats()
        waited = sum(wait - before.get(tid, (0, 0))[1] for tid, (_, wait) in after.items()) / 1e9
        timing = stopwatch.timing(version, keyframe, seconds, cpu, waited)
        timing.thread_cpu_s = _by_thread_group({tid: on - before.get(tid, (0, 0))[0] for tid, (on, _) in after.items()})
        if isinstance(event, PolicyVersion):
            timing.root_hashes = {v.view: v.root_hash for v in event.views}
            timing.changed = {v.view: v.changed_elements / max(1, v.total_elements) for v in event.views}
        answer(conn, timing)


async def apply_streams(settings: StackSettings) -> None:
    """The streams on a fresh private stack, before any worker appends."""
    event_log = await EventLog.connect(settings, worker="bench-trainer")
    try:
        await apply(event_log.js, settings.streams, "benchpublish")
    finally:
        await event_log.close()


def default_arms() -> list[Arm]:
    """One process against two ranks as the scheduler places them (the trainer's case on one host); and,
    where two cores can be told apart, one process on one core against two ranks on a core each."""
    arms = [Arm("1_rank", 1), Arm("2_ranks", 2)]
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2:
        one, two = frozenset(cores[:1]), frozenset(cores[1:2])
        arms += [Arm("1_rank_1_core", 1, (one,)), Arm("2_ranks_core_each", 2, (one, two))]
    return arms


def compare_publishing(
    settings: StackSettings,
    model: torch.nn.Module,
    *,
    versions: int,
    keyframe_every: int,
    views: list[str],
    scratch: Path,
    arms: list[Arm] | None = None,
    publish_units: int = ChainSettings().publish_units,
    threads: int = TrainerSection().threads,
) -> PublishComparison:
    """Publish versions 0..`versions` of `model` in every arm, taking turns, on the stack `settings`
    names (its streams applied); version 0, a keyframe that warms every process up, is not counted.
    `scratch`: a folder for the ranks' file stores."""
    from pipeline.codec.warm import warm

    warm()  # compiled (or loaded) once here, inherited by every fork
    arms = arms if arms is not None else default_arms()
    state = {n: t.detach().to("cpu", torch.float32).clone() for n, t in model.state_dict().items()}
    setup = _Setup(
        settings=settings,
        chain=ChainSettings(views=views, keyframe_every=keyframe_every, publish_units=publish_units),
        model_config=model.config.to_dict(),
        initial=state,
        step=TrainerSection().learning_rate,
        threads=threads,
        scratch=scratch,
    )
    # One writer id an arm: every rank's blobs of a version under one prefix, as `start_followers` does.
    writers = {arm.name: uuid.uuid4().hex[:12] for arm in arms}
    roles = [_Role(arm, rank, writers[arm.name]) for arm in arms for rank in range(arm.ranks)]
    workers = start_workers({f"{r.arm.name}/rank{r.rank}": _worker_main(setup, r) for r in roles})
    groups = [[w for w, r in zip(workers, roles, strict=True) if r.arm == arm] for arm in arms]
    result = PublishComparison(timings={arm.name: [[] for _ in range(arm.ranks)] for arm in arms})
    try:
        receive_all(workers)  # "ready"
        servers = _server_pids(settings)
        turns = list(zip(arms, groups, strict=True))
        for version in range(versions + 1):
            shift = version % len(turns)  # rotated: no arm always runs right after the same other one
            for arm, group in turns[shift:] + turns[:shift]:
                for rank, timing in enumerate(_publish_one(group, version, servers)):
                    if version > 0:  # version 0 warms up: connections, pools, the first allocations
                        result.timings[arm.name][rank].append(timing)
        for w in workers:
            w.send(None)
        receive_all(workers)  # "done"
    finally:
        stop_workers(workers)
    _check_same_bits(result)
    layout = PublishLayout.plan(
        {n: tuple(t.shape) for n, t in state.items()},
        max_shard_bytes=setup.chain.max_shard_bytes,
        min_units=setup.chain.publish_units,
    )
    result.units = layout.count
    total = sum(layout.unit_bytes)
    result.unit_share = [round(sum(layout.unit_bytes[u] for u in layout.units_of(r, 2)) / total, 4) for r in range(2)]
    return result


def _check_same_bits(result: PublishComparison) -> None:
    """Every arm published every version with the same root hashes, or the comparison is void."""
    arms = list(result.timings)
    for i, reference in enumerate(result.timings[arms[0]][0]):
        for arm in arms[1:]:
            other = result.timings[arm][0][i]
            if other.root_hashes != reference.root_hashes or not reference.root_hashes:
                raise BenchWorkerFailed(
                    f"version {reference.version}: {arms[0]} published {reference.root_hashes}, "
                    f"{arm} {other.root_hashes}",
                    hint="the arms must publish the same bits for their times to compare",
                )


def _publish_one(group: list[Worker], version: int, servers: list[int]) -> list[VersionTiming]:
    """Prepare, then publish `version` on every process of one arm; rank 0's timing gets what the
    stack's servers and the whole machine spent meanwhile."""
    for w in group:
        w.send(("prepare", version))
    receive_all(group)
    stack_before, machine_before = _cpu_of(servers), _machine_busy()
    for w in group:
        w.send(("publish", version))
    timings = receive_all(group)
    timings[0].stack_cpu_s = _cpu_of(servers) - stack_before
    timings[0].machine_busy_s = _machine_busy() - machine_before
    return timings


_TICK = os.sysconf("SC_CLK_TCK")


def _server_pids(settings: StackSettings) -> list[int]:
    status = read_state(stack_dir(settings))
    return [s.pid for s in status.servers] if status is not None else []


def _cpu_of(pids: list[int]) -> float:
    """User + system CPU seconds of these processes so far (Linux /proc; 0 where unreadable)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat
    return total / _TICK


def _machine_busy() -> float:
    """CPU seconds the machine's cores were busy so far (Linux /proc/stat; 0 where unreadable)."""
    try:
        values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:8]]
    except (OSError, ValueError):
        return 0.0
    return (sum(values) - values[3] - values[4]) / _TICK  # all but idle and iowait


def _thread_stats() -> dict[int, tuple[int, int]]:
    """Per thread of this process: nanoseconds on a core and waiting for one so far (Linux schedstat;
    {} without it)."""
    stats = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            on_cpu, waiting = (task / "schedstat").read_text().split()[:2]
            stats[int(task.name)] = (int(on_cpu), int(waiting))
        except (OSError, ValueError):
            continue  # a thread that ended meanwhile
    return stats


THREAD_GROUPS = {
    "MainThread": "event_loop",
    "ThreadPoolExecutor": "codec_pool",  # the one unnamed pool of a publishing process: ChainPublisher's
    "publish-unit": "unit_pool",
    "asyncio": "to_thread",  # asyncio.to_thread: each view's part, the gather, the keyframe agreement
}


def _by_thread_group(cpu_ns: dict[int, int]) -> dict[str, float]:
    names = {t.native_id: re.sub(r"(-\d+)?(_\d+)?$", "", t.name) for t in threading.enumerate()}
    groups: dict[str, float] = {}
    for tid, ns in cpu_ns.items():
        name = names.get(tid)
        group = "native" if name is None else THREAD_GROUPS.get(name, name)
        groups[group] = groups.get(group, 0.0) + ns / 1e9
    return groups
