"""Materializing a policy version: exact served bits on local disk, in HF layout, verified.

`Materializer.materialize(version)` plans the cheapest way there (a cached version or the nearest
keyframe, then patches or skip-patches), builds it, checks it against the version event's digests,
and renames the finished directory into place: the version served before is untouched until the new
one is complete. A file lock serializes processes sharing a cache, so two samplers on one host
neither corrupt it nor download twice.

Proportional to the patch: a version directory is a recyclable slot (`pipeline/version_slots.py`).
To build version N from a cached version that nobody serves (not `current`, not pinned by an engine),
that directory is renamed to a staging name and the route's patches are written into its shards in
place, at the changed positions only (`pipeline/shard_patch.py`, `pipeline/safetensors_layout.py`: the
header does not move for a patch that keeps shapes and dtypes). Two directories then take turns
(A/B): the one served, and the standby that catches up two versions at a time, reading the older
patch from the local patch store (`pipeline/patch_store.py`) instead of downloading it again. Where
the only start is protected, it is copied once (the second slot's creation). A keyframe start
downloads its shards straight into the staging directory. A shard whose layout a patch changes is
rewritten whole (the old path).

The planner minimizes cost in bytes: bytes to download, plus bytes to copy locally (a protected
start, weighted by LOCAL_COPY_COST); a recycled start and a patch blob already on disk cost nothing.

Durability by verification, not fsync: nothing is fsynced (a killed process leaves the page cache
intact; power loss can tear pages, and so can a process killed mid-build, whose `.tmp-*` staging
directory is never served and is removed by the next build). Instead a version directory is hashed
against its event's digests the first time this process uses it, as a start or from the cache, and
trusted afterwards while its manifest's `generation` and its files' inode metadata (`directory_fingerprint`:
a write into a file by anyone, a file replaced or linked, changes it) are unchanged; a torn, tampered or half-applied
directory is logged as an error, removed and rebuilt, never served.

Hashing only what changed: a patch's header names each tensor's base and target checksums. They are
compared with the version events' digests (a disagreement refuses the patch before a byte is
written), and the codec checks each target it produces against the header; a tensor the route never
changes keeps its verified digest. `written_bytes` (what the build made the kernel write) and
`changed_tensor_bytes` (the bytes of the tensors that differ from the start) say what a version cost.

`materialize_newest(version, above=...)` is what a following island asks for: that
version if any route to it works, otherwise the newest older version that can be built and verified.
One bad patch then costs an island its newest versions, not its ability to serve.

Failure handling: a blob that fails its sha256 is fetched once more; then that part
of the route (a patch, a skip patch, a keyframe, or a version whose own files
disagree) is set aside and the plan recomputed around it (a skip patch, the
keyframe path, an older keyframe). A set-aside part stays out of every plan for an
exponential, capped, jittered backoff (`RouteFailures`) and is then tried again, so
a re-published blob is picked up, and a bad one is never re-downloaded in a hot
loop however often the island is woken. A missing blob is named by key; a base
whose bits differ from what a patch expects is refused; a version not yet in the
log is waited for, never guessed. Blobs are all fetched before a slot is touched, so a corrupt
patch never costs the standby slot.

Trust: given a `VersionTrust` (an island always passes one), every version event is
verified (`pipeline/version_signing.py`) the moment it is read, before any field of it
is used. A refused event is never planned through: not as a target, not as a base, not
from the cache. A blob that still differs from its signed digest after a refetch is
refused as well (and set aside like any failed part). Each refusal is logged as an
error once and kept in `refusals`, which the island counts and dead-letters.
"""

from __future__ import annotations

import asyncio
import fcntl
import math
import os
import shutil
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from pipeline import patch_codec
from pipeline.bits import bits_dtype, checksum, dtype_name, root_hash, to_bits
from pipeline.blobstore import BlobStore
from pipeline.config import MaterializeSettings
from pipeline.errors import BlobIntegrityError, BlobNotFound, BlobTooLarge, SprawlError
from pipeline.eventlog import EventLog
from pipeline.keyframe import read_weight_map
from pipeline.logs import get_logger
from pipeline.patch_store import PatchStore
from pipeline.route_failures import Backoff, PartKey, RouteFailures
from pipeline.safetensors_layout import ShardLayout, ShardLayoutError, hash_shard, read_layout
from pipeline.shard_patch import PatchStep, StepFailed, WrongBits, patch_shard
from pipeline.subjects import token
from pipeline.version_log import wait_for_version
from pipeline.version_signing import VersionSignatureInvalid, VersionTrust
from pipeline.version_slots import (
    IN_USE_FILE,
    MANIFEST_FILE,
    VersionPin,
    claim,
    copy_version_files,
    directory_bytes,
    directory_fingerprint,
    in_use,
    process_written_bytes,
    read_manifest,
    remove_directory,
    remove_leftovers,
    write_manifest,
)
from schemas import BlobPointer, PolicyVersion, ViewVersion

log = get_logger(__name__)

MAX_WALK_BACK = 64
"""How far below the nearest keyframe a cached version may be and still be worth walking up from."""
LOCAL_COPY_COST = 0.5
"""What a byte copied on local disk costs the planner, in downloaded bytes: less than a download even
on loopback (no network stack, no hashing), so a protected start is copied rather than its keyframe
fetched again, but never free, so a recyclable slot always wins."""


class MaterializeError(SprawlError):
    pass


class LocalDiskError(MaterializeError):
    """Writing or reading the cache on local disk failed (a full disk, a file size limit, permissions):
    the build is dropped, the version served is untouched, and the caller retries later."""

    def __init__(self, version: int, root: Path, error: OSError):
        self.version, self.error = version, error
        super().__init__(
            f"building version {version} failed on local disk under {root}: {error}",
            hint="check the free space and permissions of `materialize.cache_dir` (fewer `keep_versions` "
            "needs less room); the version served is untouched and the build is retried",
        )


class VersionUnbuildable(MaterializeError):
    """No route to the wanted version works now (and, for `materialize_newest`, none to any version
    newer than the one served). Not final: set-aside parts are retried after their backoff."""

    def __init__(self, version: int, view: str, reasons: list[str], retry_in_s: float | None):
        self.version, self.reasons, self.retry_in_s = version, reasons, retry_in_s
        detail = "; ".join(dict.fromkeys(reasons)) or "nothing was tried"
        retry = "" if retry_in_s is None else f" (next retry in {retry_in_s:.1f}s)"
        super().__init__(
            f"no usable route to version {version} of view {view!r}: {detail}",
            hint=f"keep serving the last good version; failed parts are retried with backoff{retry}",
        )


class VersionRefused(VersionUnbuildable):
    """The exact version asked for was refused (its signature, or a blob against its signed digest)."""


@dataclass(frozen=True)
class Refusal:
    """One thing an island refused: a version event (`what` = "signature") or a blob of it (its uri)."""

    version: int
    event_id: str
    what: str
    reason: str
    error_class: str
    """`version_signature_invalid` or `blob_digest_mismatch`: the dead letter's error class."""


class Refusals:
    """What this materializer refused, each once (however often it is met again), and which of them
    the island has yet to report. Thread-safe: blobs are refused in the planning thread."""

    def __init__(self):
        self._seen: dict[tuple[int, str, str], Refusal] = {}
        self._unreported: list[Refusal] = []
        self._lock = threading.Lock()

    def record(self, refusal: Refusal) -> bool:
        """Keep `refusal`; False when the same one was already kept (nothing is logged or counted twice)."""
        key = (refusal.version, refusal.event_id, refusal.what)
        with self._lock:
            if key in self._seen:
                return False
            self._seen[key] = refusal
            self._unreported.append(refusal)
        log.error(
            "policy version refused: not served",
            version=refusal.version,
            event_id=refusal.event_id,
            refused=refusal.what,
            reason=refusal.reason,
        )
        return True

    @property
    def total(self) -> int:
        with self._lock:
            return len(self._seen)

    def unreported(self) -> list[Refusal]:
        with self._lock:
            return list(self._unreported)

    def reported(self, refusal: Refusal) -> None:
        with self._lock:
            if refusal in self._unreported:  # two reporters may have raced to the same dead letter
                self._unreported.remove(refusal)

    def reasons(self, lowest: int, highest: int) -> list[str]:
        with self._lock:
            found = [r for r in self._seen.values() if lowest <= r.version <= highest]
        return [f"v{r.version} refused: {r.reason}" for r in found]


@dataclass(frozen=True)
class Materialized:
    version: int
    view: str
    path: Path
    root_hash: str
    downloaded_bytes: int
    route: str
    """How it got there, e.g. `cache:v3 -> patch:v4 -> skip:v8`."""
    written_bytes: int = 0
    """Bytes this build made the kernel write to local disk (page-cache pages it dirtied, downloads
    included; /proc/self/io `write_bytes`): a page dirtied again before writeback counts once."""
    changed_tensor_bytes: int = 0
    """Bytes of the tensors whose digest differs between the start and this version (every tensor's
    for a keyframe start): what a build proportional to the change has to write."""
    slot: str = ""
    """Which directory it was built in: `cached` (served as it was), `new`, `recycled v<N>`, `copy of v<N>`."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Where the build's time went, phase by phase: `fetch` (blobs), `stage` (a slot made ready), `apply`
    (patches written in place), `finish` (hashes checked, renamed, `current` switched). Empty when the
    version was served from the cache as it was."""
    pin: VersionPin | None = field(default=None, compare=False, repr=False)
    """Held when asked for (`pin=True`): the directory is not recycled until `release()`."""

    def release(self) -> None:
        """Let the directory be recycled (the engine has loaded a newer version)."""
        if self.pin is not None:
            self.pin.release()


@dataclass(frozen=True)
class _Edge:
    kind: str  # "patch" | "skip"
    base: int
    target: int
    blobs: tuple[BlobPointer, ...]
    bytes: int

    @property
    def key(self) -> PartKey:
        return (self.kind, self.base, self.target)


class _EdgeFailed(Exception):
    """A part of the route failed: an edge, a start (keyframe or cache), or (both None) the target's own
    files. `blob` names the blob at fault, if one is."""

    def __init__(self, edge: _Edge | None, start: tuple[str, int] | None, reason: str, blob: str = ""):
        self.edge, self.start, self.reason, self.blob = edge, start, reason, blob
        super().__init__(reason)


_Option = tuple[int, "tuple[str, int] | None", "_Edge | None"]
"""(bytes to download, start, edge): how the planner reaches one version."""


class Materializer:
    def __init__(
        self,
        event_log: EventLog,
        blobs: BlobStore,
        *,
        run_id: str,
        view: str,
        settings: MaterializeSettings,
        retry: Backoff | None = None,
        trust: VersionTrust | None = None,
    ):
        """`trust`: verify every version event with it. None trusts whatever the log holds: for tools
        and tests that publish their own chain; islands always pass one (`island_trust`)."""
        self.log = event_log
        self.blobs = blobs
        self.run_id = token(run_id, "run_id")
        self.view = view
        self.settings = settings
        self.root = settings.cache_dir.resolve() / self.run_id / view
        self.root.mkdir(parents=True, exist_ok=True)
        self.failures = RouteFailures(retry or Backoff())
        """What failed, kept across calls: a part set aside here is not downloaded again until its
        backoff has passed, however often the materializer is asked."""
        self.trust = trust
        self.refusals = Refusals()
        self._events: dict[int, PolicyVersion] = {}
        """Verified events only: nothing else is ever planned with."""
        self._refused: dict[int, PolicyVersion] = {}
        self.patches = PatchStore(self.root)
        self._trusted: dict[int, tuple[str, tuple]] = {}
        """Version -> (manifest generation, `directory_fingerprint`) of directories this process built or
        hashed: not hashed again while both are the same."""
        self._threads: ThreadPoolExecutor | None = None

    # ---------------------------------------------------------------- public

    def known_event(self, version: int) -> PolicyVersion | None:
        """The version's event, if this materializer has already read it from the log."""
        return self._events.get(version)

    def view_entry(self, event: PolicyVersion) -> ViewVersion:
        """This materializer's view in a version event."""
        return self._view_of(event)

    def cached_versions(self) -> list[int]:
        return sorted(
            int(p.name[1:]) for p in self.root.glob("v*") if p.name[1:].isdigit() and (p / MANIFEST_FILE).exists()
        )

    def path_of(self, version: int) -> Path:
        return self.root / f"v{version:08d}"

    def current(self) -> Path | None:
        link = self.root / "current"
        return link.resolve() if link.exists() else None

    async def materialize(self, version: int, *, pin: bool = False) -> Materialized:
        """Exactly `version`, or VersionUnbuildable naming why no route to it works now.

        `pin`: return it pinned (`Materialized.pin`), so no materializer recycles its directory while an
        engine loads or serves it; the caller releases the pin once it has loaded a newer version."""
        return await self._materialize(version, newest=False, above=None, pin=pin)

    async def materialize_newest(self, version: int, *, above: int | None = None, pin: bool = False) -> Materialized:
        """`version` if a route to it works; otherwise the newest older version, newer than `above` (the
        one already served), that can be built and verified. VersionUnbuildable when there is none."""
        return await self._materialize(version, newest=True, above=above, pin=pin)

    async def _materialize(self, version: int, *, newest: bool, above: int | None, pin: bool) -> Materialized:
        event = await self._event(version)
        if event is None and not newest:
            raise VersionRefused(version, self.view, self.refusals.reasons(version, version), None)
        if event is not None:
            self._view_of(event)
        lowest = await self._gather_events(version)
        while True:
            try:
                return await asyncio.to_thread(self._materialize_locked, version, lowest, newest, above, pin)
            except VersionUnbuildable:
                # Nothing from the nearest keyframe up can be built (its own blob may be the bad one): an
                # older keyframe still reaches the versions before it.
                if not newest or lowest == 0 or (above is not None and lowest <= above):
                    raise
                lowest = await self._gather_events(lowest - 1)

    # ---------------------------------------------------------------- events

    async def _event(self, version: int) -> PolicyVersion | None:
        """The version's event once verified; None when it was refused (its log entry never changes:
        versions are create-only, so a refused event is not read or checked again)."""
        if version in self._refused:
            return None
        if version not in self._events:
            event = await wait_for_version(self.log, self.run_id, version, self.settings.wait_for_version_s)
            if self.trust is not None:
                try:
                    self.trust.check(event)
                except VersionSignatureInvalid as exc:
                    self._refused[version] = event
                    self.refusals.record(
                        Refusal(version, event.event_id, "signature", exc.reason, "version_signature_invalid")
                    )
                    return None
            self._events[version] = event
        return self._events[version]

    def _view_of(self, event: PolicyVersion) -> ViewVersion:
        for entry in event.views:
            if entry.view == self.view:
                return entry
        raise MaterializeError(
            f"version {event.version} has no {self.view!r} view (it has {', '.join(v.view for v in event.views)})",
            hint="serve a view the trainer publishes, or add this one to the trainer's `chain.views`",
        )

    async def _gather_events(self, version: int) -> int:
        """Fetch events down to the nearest keyframe (and a little further when a cached version is
        close below it); returns the lowest version the planner may start from."""
        cached = set(self.cached_versions())
        v = version
        # Always down to the nearest keyframe: it is the fallback when a patch route breaks. A refused
        # version says nothing trustworthy about its kind: walk past it (the planner never uses it).
        while v > 0:
            event = await self._event(v)
            if event is not None and self._view_of(event).kind == "keyframe":
                break
            v -= 1
        await self._event(v)
        lowest = v
        # Cached versions just below it too: the standby slot (A/B) may sit there, a version or two older
        # than the one served, and catching it up is cheaper than a keyframe.
        below = [c for c in cached if lowest - MAX_WALK_BACK <= c < lowest]
        if below:
            for w in range(min(below), lowest):
                await self._event(w)
            lowest = min(below)
        return lowest

    # ---------------------------------------------------------------- planning

    def _local_state(self) -> _LocalState:
        cached = set(self.cached_versions())
        current = self._current_version()
        protected = {v for v in cached if v == current or in_use(self.path_of(v))}
        return _LocalState(cached, protected, {v: directory_bytes(self.path_of(v)) for v in protected})

    def _edge_cost(self, edge: _Edge) -> int:
        return sum(b.bytes for b in edge.blobs if not self.patches.has(b))

    def _reachable(
        self,
        lowest: int,
        version: int,
        tried: set[PartKey],
        bad_starts: set[tuple[str, int]],
        local: _LocalState,
    ) -> dict[int, _Option]:
        """The cheapest known way to each version in [lowest, version] that no failure rules out."""

        def usable(key: PartKey) -> bool:
            return key not in tried and self.failures.usable(key)

        best: dict[int, _Option] = {}
        for v in range(lowest, version + 1):
            if v not in self._events or not usable(("version", v)):
                continue  # refused (or never read): not a target, not a base, not even from the cache
            entry = self._view_of(self._events[v])
            options: list[_Option] = []
            if v in local.cached and ("cache", v) not in bad_starts and self._cache_is(v):
                # As a start: recycled for nothing, or copied when someone serves it. (As the target itself
                # it is served as it is: `_materialize_locked` looks for that first.)
                options.append((local.copy_bytes.get(v, 0) * LOCAL_COPY_COST, ("cache", v), None))
            if entry.kind == "keyframe" and usable(("keyframe", v)):
                options.append((entry.bytes, ("keyframe", v), None))
            edges = []
            if entry.kind == "patch" and entry.base_version is not None:
                edges.append(_Edge("patch", entry.base_version, v, tuple(entry.blobs), entry.bytes))
            edges += [_Edge("skip", s.base_version, v, tuple(s.blobs), s.bytes) for s in entry.skip_patches]
            for edge in edges:
                if edge.base in best and usable(edge.key):
                    options.append((best[edge.base][0] + self._edge_cost(edge), None, edge))
            if options:
                best[v] = min(options, key=lambda o: o[0])
        return best

    @staticmethod
    def _route(best: dict[int, _Option], version: int) -> tuple[tuple[str, int], list[_Edge]]:
        edges: list[_Edge] = []
        v = version
        while best[v][2] is not None:
            edge = best[v][2]
            assert edge is not None
            edges.append(edge)
            v = edge.base
        start = best[v][1]
        assert start is not None
        return start, list(reversed(edges))

    # ---------------------------------------------------------------- execution (thread)

    def _materialize_locked(
        self, version: int, lowest: int, newest: bool, above: int | None, pin: bool
    ) -> Materialized:
        with open(self.root / ".lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            remove_leftovers(self.root)  # of a process killed mid-build: we hold the lock, so none is live
            tried: set[PartKey] = set()  # failed in this call: not tried again in it, whatever its backoff
            bad_starts: set[tuple[str, int]] = set()
            local_reasons: list[str] = []  # failures of this cache, which `self.failures` does not keep
            while True:
                local = self._local_state()
                best = self._reachable(lowest, version, tried, bad_starts, local)
                target = version if version in best else None
                if target is None and newest:
                    target = max((v for v in best if above is None or v > above), default=None)
                if target is None:
                    raise VersionUnbuildable(
                        version,
                        self.view,
                        self.refusals.reasons(lowest, version) + self.failures.reasons(lowest, version) + local_reasons,
                        self.failures.retry_in_s(lowest, version),
                    )
                try:
                    if target in local.cached and ("cache", target) not in bad_starts and self._cache_is(target):
                        result = self._cached(target)  # served as it is, whatever a rebuild would cost
                    else:
                        start, edges = self._route(best, target)
                        result = self._execute(target, start, edges, local)
                        for part in [start, *(edge.key for edge in edges), ("version", target)]:
                            self.failures.cleared(part)
                except _EdgeFailed as exc:
                    if not self._set_aside(target, exc, tried, bad_starts):
                        local_reasons.append(exc.reason)
                    continue
                self._point_current(result.path)
                self._collect_garbage(keep_also=target)
                # Pinned before the cache lock is let go: no other materializer can recycle it in between.
                return replace(result, pin=VersionPin.take(result.path)) if pin else result

    def _current_version(self) -> int | None:
        current = self.current()
        if current is None or not current.name.startswith("v") or not current.name[1:].isdigit():
            return None
        return int(current.name[1:])

    def _cache_is(self, version: int) -> bool:
        """Is the cached v<N> the bits of the (verified) event this log holds for v<N>? A cache folder
        outlives its run: another stack's run with the same id, or a chain forged through a bad token,
        leaves versions under the same numbers, and serving them would serve bits nobody signed here."""
        event = self._events[version]
        manifest = read_manifest(self.path_of(version))
        if manifest is None:
            return False
        root_hash = self._view_of(event).root_hash
        if manifest.get("event_id") == event.event_id and manifest.get("root_hash") == root_hash:
            return True
        log.error(
            "cached version is not this log's version: removed, rebuilt from the log",
            version=version,
            cached_event_id=manifest.get("event_id"),
            event_id=event.event_id,
            path=str(self.path_of(version)),
        )
        # Out of the way first (a rename is atomic), so the rebuilt version can take its name.
        remove_directory(self.root, self.path_of(version), "foreign")
        self._trusted.pop(version, None)
        return False

    def _ensure_verified(self, version: int) -> bool:
        """Hash a cached version against its event unless this process already did (same generation, and
        no file of it written, replaced or linked since). Returns whether it hashed; a directory that does
        not match is removed and `_EdgeFailed` raised for it as a start (checked afresh on the next call,
        rebuilt meanwhile)."""
        path = self.path_of(version)
        manifest = read_manifest(path) or {}
        generation = manifest.get("generation")
        try:
            # Taken before hashing: a write while the files are hashed shows as a change next time.
            fingerprint = directory_fingerprint(path)
        except OSError:
            fingerprint = None  # gone or unreadable: `_directory_problem` says what
        if generation is not None and self._trusted.get(version) == (generation, fingerprint):
            return False
        if self._trusted.pop(version, None) is not None:
            log.warning("a cached version changed since this process verified it: hashing it again", version=version)
        problem = self._directory_problem(path, self._view_of(self._events[version]))
        if problem is not None:
            log.error(
                "cached version does not hash to its version (torn by a crash, or altered): removed, never served",
                version=version,
                path=str(path),
                problem=problem,
            )
            remove_directory(self.root, path, "damaged")
            self._trusted.pop(version, None)
            raise _EdgeFailed(None, ("cache", version), f"cached v{version} is damaged: {problem}")
        if generation is None:  # written before generations existed: give it one, to be trusted from now on
            generation = write_manifest(path, manifest)
        self._trusted[version] = (generation, fingerprint)
        return True

    def _directory_problem(self, path: Path, entry: ViewVersion) -> str | None:
        """What is wrong with a directory's tensors against a version's digests, or None (every tensor
        hashed: the directory then has exactly the version's root hash)."""
        expected = {t.name: t for t in entry.tensors}
        try:
            weight_map = read_weight_map(path)
            if set(weight_map) != set(expected):
                return f"its index names {sorted(set(weight_map) ^ set(expected))[:3]} unexpectedly"
            problem = _shard_names_problem(set(weight_map.values()))
            if problem is not None:
                return problem
            for shard in sorted(set(weight_map.values())):
                layout = read_layout(path / shard)
                problem = _layout_problem(layout, weight_map, expected)
                if problem is not None:
                    return problem
                for name, digest in hash_shard(layout).items():
                    if digest != expected[name].xxh3:
                        return f"tensor {name} hashes to {digest}, the version says {expected[name].xxh3}"
        except (OSError, ValueError, KeyError, ShardLayoutError) as exc:
            return f"unreadable ({exc})"
        return None

    def _cached(self, version: int) -> Materialized:
        self._ensure_verified(version)
        done = self.path_of(version)
        manifest = read_manifest(done) or {}
        return Materialized(
            version, self.view, done, manifest.get("root_hash", ""), 0, f"cache:v{version}", slot="cached"
        )

    def _set_aside(self, target: int, exc: _EdgeFailed, tried: set[PartKey], bad_starts: set) -> bool:
        """Keep the failed part out of this call's plans and, for remote parts, out of later calls'
        until its backoff has passed (a bad local cache entry is checked afresh next time). Returns
        whether a remote part was recorded."""
        parts: list[PartKey] = []
        if exc.edge is not None:
            parts.append(exc.edge.key)
        if exc.start is not None:
            if exc.start[0] == "cache":
                bad_starts.add(exc.start)
            else:
                parts.append(exc.start)
        if exc.edge is None and exc.start is None:
            parts.append(("version", target))
        for part in parts:
            tried.add(part)
            failure = self.failures.record(part, blob=exc.blob, reason=exc.reason)
            log.warning(
                "route part failed; set aside and retried after a backoff",
                version=target,
                part=failure.part,
                blob=exc.blob,
                reason=exc.reason,
                failures=failure.failures,
                retry_in_s=round(failure.delay_s, 3),
            )
        return bool(parts)

    def _execute(self, version: int, start: tuple[str, int], edges: list[_Edge], local: _LocalState) -> Materialized:
        written_before = process_written_bytes()
        clock = _Phases()
        # Every blob first, and every shard covered: a corrupt, missing or incomplete patch fails here,
        # before any slot is taken apart.
        try:
            self._check_coverage(start, edges)
            fetched = self._fetch_patches(edges)
            clock.lap("fetch")
            build = self._stage(version, start, local)
            build.fetched += fetched
            clock.lap("stage")
            try:
                self._apply_route(build, edges)
                clock.lap("apply")
                self._finish(build, version, edges)
                clock.lap("finish")
            except BaseException:
                # Cleanup, then re-raise whatever it was (a failed edge, an outage, a cancellation): a
                # half-built staging directory must not outlive any failure. Nothing is swallowed here.
                shutil.rmtree(build.staging, ignore_errors=True)
                raise
        except OSError as exc:
            # Not the route's fault (nothing is set aside): the disk's. Said as such, with what to do.
            log.error("building a version failed on local disk", version=version, error=repr(exc))
            raise LocalDiskError(version, self.root, exc) from exc
        written_after = process_written_bytes()
        if written_before is not None and written_after is not None:
            written = written_after - written_before
        else:
            written = build.fetched + build.written_estimate  # no kernel accounting here: what we wrote
        target_entry = self._view_of(self._events[version])
        changed = _changed_bytes(
            target_entry, None if start[0] == "keyframe" else self._view_of(self._events[start[1]])
        )
        route = " -> ".join([f"{start[0]}:v{start[1]}", *(f"{e.kind}:v{e.target}" for e in edges)])
        log.info(
            "materialized",
            version=version,
            view=self.view,
            route=route,
            slot=build.slot,
            downloaded_bytes=build.fetched,
            written_bytes=written,
            changed_tensor_bytes=changed,
            seconds=clock.seconds,
        )
        return Materialized(
            version,
            self.view,
            self.path_of(version),
            target_entry.root_hash,
            build.fetched,
            route,
            written_bytes=written,
            changed_tensor_bytes=changed,
            slot=build.slot,
            seconds=dict(clock.seconds),
        )

    def _check_coverage(self, start: tuple[str, int], edges: list[_Edge]) -> None:
        """Every edge has a patch for every shard of the start (patches are cut along its shards)."""
        if not edges:
            return
        kind, version = start
        if kind == "keyframe":
            shards = {b.name for b in self._view_of(self._events[version]).blobs if b.name.endswith(".safetensors")}
        else:
            try:
                shards = set(read_weight_map(self.path_of(version)).values())
            except (OSError, ValueError, KeyError) as exc:
                raise _EdgeFailed(None, start, f"cached v{version} has no readable index ({exc})") from exc
            problem = _shard_names_problem(shards)
            if problem is not None:  # the cache entry's fault, not the (signed) patches'
                log.error(
                    "cached version's index is not its own: removed, never used", version=version, problem=problem
                )
                remove_directory(self.root, self.path_of(version), "damaged")
                self._trusted.pop(version, None)
                raise _EdgeFailed(None, start, f"cached v{version} is damaged: {problem}")
        for edge in edges:
            missing = shards - {b.name for b in edge.blobs}
            if missing:
                raise _EdgeFailed(
                    edge, None, f"{edge.kind} v{edge.base}->v{edge.target} has no patch for shard {min(missing)}"
                )

    def _fetch_patches(self, edges: list[_Edge]) -> int:
        """Every patch blob of the route into the local patch store; returns the bytes downloaded."""
        fetched = 0
        for edge in edges:
            for blob in edge.blobs:
                if not self.patches.usable(blob):
                    fetched += self._download(blob, self.patches.path(blob), edge, None)
                    self.patches.downloaded(blob)
        return fetched

    def _stage(self, version: int, start: tuple[str, int], local: _LocalState) -> _Build:
        """A staging directory holding the start's bits, and what is known of them."""
        kind, start_version = start
        entry = self._view_of(self._events[start_version])
        digests = {t.name: t.xxh3 for t in entry.tensors}
        staging = self.root / f".tmp-v{version}-{uuid.uuid4().hex[:8]}"
        if kind == "keyframe":
            staging.mkdir()
            build = _Build(staging, start, digests, set(), "new")
            try:
                for blob in entry.blobs:
                    build.fetched += self._download(blob, staging / blob.name, None, start)
                problem = self._directory_problem(staging, entry)
                if problem is not None:
                    raise _EdgeFailed(None, start, f"keyframe v{start_version} does not match its version: {problem}")
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            return build
        source = self.path_of(start_version)
        hashed = self._ensure_verified(start_version)
        # Bits this process trusts without hashing them in this call: a target that comes out wrong from
        # one of them is blamed on the cache, not on the (signed, verified) patch.
        suspect = set() if hashed else set(digests)
        claimed = None if start_version in local.protected else claim(source)
        if claimed is not None:
            try:
                os.rename(source, staging)  # from here on no cached version: a crash leaves only a .tmp-*
            finally:
                os.close(claimed)
            self._trusted.pop(start_version, None)
            (staging / MANIFEST_FILE).unlink(missing_ok=True)
            return _Build(staging, start, digests, suspect, f"recycled v{start_version}")
        staging.mkdir()
        try:
            copy_version_files(source, staging)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        build = _Build(staging, start, digests, suspect, f"copy of v{start_version}")
        build.written_estimate += directory_bytes(staging)
        return build

    def _apply_route(self, build: _Build, edges: list[_Edge]) -> None:
        if not edges:
            return
        shards = sorted(set(read_weight_map(build.staging).values()))
        by_shard = {edge: {b.name: b for b in edge.blobs} for edge in edges}  # every shard: `_check_coverage`
        for shard in shards:
            self._patch_shard(build, shard, [(edge, by_shard[edge][shard]) for edge in edges])

    def _patch_shard(self, build: _Build, shard: str, patches: list[tuple[_Edge, BlobPointer]]) -> None:
        """Apply the route's patches to one shard (`pipeline/shard_patch.py`), blaming what failed."""
        steps = []
        for edge, blob in patches:
            label = f"{edge.kind} v{edge.base}->v{edge.target}"
            try:
                header, payload = patch_codec.read_header(self.patches.read(blob))
            except patch_codec.PatchFormatError as exc:
                self.patches.forget(blob)
                raise _EdgeFailed(edge, None, f"patch {blob.uri} is unreadable: {exc.message}", blob.uri) from exc
            wanted = {t.name: t.xxh3 for t in self._view_of(self._events[edge.target]).tensors}
            steps.append(PatchStep(label, header, payload, wanted))
        try:
            patched = patch_shard(build.staging / shard, steps, build.digests, self._pool())
        except ShardLayoutError as exc:
            raise _EdgeFailed(None, build.start, exc.message) from exc
        except WrongBits as exc:
            edge, blob = patches[exc.step]
            if exc.from_start and exc.tensor in build.suspect:
                # These bits came from a cached version this process trusted without hashing it now: suspect
                # the disk before a signed patch. The cache entry's trust is dropped; the plan is made again.
                self._trusted.pop(build.start[1], None)
                raise _EdgeFailed(
                    None, build.start, f"cached v{build.start[1]} gave wrong bits for {exc.tensor}: {exc.message}"
                ) from exc
            self.patches.forget(blob)
            raise _EdgeFailed(edge, None, exc.message, blob.uri) from exc
        except StepFailed as exc:
            edge, blob = patches[exc.step]
            self.patches.forget(blob)  # the local copy may be what is wrong: never applied again as it is
            raise _EdgeFailed(edge, None, exc.message, blob.uri) from exc
        build.suspect -= patched.changed
        build.written_estimate += patched.touched_bytes

    def _finish(self, build: _Build, version: int, edges: list[_Edge]) -> None:
        """Check the staged bits are the version's (its root hash, from the digests the route verified),
        write the manifest and rename the directory into place."""
        entry = self._view_of(self._events[version])
        expected = {t.name: t for t in entry.tensors}
        blame = (edges[-1], None) if edges else (None, build.start)
        weight_map = read_weight_map(build.staging)
        if set(weight_map) != set(expected):
            raise _EdgeFailed(None, None, f"v{version} index names {sorted(set(weight_map) ^ set(expected))[:3]}")
        entries = []
        for shard in sorted(set(weight_map.values())):
            try:
                layout = read_layout(build.staging / shard)
            except ShardLayoutError as exc:
                raise _EdgeFailed(*blame, exc.message) from exc
            problem = _layout_problem(layout, weight_map, expected)
            if problem is not None:
                raise _EdgeFailed(*blame, f"v{version}: {problem}")
            for name, span in layout.tensors.items():
                if build.digests[name] != expected[name].xxh3:
                    # never served: the staging directory is dropped and the route replanned without it
                    raise _EdgeFailed(
                        *blame,
                        f"v{version} tensor {name} is {build.digests[name]}, the version says {expected[name].xxh3}",
                    )
                entries.append((name, span.dtype, span.shape, build.digests[name]))
        if root_hash(entries) != entry.root_hash:
            raise _EdgeFailed(None, None, f"v{version}'s tensors do not give its root hash {entry.root_hash}")
        (build.staging / IN_USE_FILE).touch()
        generation = write_manifest(
            build.staging,
            {
                "run_id": self.run_id,
                "version": version,
                "view": self.view,
                "root_hash": entry.root_hash,
                # Which event these bits are: a cache entry is served only for that very event.
                "event_id": self._events[version].event_id,
                "tensors": {t.name: t.xxh3 for t in entry.tensors},
            },
        )
        final = self.path_of(version)
        if final.exists():  # a directory under this name that is no usable version (no manifest, damaged)
            remove_directory(self.root, final, "trash")
        os.rename(build.staging, final)  # atomic: a version directory is complete or absent
        self._trusted[version] = (generation, directory_fingerprint(final))

    def _pool(self) -> ThreadPoolExecutor:
        """Threads for a patch's groups (disjoint tensors): the codec's kernels release the GIL."""
        if self._threads is None:
            self._threads = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="apply")
        return self._threads

    def _download(self, blob: BlobPointer, path: Path, edge: _Edge | None, start: tuple[str, int] | None) -> int:
        """Fetch and verify one blob; a checksum failure is retried once (a transfer can go wrong), then
        the part is given up (and set aside with backoff by the caller)."""
        for attempt in (1, 2):
            try:
                # No more than the pointer says (the blob whose digest is signed has that length): a swapped
                # blob cannot fill the disk before its checksum fails.
                ref = self.blobs.get_to_file(blob.uri, path, expected=blob.sha256, max_bytes=blob.bytes)
                return ref.bytes
            except BlobIntegrityError as exc:
                if attempt == 2:
                    if isinstance(exc, BlobTooLarge):
                        reason = f"{blob.uri} is larger than the {blob.bytes} bytes its version names, after a refetch"
                    else:
                        reason = f"{blob.uri} is corrupt after a refetch (sha256 {exc.actual}, expected {exc.expected})"
                    self._refuse_blob(blob, edge, start, reason)
                    raise _EdgeFailed(edge, start, reason, blob.uri) from exc
                log.warning("blob failed verification, refetching once", uri=blob.uri)
            except BlobNotFound as exc:
                raise _EdgeFailed(edge, start, f"missing blob {blob.uri}", blob.uri) from exc
        raise AssertionError("unreachable")

    def _refuse_blob(self, blob: BlobPointer, edge: _Edge | None, start: tuple[str, int] | None, reason: str) -> None:
        """A blob that differs from the digest its (verified) version names: refused like a forged event,
        while the part stays set aside and is retried after its backoff (an operator may re-publish it)."""
        version = edge.target if edge is not None else start[1] if start is not None else None
        event = self._events.get(version) if version is not None else None
        if event is not None:
            self.refusals.record(Refusal(event.version, event.event_id, blob.uri, reason, "blob_digest_mismatch"))

    # ---------------------------------------------------------------- switch and clean up

    def _point_current(self, path: Path) -> None:
        link = self.root / "current"
        tmp = self.root / f".current-{uuid.uuid4().hex}"
        os.symlink(path.name, tmp)
        os.replace(tmp, link)  # atomic switch for readers that follow `current`

    def _collect_garbage(self, keep_also: int) -> None:
        """Versions beyond `keep_versions` (never `current`, the one just built, or one pinned by an
        engine), and patch blobs no kept version can use any more."""
        for path in self.root.glob("v*"):
            # A version directory without a manifest is no version (a power loss kept the rename but lost
            # the manifest): nothing plans with it, so nothing else would ever remove it.
            if path.name[1:].isdigit() and read_manifest(path) is None and path.is_dir() and not in_use(path):
                log.warning("removing a version directory that has no manifest", path=str(path))
                remove_directory(self.root, path, "damaged")
        versions = self.cached_versions()
        keep = set(versions[-self.settings.keep_versions :]) | {keep_also, self._current_version()}
        for v in versions:
            if v not in keep and not in_use(self.path_of(v)):
                remove_directory(self.root, self.path_of(v), "trash")
                self._trusted.pop(v, None)
        kept = self.cached_versions()
        lowest = min(kept, default=None)
        wanted: set[str] = set()
        for v, event in self._events.items():
            if lowest is None or v <= lowest:
                continue
            entry = self._view_of(event)
            if entry.kind == "patch" and entry.base_version is not None and entry.base_version >= lowest:
                wanted |= {b.sha256 for b in entry.blobs}
            for skip in entry.skip_patches:
                if skip.base_version >= lowest:
                    wanted |= {b.sha256 for b in skip.blobs}
        self.patches.keep_only(wanted)


class _Phases:
    """Seconds spent in each phase of a build (logged with "materialized": where a version's time goes)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = round(now - self._last, 4)
        self._last = now


@dataclass
class _LocalState:
    """What the cache holds when a plan is made (under the cache lock)."""

    cached: set[int]
    protected: set[int]
    """`current` and pinned versions: a start from one of these is copied, never recycled."""
    copy_bytes: dict[int, int]


@dataclass
class _Build:
    """A version being built in a staging directory."""

    staging: Path
    start: tuple[str, int]
    digests: dict[str, str]
    """Each tensor's xxh3 as the staged bits are now (verified, or trusted: see `suspect`)."""
    suspect: set[str]
    """Tensors whose bits come from a cached start this process trusted without hashing them now."""
    slot: str
    """How the directory came to be: `new`, `recycled v<N>`, `copy of v<N>`."""
    fetched: int = 0
    written_estimate: int = 0
    """Bytes written, counted by us: reported only where the kernel does not count them."""


def _shard_names_problem(shards: set[str]) -> str | None:
    """An index may only name files of its own directory: a shard named `../v7/...` would be hashed, and
    patched in place, in another version's directory."""
    outside = sorted(s for s in shards if not isinstance(s, str) or Path(s).name != s or s.startswith("."))
    return f"its index names shards outside its directory ({outside[:3]})" if outside else None


def _layout_problem(layout: ShardLayout, weight_map: dict[str, str], expected: dict) -> str | None:
    shard = layout.path.name
    wanted = {n for n, s in weight_map.items() if s == shard}
    if set(layout.tensors) != wanted:
        return f"shard {shard} holds {sorted(set(layout.tensors) ^ wanted)[:3]} unexpectedly"
    for name, span in layout.tensors.items():
        digest = expected[name]
        if span.dtype != digest.dtype or list(span.shape) != list(digest.shape):
            return f"tensor {name} is {span.shape} x {span.dtype}, the version says {digest.shape} x {digest.dtype}"
    return None


def _changed_bytes(target: ViewVersion, start: ViewVersion | None) -> int:
    """Bytes of the target's tensors whose digest differs from the start's (all of them without a start)."""
    before = {} if start is None else {t.name: t.xxh3 for t in start.tensors}
    return sum(
        math.prod(t.shape) * bits_dtype(t.dtype).itemsize for t in target.tensors if before.get(t.name) != t.xxh3
    )


def verify_directory(path: Path) -> str:
    """Recompute a materialized directory's root hash from its files (for audits and tests). Reads them
    with the safetensors library, independently of the in-place layout code."""
    from safetensors import safe_open

    entries = []
    for shard in sorted(set(read_weight_map(path).values())):
        with safe_open(str(path / shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                tensor = f.get_tensor(name)
                entries.append((name, dtype_name(tensor.dtype), tuple(tensor.shape), checksum(to_bits(tensor))))
    return root_hash(entries)
