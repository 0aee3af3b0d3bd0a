"""What `sprawl up` knows about its run: a projection of the log, rebuilt by tailing the streams.

Everything the live view and the end summary show comes from events (versions, trainer metrics,
heartbeats, trajectories, rewards, dead letters, dropped groups) plus each version's lineage in
S3, so a second `sprawl up` that continues a run sees the whole history, not just its own part.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import statistics
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import msgspec
import nats.errors

from pipeline.blobstore import BlobStore
from pipeline.errors import PoisonEvent, SprawlError, TransientError
from pipeline.eventlog import NO_ANSWER, EventLog
from pipeline.logs import get_logger
from pipeline.replay import tail_messages
from pipeline.subjects import group_dropped_subject, prompts_subject
from pipeline.topology import (
    DEADLETTER,
    METRICS,
    POLICY,
    PROMPTS,
    REWARDS,
    TRAINER,
    TRAJECTORIES,
    policy_filter,
    rewards_filter,
    trajectories_filter,
)
from schemas import (
    DeadLetter,
    GroupDropped,
    IslandDrift,
    IslandHeartbeat,
    LineageDecodeError,
    PolicyVersion,
    PromptGroup,
    Reward,
    TrainerMetrics,
    Trajectory,
    ViewVersion,
    decode_lineage,
)

log = get_logger(__name__)


@dataclass
class IslandState:
    island_id: str
    view: str
    group: str
    version: int | None = None
    state: str = "starting"
    tokens_per_s: float = 0.0
    groups_done: int = 0
    seen_at: float = 0.0


@dataclass
class VersionRecord:
    version: int
    trainer_step: int
    at: float
    shipped_bytes: int
    """Bytes a sampler of each view downloads for this version (patches, or keyframes), all views."""
    patch_bytes: int
    full_bytes: int
    """What shipping a full keyframe of every view at this version would have cost."""
    consumed: int
    groups: list[str] = field(default_factory=list)


@dataclass
class Comparison:
    """Mean group reward of the first and the last fifth of the updates, and a 95% CI on their difference."""

    first: float
    last: float
    ci: float
    groups_first: int
    groups_last: int

    @property
    def improved(self) -> bool:
        return self.last - self.first > self.ci


@dataclass
class RunState:
    run_id: str
    started_at: float = field(default_factory=time.time)
    versions: dict[int, VersionRecord] = field(default_factory=dict)
    keyframe_size: dict[str, int] = field(default_factory=dict)
    metrics: list[TrainerMetrics] = field(default_factory=list)
    islands: dict[str, IslandState] = field(default_factory=dict)
    trajectories_by_view: Counter = field(default_factory=Counter)
    trajectories_by_island: Counter = field(default_factory=Counter)
    rewards: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    rewards_seen: int = 0
    prompts_published: int = 0
    dead_letters: Counter = field(default_factory=Counter)
    dropped_groups: int = 0
    drift: dict[str, IslandDrift] = field(default_factory=dict)
    """Per island, the drift guard's newest verdict (flagged or recovered)."""

    def flagged_islands(self) -> list[IslandDrift]:
        """Islands whose newest verdict is `flagged`, by island id."""
        return [d for _, d in sorted(self.drift.items()) if d.state == "flagged"]

    def add_trajectory(self, island_id: str, view: str) -> None:
        self.trajectories_by_view[view] += 1
        self.trajectories_by_island[island_id] += 1

    def add_reward(self, group_id: str, value: float) -> None:
        self.rewards[group_id].append(value)
        self.rewards_seen += 1

    @property
    def head(self) -> int | None:
        return max(self.versions) if self.versions else None

    def trained_groups(self) -> int:
        return sum(len(v.groups) for v in self.versions.values()) + self.dropped_groups

    def bytes_totals(self) -> tuple[int, int, int]:
        """(patch bytes, what full keyframes for those patches would be, all bytes shipped) over the run."""
        updates = [v for v in self.versions.values() if v.version > 0]
        patch = sum(v.patch_bytes for v in updates)
        full = sum(v.full_bytes for v in updates)
        return patch, full, sum(v.shipped_bytes for v in self.versions.values())

    def reward_curve(self) -> list[tuple[int, float]]:
        return [(m.version, m.metrics["reward_mean"]) for m in self.metrics if "reward_mean" in m.metrics]

    def group_reward(self, group_id: str) -> float | None:
        values = self.rewards.get(group_id)
        return sum(values) / len(values) if values else None

    def comparison(self, fraction: float = 0.2) -> Comparison | None:
        """First vs last `fraction` of the updates, by the groups each update trained on (its lineage)."""
        updates = [self.versions[v] for v in sorted(self.versions) if v > 0 and self.versions[v].groups]
        if len(updates) < 2:
            return None
        k = max(1, round(len(updates) * fraction))
        first = [r for v in updates[:k] for g in v.groups if (r := self.group_reward(g)) is not None]
        last = [r for v in updates[-k:] for g in v.groups if (r := self.group_reward(g)) is not None]
        if len(first) < 2 or len(last) < 2:
            return None
        ci = 1.96 * math.sqrt(statistics.variance(first) / len(first) + statistics.variance(last) / len(last))
        return Comparison(statistics.fmean(first), statistics.fmean(last), ci, len(first), len(last))


class _IslandGlance(msgspec.Struct):
    island_id: str
    view: str


class _TrajectoryGlance(msgspec.Struct):
    island: _IslandGlance


class _RewardGlance(msgspec.Struct):
    group_id: str
    value: float


_GLANCES = {
    TRAJECTORIES.name: msgspec.json.Decoder(_TrajectoryGlance),
    REWARDS.name: msgspec.json.Decoder(_RewardGlance),
}


@dataclass
class ServiceHealth:
    """Whether a service answers, as `up` last saw it: an outage is a state the live view shows."""

    name: str
    up: bool = True
    since: float = field(default_factory=time.time)
    """When it last changed state."""
    error: str = ""

    def saw(self, up: bool, error: str = "", now: float | None = None) -> None:
        if up != self.up:
            self.up, self.since = up, time.time() if now is None else now
            (log.info if up else log.warning)(f"{self.name} {'answers again' if up else 'unreachable'}", error=error)
        self.error = "" if up else error


class RunMonitor:
    """Tails the run's streams into a RunState (one task per stream), and probes the bus and S3.

    Each feed keeps the stream sequence of the last message it counted and resumes after it when the
    feed is lost (a nats-server restart takes the replay's consumer with it): counts go on from where
    they were, never from the start again."""

    def __init__(self, event_log: EventLog, blobs: BlobStore, run_id: str, *, probe_every_s: float = 2.0):
        self.log, self.blobs = event_log, blobs
        self.state = RunState(run_id)
        self.positions: dict[str, int] = {}
        """Per stream: the sequence of the last message applied to the state."""
        self.bus = ServiceHealth("the bus (nats)")
        self.store = ServiceHealth("the blob store (S3)")
        self.probe_every_s = probe_every_s
        self._tasks: list[asyncio.Task] = []
        self._stop = asyncio.Event()

    def feeds(self) -> dict[str, str]:
        """Stream -> the subjects of this run that the monitor reads from it."""
        run = self.state.run_id
        return {
            POLICY.name: policy_filter(run),
            METRICS.name: METRICS.run_filter(run),  # trainer metrics, island heartbeats, drift verdicts
            TRAJECTORIES.name: trajectories_filter(run),
            REWARDS.name: rewards_filter(run),
            PROMPTS.name: prompts_subject(run),
            DEADLETTER.name: DEADLETTER.run_filter(run),
            TRAINER.name: group_dropped_subject(run),  # not the checkpoints and leases
        }

    def start(self, streams: list[str] | None = None, *, probe: bool = True) -> None:
        """Follow every feed (or only `streams`); `probe`: watch the bus and S3 too."""
        feeds = {k: v for k, v in self.feeds().items() if streams is None or k in streams}
        self._tasks = [
            asyncio.create_task(self._follow(stream, subject), name=f"monitor-{stream}")
            for stream, subject in feeds.items()
        ]
        if probe:
            self._tasks.append(asyncio.create_task(self._probe(), name="monitor-health"))

    async def stop(self) -> None:
        self._stop.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _reconnects(self) -> int:
        return int(self.log.nc.stats.get("reconnects", 0))

    async def _follow(self, stream: str, subject: str) -> None:
        """Read the feed; when it fails, or the client reconnected (the server may have lost the
        replay's consumer, and a fetch on a lost consumer only ever times out), read again from the
        message after the last one applied."""
        while not self._stop.is_set():
            reconnects = self._reconnects()
            feed = asyncio.create_task(self._read(stream, subject))
            reconnected = asyncio.create_task(self._until_reconnected(reconnects))
            try:
                await asyncio.wait({feed, reconnected}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (feed, reconnected):
                    task.cancel()
                await asyncio.gather(feed, reconnected, return_exceptions=True)
            if feed.done() and not feed.cancelled() and feed.exception() is None:
                return  # stopped
            error = feed.exception() if feed.done() and not feed.cancelled() else None
            if error is not None and not isinstance(error, (TransientError, *NO_ANSWER, nats.errors.Error)):
                raise error
            log.warning(
                "monitor feed lost; resuming after the last message it counted",
                stream=stream,
                stream_seq=self.positions.get(stream, 0),
                error=repr(error) if error is not None else "the client reconnected",
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=1.0)

    async def _until_reconnected(self, reconnects: int) -> None:
        while self._reconnects() == reconnects or not self.log.nc.is_connected:
            await asyncio.sleep(0.5)

    async def _read(self, stream: str, subject: str) -> None:
        start = self.positions.get(stream, 0) + 1
        async for msg in tail_messages(self.log, stream, subject, start, self._stop):
            seq = msg.metadata.sequence.stream
            if seq <= self.positions.get(stream, 0):
                continue  # already counted (a redelivery of a replay that was cut short)
            if not (stream in _GLANCES and self._glance(stream, msg.data)):
                try:
                    event = await self.log.resolve(msg.data, subject=msg.subject)
                except PoisonEvent:
                    event = None  # dead-lettered by the worker that consumed it; counted there
                if event is not None:
                    await self._apply(event)
            self.positions[stream] = seq

    async def _probe(self) -> None:
        """Every `probe_every_s`: does the bus answer a round trip, does S3 answer a listing?"""
        while not self._stop.is_set():
            try:
                await self.log.nc.flush(timeout=max(1, int(self.probe_every_s)))
                self.bus.saw(self.log.nc.is_connected, "" if self.log.nc.is_connected else "disconnected")
            except (*NO_ANSWER, nats.errors.Error) as exc:
                self.bus.saw(False, repr(exc))
            # One listing at a time, never abandoned: a thread cannot be cancelled, and piling up
            # probes of a hung store would starve every other `to_thread` of `up` (stopping workers).
            listing = asyncio.ensure_future(asyncio.to_thread(self.blobs.list_keys, "sprawl-health/"))
            done, _ = await asyncio.wait({listing}, timeout=self.probe_every_s * 5)
            if not done:
                self.store.saw(False, f"no answer to a listing within {self.probe_every_s * 5:.0f}s")
            try:
                await listing
                self.store.saw(True)
            except SprawlError as exc:
                self.store.saw(False, str(exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=self.probe_every_s)

    def _glance(self, stream: str, data: bytes) -> bool:
        """Count a trajectory or a reward from the few fields the view needs (these streams carry
        most of the bytes: decoding every token list would cost a core). False: decode it fully."""
        try:
            seen = _GLANCES[stream].decode(data)
        except msgspec.ValidationError:
            return False  # e.g. a claim check
        if isinstance(seen, _TrajectoryGlance):
            self.state.add_trajectory(seen.island.island_id, seen.island.view)
        else:
            self.state.add_reward(seen.group_id, seen.value)
        return True

    async def _apply(self, event) -> None:
        state = self.state
        match event:
            case PolicyVersion():
                await self._on_version(event)
            case TrainerMetrics():
                if not any(m.version == event.version for m in state.metrics):
                    state.metrics.append(event)
                    state.metrics.sort(key=lambda m: m.version)
            case IslandHeartbeat():
                island = state.islands.setdefault(
                    event.island.island_id,
                    IslandState(event.island.island_id, event.island.view, event.island.group or event.island.view),
                )
                island.version, island.state = event.current_version, event.state
                island.tokens_per_s, island.groups_done = event.tokens_per_s, event.prompt_groups_done
                island.seen_at = time.time()
            case Trajectory():
                state.add_trajectory(event.island.island_id, event.island.view)
            case Reward():
                state.add_reward(event.group_id, event.value)
            case PromptGroup():
                state.prompts_published += 1
            case DeadLetter():
                state.dead_letters[event.error_class] += 1
            case GroupDropped():
                state.dropped_groups += 1
            case IslandDrift():
                newest = state.drift.get(event.island_id)
                if newest is None or event.version >= newest.version:
                    state.drift[event.island_id] = event

    async def _on_version(self, event: PolicyVersion) -> None:
        state = self.state
        for view in event.views:
            if view.kind == "keyframe":
                state.keyframe_size[view.view] = view.bytes
        # What a follower at v-1 downloads: a keyframe also ships a patch from v-1 (a skip patch), and
        # followers take that instead of the keyframe.
        follow = [_follower_download(v, event.version) for v in event.views]
        shipped = sum(size for size, _ in follow)
        patch = sum(size for size, is_patch in follow if is_patch)
        full = sum(state.keyframe_size.get(v.view, v.bytes) for v in event.views)
        groups: list[str] = []
        if event.lineage_uri:
            try:
                lineage = decode_lineage(await asyncio.to_thread(self.blobs.get_bytes, event.lineage_uri))
                groups = [g.group_id for g in lineage.groups]
            except (SprawlError, LineageDecodeError) as exc:  # the summary says which versions it could not attribute
                log.warning("lineage unreadable", version=event.version, error=repr(exc))
        at = event.produced_at.timestamp()
        state.versions[event.version] = VersionRecord(
            event.version, event.trainer_step, at, shipped, patch, full, event.consumed_trajectories, groups
        )


def _follower_download(view: ViewVersion, version: int) -> tuple[int, bool]:
    """(bytes, whether they are a patch) that an island serving v-1 downloads for this view of `version`."""
    if view.kind == "keyframe":
        from_previous = [s.bytes for s in view.skip_patches if s.base_version == version - 1]
        return (from_previous[0], True) if from_previous else (view.bytes, False)
    return view.bytes, True
