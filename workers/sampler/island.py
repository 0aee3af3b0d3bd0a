"""An island: one engine, kept at an acceptable policy version.

The island follows the policy log in the background (a core-NATS subscription on the run's
policy subjects wakes it the moment a version is appended; a slow poll covers missed wake-ups),
materializes each new version through the chain before anyone asks for it, and commits it to the
engine with a short pause. Requests state which versions they accept; `ensure_version` either
returns at once, catches up first, or refuses with the current and the wanted version.

When the head cannot be built (a corrupt or missing blob on every route to it), the island serves
the newest version it can build and verify, says so (`blocked`, state `catching_up`, a log line),
and leaves the retries to the materializer's backoff: a wake-up per new version re-plans, but a
set-aside blob is not fetched again before its backoff has passed.

Trust: every version event is verified against the pinned key before any of it is used (the
materializer does it as it reads the event). A refused version (unsigned, signed by another key,
or a blob differing from its signed digest) is logged as an error, counted (`refused_versions`,
in heartbeats and `/metrics`), dead-lettered (`sprawl audit dead-letters`), and never served: the
island keeps its last good version and is `blocked` at the refused head until a later version
can be built without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import socket
import time
from collections import deque
from dataclasses import dataclass, field

import nats.errors

from pipeline.blobstore import BlobStore
from pipeline.dead_letter import dead_letter_refused_version
from pipeline.errors import SprawlError
from pipeline.eventlog import EventLog
from pipeline.logs import get_logger
from pipeline.materialize import Materialized, Materializer, VersionUnbuildable
from pipeline.route_failures import Backoff
from pipeline.subjects import policy_filter
from pipeline.version_log import VersionNotAvailable, chain_head
from pipeline.version_signing import VersionTrust
from schemas import IslandIdentity, VersionConstraint
from workers.lifecycle import raise_if_cancelled
from workers.sampler.engines.base import Capabilities, Engine, EngineError
from workers.sampler.settings import IslandSection

log = get_logger(__name__)


def build_island(
    event_log: EventLog, blob_settings, run_id: str, section: IslandSection, trust: VersionTrust
) -> Island:
    """The configured engine behind an island (what `sprawl sampler`, `sprawl sidecar` and benchmarks run).
    `trust`: `island_trust(settings.trust)`, read at the worker's start."""
    from pipeline.blobstore import open_blob_store
    from workers.sampler.engines.factory import create_engine

    engine = create_engine(
        section.engine,
        url=section.engine_url,
        device=section.device,
        compute_dtype=section.compute_dtype,
        top_logprobs=section.top_logprobs,
        fault=section.fault,
    )
    return Island(event_log, open_blob_store(blob_settings), engine, run_id=run_id, settings=section, trust=trust)


def default_island_id(view: str) -> str:
    """`<host>-<view>`, made a subject token (heartbeat subjects end with it): a fully qualified host
    name's dots, or any other character a token cannot hold, become '-'."""
    return re.sub(r"[^a-z0-9_-]+", "-", f"{socket.gethostname()}-{view}".lower()).strip("-_")


def _log_follower_death(task: asyncio.Task) -> None:
    """An unexpected error ends the follower (it retries only the expected ones); say so, since the
    island then keeps serving its last version."""
    if not task.cancelled() and task.exception() is not None:
        log.error("the island stopped following the chain", error=repr(task.exception()))


class VersionUnreachable(SprawlError):
    """The request's version constraint cannot be met by this island (HTTP 409)."""

    def __init__(self, current: int | None, wanted: str):
        self.current, self.wanted = current, wanted
        super().__init__(
            f"island is at version {current}; the request wants {wanted}",
            hint="retry later or route the request to another island",
        )


@dataclass(frozen=True)
class Blocked:
    """The newest version in the log that the island cannot build yet; it serves `serving` meanwhile."""

    head: int
    serving: int | None
    reason: str
    retry_in_s: float | None
    """Seconds until a failed part on the way to it may be tried again (None: nothing to wait for)."""


@dataclass(frozen=True)
class FollowFailure:
    """Why following the chain last failed (the log, the store or the engine), and the wait before the
    next try."""

    error: str
    failures: int
    """Failures in a row."""
    delay_s: float


@dataclass(frozen=True)
class CommitRecord:
    version: int
    committed_at: float
    """time.time() when the version started serving."""
    pause_s: float
    root_hash: str
    """Root hash of the verified bits it serves."""
    route: str
    written_bytes: int = 0
    """Bytes materializing it wrote to local disk (`Materialized.written_bytes`)."""
    changed_tensor_bytes: int = 0
    """Bytes of the tensors that differ from the version it was built from."""
    build_s: dict[str, float] = field(default_factory=dict)
    """Seconds per phase of materializing it (`Materialized.seconds`)."""


class IslandStats:
    """Commit counters over the island's whole life, and the last `keep` commits in detail.

    An island commits every version of a run, so keeping every commit (as this once did) grows
    without bound. The per-version mappings the sync benchmark's island process polls, and the
    pause list the sidecar summarizes, are read-only views of the recent window."""

    def __init__(self, keep: int = 256):
        self.commits = 0
        self.pause_total_s = 0.0
        self.written_bytes_total = 0
        """Bytes materializing the committed versions wrote to local disk."""
        self.changed_tensor_bytes_total = 0
        """Bytes of the tensors those versions changed: what the writes are held against."""
        self.recent: deque[CommitRecord] = deque(maxlen=keep)

    def record(self, commit: CommitRecord) -> None:
        self.commits += 1
        self.pause_total_s += commit.pause_s
        self.written_bytes_total += commit.written_bytes
        self.changed_tensor_bytes_total += commit.changed_tensor_bytes
        self.recent.append(commit)

    @property
    def pauses_s(self) -> list[float]:
        return [c.pause_s for c in self.recent]

    @property
    def committed_at(self) -> dict[int, float]:
        return {c.version: c.committed_at for c in self.recent}

    @property
    def pause_by_version(self) -> dict[int, float]:
        return {c.version: c.pause_s for c in self.recent}

    @property
    def root_hashes(self) -> dict[int, str]:
        return {c.version: c.root_hash for c in self.recent}

    @property
    def routes(self) -> dict[int, str]:
        return {c.version: c.route for c in self.recent}


class Island:
    def __init__(
        self,
        event_log: EventLog,
        blobs: BlobStore,
        engine: Engine,
        *,
        run_id: str,
        settings: IslandSection,
        trust: VersionTrust,
    ):
        self.log = event_log
        self.engine = engine
        self.run_id = run_id
        self.settings = settings
        retry = settings.route_retry
        self.backoff = Backoff(first_s=retry.first_s, max_s=retry.max_s, jitter=retry.jitter)
        self.materializer = Materializer(
            event_log,
            blobs,
            run_id=run_id,
            view=settings.view,
            settings=settings.materialize,
            retry=self.backoff,
            trust=trust,
        )
        self.stats = IslandStats()
        self.head: int | None = None
        self.blocked: Blocked | None = None
        """Set while the head cannot be built and an older version is served (or none yet)."""
        self.follow_failure: FollowFailure | None = None
        """Set while following the chain fails; cleared by the next round that works."""
        self.follow_failures = 0
        """Rounds of following that failed, over the island's life (a metric)."""
        self.capabilities: Capabilities | None = None
        self.state = "starting"
        self._commit_lock = asyncio.Lock()
        self._report_failures = 0
        self._report_retry_at = 0.0
        self._reporting = asyncio.Lock()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.follower: asyncio.Task | None = None
        """The task keeping the engine at the chain's head (None until `start(follow=True)`): its worker
        supervises it, so an island never lives on serving a stale version after its follower died."""
        self._sub = None
        self._loaded: Materialized | None = None
        """The version the engine holds, pinned: its directory is not recycled until a newer one is loaded."""

    @property
    def version(self) -> int | None:
        return self.engine.weight_version()

    @property
    def refused_versions(self) -> int:
        """Versions (or blobs of them) refused over the island's life: a metric, never reset."""
        return self.materializer.refusals.total

    def identity(self) -> IslandIdentity:
        caps = self.capabilities
        island_id = self.settings.island_id or default_island_id(self.settings.view)
        return IslandIdentity(
            island_id=island_id,
            accelerator=caps.accelerator if caps else "unknown",
            view=self.settings.view,
            engine=caps.engine if caps else self.settings.engine,
            engine_version=caps.engine_version if caps else "",
            kernels=dict(caps.kernels) if caps else {},
            region=self.settings.region,
            group=self.settings.group or self.settings.view,
        )

    async def start(self, *, follow: bool = True) -> None:
        await self.engine.start()
        self.capabilities = await self.engine.capabilities()
        if follow:
            self._sub = await self.log.nc.subscribe(policy_filter(self.run_id), cb=self._on_policy_message)
            follower = asyncio.create_task(self._follow(), name="the island's chain follower")
            follower.add_done_callback(_log_follower_death)
            self._tasks.append(follower)
            self.follower = follower

    async def stop(self) -> None:
        self.state = "draining"
        for task in self._tasks:
            task.cancel()
        # collected, not raised: a follower that died of an error was already logged when it died
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._sub is not None:
            with contextlib.suppress(nats.errors.Error):  # the connection may be closed already
                await self._sub.unsubscribe()
        if self._loaded is not None:
            self._loaded.release()

    async def _on_policy_message(self, _msg) -> None:
        self._wake.set()

    async def _follow(self) -> None:
        """Keep the engine at the head of the chain (prefetch, stage, commit), or as near as it can be built."""
        failures = 0
        rng = random.Random()
        while True:
            self._wake.clear()  # before looking: a version appended while we work wakes the next round
            try:
                head = await chain_head(self.log, self.run_id)
                if head is not None:
                    self.head = head.version if self.head is None else max(self.head, head.version)
                    if self.version is None or self.version < head.version:
                        await self.advance(head.version)
                failures, self.follow_failure = 0, None
            except (SprawlError, EngineError, nats.errors.Error, OSError) as exc:
                # The log, the blob store or the engine failed. Wait out a backoff that a wake-up does not
                # cut short: with a version a second, retrying on every wake-up was a hot loop.
                failures += 1
                self.follow_failures += 1
                delay = self.backoff.delay(failures, rng)
                self.follow_failure = FollowFailure(repr(exc), failures, delay)
                log.warning(
                    "following the chain failed; will retry", error=repr(exc), failures=failures, retry_in_s=delay
                )
                raise_if_cancelled()  # nats-py may have turned our cancellation into that timeout
                self._settle_state()
                await asyncio.sleep(delay)
                continue
            wait_s = self.settings.poll_interval_s
            if self.blocked is not None and self.blocked.retry_in_s is not None:
                wait_s = min(wait_s, max(self.blocked.retry_in_s, 0.01))  # retry as the backoff ends
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=wait_s)

    async def advance(self, head: int) -> int | None:
        """Serve `head` or, when no route to it works now, the newest version newer than the one served
        that can be built and verified (`blocked` says which and why). Returns the version served."""
        async with self._commit_lock:
            served = await self._advance_locked(head)
        await self._report_refusals()  # outside the lock: a slow log must not hold up a commit
        return served

    async def _advance_locked(self, head: int) -> int | None:
        current = self.version
        if current is not None and current >= head:
            self._unblock(current)
            return current
        self.state = "catching_up" if current is not None else "starting"
        try:
            got = await self.materializer.materialize_newest(head, above=current, pin=True)
        except VersionUnbuildable as exc:
            self._block(head, exc.message, exc.retry_in_s)
            return current
        except BaseException:
            self._settle_state()
            raise
        await self._load(got)
        if got.version < head:
            failures = self.materializer.failures
            reasons = self.materializer.refusals.reasons(got.version + 1, head) + failures.reasons(
                got.version + 1, head
            )
            self._block(head, "; ".join(reasons) or "no route", failures.retry_in_s(got.version + 1, head))
        else:
            self._unblock(got.version)
        return got.version

    async def commit(self, version: int) -> int:
        """Materialize exactly `version` (waiting for it to reach the log) and commit it to the engine."""
        try:
            async with self._commit_lock:
                committed = await self._commit_locked(version)
        except VersionUnbuildable:
            await self._report_refusals()  # a refused version is reported whoever asked for it
            raise
        await self._report_refusals()
        return committed

    async def _commit_locked(self, version: int) -> int:
        if self.version is not None and self.version >= version:
            return self.version
        self.state = "catching_up" if self.version is not None else "starting"
        try:
            got = await self.materializer.materialize(version, pin=True)
            await self._load(got)
        finally:
            self._settle_state()
        if self.blocked is not None and version >= self.blocked.head:
            self._unblock(version)
        return version

    async def _load(self, got: Materialized) -> None:
        """Commit `got` (pinned by the materializer) to the engine; the version it replaces is unpinned only
        once the engine has loaded the new one, so its directory stays whole while it may still be read."""
        try:
            pause = await self.engine.load_weights(
                got.path, got.version, self._changed_since(self.version, got.version)
            )
        except BaseException:
            got.release()  # the engine still serves the previous version, which stays pinned
            raise
        if self._loaded is not None:
            self._loaded.release()
        self._loaded = got
        self.stats.record(
            CommitRecord(
                got.version,
                time.time(),
                pause,
                got.root_hash,
                got.route,
                written_bytes=got.written_bytes,
                changed_tensor_bytes=got.changed_tensor_bytes,
                build_s=got.seconds,
            )
        )
        self.head = got.version if self.head is None else max(self.head, got.version)
        log.info(
            "serving version",
            version=got.version,
            route=got.route,
            pause_s=round(pause, 4),
            downloaded_bytes=got.downloaded_bytes,
            written_bytes=got.written_bytes,
        )

    async def _report_refusals(self) -> None:
        """Dead-letter each refusal not yet reported. A log that does not take one now is tried again
        after a backoff (not on every wake-up): the refusal stays counted and logged meanwhile, and
        serving goes on either way."""
        if time.monotonic() < self._report_retry_at or self._reporting.locked():
            return  # another caller (the follower, a request catching up) is reporting them now
        async with self._reporting:
            await self._report_unreported()

    async def _report_unreported(self) -> None:
        for refusal in self.materializer.refusals.unreported():
            try:
                await dead_letter_refused_version(
                    self.log,
                    run_id=self.run_id,
                    version=refusal.version,
                    event_id=refusal.event_id,
                    reason=refusal.reason,
                    error_class=refusal.error_class,
                    refused_by=self.identity().island_id,
                )
            except (SprawlError, nats.errors.Error, OSError) as exc:
                raise_if_cancelled()
                self._report_failures += 1
                delay = self.backoff.delay(self._report_failures, random.Random())
                self._report_retry_at = time.monotonic() + delay
                log.warning(
                    "refusal not dead-lettered yet; will retry",
                    version=refusal.version,
                    error=repr(exc),
                    retry_in_s=round(delay, 3),
                )
                return
            self._report_failures = 0
            self.materializer.refusals.reported(refusal)

    def _block(self, head: int, reason: str, retry_in_s: float | None) -> None:
        if self.blocked is None or (self.blocked.head, self.blocked.serving) != (head, self.version):
            log.warning(
                "cannot build the head yet; serving the newest version that could be built",
                head=head,
                version=self.version,
                reason=reason,
                retry_in_s=retry_in_s,
            )
        self.blocked = Blocked(head, self.version, reason, retry_in_s)
        self._settle_state()

    def _unblock(self, version: int) -> None:
        if self.blocked is not None:
            log.info("the head can be built again", version=version, was_blocked_at=self.blocked.head)
            self.blocked = None
        self._settle_state()

    def _settle_state(self) -> None:
        """The state after a commit attempt, whatever its outcome (the heartbeat reports it)."""
        if self.state == "draining":
            return
        if self.version is None:
            self.state = "starting"
        else:
            self.state = "catching_up" if self.blocked is not None else "serving"

    def _changed_since(self, current: int | None, version: int) -> list[str] | None:
        """Served tensors whose bits differ between the version the engine holds and `version`
        (None: reload everything), when the engine can load changed tensors only."""
        if current is None or self.capabilities is None or not self.capabilities.load_changed_tensors:
            return None
        held, wanted = self.materializer.known_event(current), self.materializer.known_event(version)
        if held is None or wanted is None:
            return None
        old = {t.name: t.xxh3 for t in self.materializer.view_entry(held).tensors}
        new = {t.name: t.xxh3 for t in self.materializer.view_entry(wanted).tensors}
        if set(old) != set(new):
            return None
        return sorted(name for name, digest in new.items() if old[name] != digest)

    async def ensure_version(
        self,
        accepts: VersionConstraint | None,
        max_staleness: int | None = None,
        *,
        wait_s: float = 60.0,
        wait_for_log: bool = True,
    ) -> int:
        """Return the committed version once it satisfies the constraint, catching up if possible.

        `wait_for_log=False` refuses at once (VersionUnreachable) when the wanted version is not in
        the log yet, instead of waiting for the trainer: what an HTTP caller wants (409, retry).
        """
        accepts = accepts or VersionConstraint()
        if self.version is None:
            head = await chain_head(self.log, self.run_id)
            if head is None:
                await self._wait_for_any(wait_s)
            else:
                await self.advance(head.version)
        current = self.version
        if current is None:
            reason = self.blocked.reason if self.blocked is not None else "nothing could be built"
            raise VersionUnreachable(None, f"any version (none can be built yet: {reason})")
        if accepts.exact_version is not None:
            if current == accepts.exact_version:
                return current
            if accepts.exact_version < current:
                raise VersionUnreachable(current, f"exactly version {accepts.exact_version}")
            return await self._catch_up(accepts.exact_version, f"exactly version {accepts.exact_version}", wait_for_log)
        target = accepts.min_version if accepts.min_version is not None else current
        staleness = accepts.max_staleness if accepts.max_staleness is not None else max_staleness
        if staleness is not None:
            head = await chain_head(self.log, self.run_id)
            if head is not None:
                target = max(target, head.version - staleness)
        if current >= target:
            return current
        return await self._catch_up(target, f"version >= {target}", wait_for_log)

    async def _catch_up(self, version: int, wanted: str, wait_for_log: bool) -> int:
        if not wait_for_log:
            head = await chain_head(self.log, self.run_id)
            if head is None or head.version < version:
                raise VersionUnreachable(self.version, wanted)
        try:
            return await self.commit(version)
        except (VersionNotAvailable, VersionUnbuildable) as exc:
            raise VersionUnreachable(self.version, wanted) from exc

    async def _wait_for_any(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        while self.version is None:
            head = await chain_head(self.log, self.run_id)
            if head is not None:
                await self.advance(head.version)  # may serve nothing yet: the caller says why
                return
            if time.monotonic() > deadline:
                raise VersionUnreachable(None, "any version (the chain is empty)")
            await asyncio.sleep(0.25)
