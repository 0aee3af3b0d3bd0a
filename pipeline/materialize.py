"""Materializing a policy version: exact served bits on local disk, in HF layout, verified.

`Materializer.materialize(version)` plans the cheapest way there by bytes to
download (a cached version or the nearest keyframe, then patches or
skip-patches), applies it shard by shard (memory stays at one shard), checks
every tensor's xxh3-128 against the version event, and renames the finished
directory into place: the previous version is untouched until the new one is
complete. A file lock serializes processes sharing a cache, so two samplers on
one host neither corrupt it nor download twice.

`materialize_newest(version, above=...)` is what a following island asks for: that
version if any route to it works, otherwise the newest older version that can be
built and verified. One bad patch then costs an island its newest versions, not
its ability to serve.

Failure handling: a blob that fails its sha256 is fetched once more; then that part
of the route (a patch, a skip patch, a keyframe, or a version whose own files
disagree) is set aside and the plan recomputed around it (a skip patch, the
keyframe path, an older keyframe). A set-aside part stays out of every plan for an
exponential, capped, jittered backoff (`RouteFailures`) and is then tried again, so
a re-published blob is picked up, and a bad one is never re-downloaded in a hot
loop however often the island is woken. A missing blob is named by key; a base
whose bits differ from what a patch expects is refused; a version not yet in the
log is waited for, never guessed.

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
import json
import os
import shutil
import tempfile
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline import patch_codec
from pipeline.bits import checksum, dtype_name, root_hash, to_bits
from pipeline.blobstore import BlobStore
from pipeline.config import MaterializeSettings
from pipeline.errors import BlobIntegrityError, BlobNotFound, SprawlError
from pipeline.eventlog import EventLog
from pipeline.keyframe import CONFIG_FILE, INDEX_FILE, fsync_tree, load_shard, read_weight_map
from pipeline.logs import get_logger
from pipeline.route_failures import Backoff, PartKey, RouteFailures
from pipeline.subjects import token
from pipeline.version_log import wait_for_version
from pipeline.version_signing import VersionSignatureInvalid, VersionTrust
from schemas import BlobPointer, PolicyVersion, ViewVersion

log = get_logger(__name__)

MANIFEST_FILE = "sprawl-version.json"
MAX_WALK_BACK = 64
"""How far below the nearest keyframe a cached version may be and still be worth walking up from."""


class MaterializeError(SprawlError):
    pass


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

    # ---------------------------------------------------------------- public

    def known_event(self, version: int) -> PolicyVersion | None:
        """The version's event, if this materializer has already read it from the log."""
        return self._events.get(version)

    def view_entry(self, event: PolicyVersion) -> ViewVersion:
        """This materializer's view in a version event."""
        return self._view_of(event)

    def cached_versions(self) -> list[int]:
        return sorted(int(p.name[1:]) for p in self.root.glob("v*") if (p / MANIFEST_FILE).exists())

    def path_of(self, version: int) -> Path:
        return self.root / f"v{version:08d}"

    def current(self) -> Path | None:
        link = self.root / "current"
        return link.resolve() if link.exists() else None

    async def materialize(self, version: int) -> Materialized:
        """Exactly `version`, or VersionUnbuildable naming why no route to it works now."""
        return await self._materialize(version, newest=False, above=None)

    async def materialize_newest(self, version: int, *, above: int | None = None) -> Materialized:
        """`version` if a route to it works; otherwise the newest older version, newer than `above` (the
        one already served), that can be built and verified. VersionUnbuildable when there is none."""
        return await self._materialize(version, newest=True, above=above)

    async def _materialize(self, version: int, *, newest: bool, above: int | None) -> Materialized:
        event = await self._event(version)
        if event is None and not newest:
            raise VersionRefused(version, self.view, self.refusals.reasons(version, version), None)
        if event is not None:
            self._view_of(event)
        lowest = await self._gather_events(version)
        while True:
            try:
                return await asyncio.to_thread(self._materialize_locked, version, lowest, newest, above)
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
        below = [c for c in cached if lowest - MAX_WALK_BACK <= c < lowest]
        if below:
            for w in range(max(below), lowest):
                await self._event(w)
            lowest = max(below)
        return lowest

    # ---------------------------------------------------------------- planning

    def _reachable(
        self, lowest: int, version: int, tried: set[PartKey], bad_starts: set[tuple[str, int]]
    ) -> dict[int, _Option]:
        """The cheapest known way to each version in [lowest, version] that no failure rules out."""

        def usable(key: PartKey) -> bool:
            return key not in tried and self.failures.usable(key)

        cached = set(self.cached_versions())
        best: dict[int, _Option] = {}
        for v in range(lowest, version + 1):
            if v not in self._events or not usable(("version", v)):
                continue  # refused (or never read): not a target, not a base, not even from the cache
            entry = self._view_of(self._events[v])
            options: list[_Option] = []
            if v in cached and ("cache", v) not in bad_starts and self._cache_is(v):
                options.append((0, ("cache", v), None))
            if entry.kind == "keyframe" and usable(("keyframe", v)):
                options.append((entry.bytes, ("keyframe", v), None))
            edges = []
            if entry.kind == "patch" and entry.base_version is not None:
                edges.append(_Edge("patch", entry.base_version, v, tuple(entry.blobs), entry.bytes))
            edges += [_Edge("skip", s.base_version, v, tuple(s.blobs), s.bytes) for s in entry.skip_patches]
            for edge in edges:
                if edge.base in best and usable(edge.key):
                    options.append((best[edge.base][0] + edge.bytes, None, edge))
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

    def _materialize_locked(self, version: int, lowest: int, newest: bool, above: int | None) -> Materialized:
        with open(self.root / ".lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            tried: set[PartKey] = set()  # failed in this call: not tried again in it, whatever its backoff
            bad_starts: set[tuple[str, int]] = set()
            local_reasons: list[str] = []  # failures of this cache, which `self.failures` does not keep
            while True:
                best = self._reachable(lowest, version, tried, bad_starts)
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
                start, edges = self._route(best, target)
                if start == ("cache", target):
                    return self._cached(target)
                try:
                    result = self._execute(target, start, edges)
                except _EdgeFailed as exc:
                    if not self._set_aside(target, exc, tried, bad_starts):
                        local_reasons.append(exc.reason)
                    continue
                for part in [start, *(edge.key for edge in edges), ("version", target)]:
                    self.failures.cleared(part)
                self._point_current(result.path)
                self._collect_garbage(keep_also=target)
                return result

    def _cache_is(self, version: int) -> bool:
        """Is the cached v<N> the bits of the (verified) event this log holds for v<N>? A cache folder
        outlives its run: another stack's run with the same id, or a chain forged through a bad token,
        leaves versions under the same numbers, and serving them would serve bits nobody signed here."""
        event = self._events[version]
        try:
            manifest = json.loads((self.path_of(version) / MANIFEST_FILE).read_text())
        except (OSError, ValueError):
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
        aside = self.root / f".foreign-v{version:08d}-{uuid.uuid4().hex[:8]}"
        os.rename(self.path_of(version), aside)
        shutil.rmtree(aside, ignore_errors=True)
        return False

    def _cached(self, version: int) -> Materialized:
        done = self.path_of(version)
        manifest = json.loads((done / MANIFEST_FILE).read_text())
        self._point_current(done)
        return Materialized(version, self.view, done, manifest["root_hash"], 0, f"cache:v{version}")

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

    def _execute(self, version: int, start: tuple[str, int], edges: list[_Edge]) -> Materialized:
        kind, start_version = start
        target_entry = self._view_of(self._events[version])
        expected = {t.name: t.xxh3 for t in target_entry.tensors}
        staging = Path(tempfile.mkdtemp(prefix=f".tmp-v{version}-", dir=self.root))
        downloads = staging / ".downloads"
        downloads.mkdir()
        fetched = 0
        try:
            if kind == "cache":
                source = self.path_of(start_version)
                for name in (CONFIG_FILE, INDEX_FILE, *self._extra_files(source)):
                    shutil.copyfile(source / name, staging / name)
            else:
                entry = self._view_of(self._events[start_version])
                for blob in entry.blobs:
                    if not blob.name.endswith(".safetensors"):
                        fetched += self._download(blob, staging / blob.name, None, start)
                source = downloads
            weight_map = read_weight_map(staging)
            shards = sorted(set(weight_map.values()))
            patches = {edge: {b.name: b for b in edge.blobs} for edge in edges}
            for shard in shards:
                base_path = source / shard
                if kind == "keyframe":
                    blob = next(b for b in self._view_of(self._events[start_version]).blobs if b.name == shard)
                    fetched += self._download(blob, base_path, None, start)
                tensors = load_shard(base_path)
                if kind == "keyframe":
                    base_path.unlink()
                if kind == "cache":
                    self._check_start(tensors, start_version, start)
                known_good = kind == "keyframe"
                for edge in edges:
                    blob = patches[edge].get(shard)
                    if blob is None:
                        raise _EdgeFailed(
                            edge, None, f"{edge.kind} v{edge.base}->v{edge.target} has no patch for shard {shard}"
                        )
                    fetched += self._apply_patch(
                        edge, blob, tensors, downloads / f"{edge.target}-{shard}", verify_base=not known_good
                    )
                    known_good = True
                # Bits that disagree with the version are blamed on the last thing that produced them.
                blame = (edges[-1], None) if edges else (None, start)
                self._verify_shard(tensors, expected, version, weight_map, shard, blame)
                from safetensors.torch import save_file

                save_file(tensors, str(staging / shard), metadata={"format": "pt"})
            shutil.rmtree(downloads)
            digests = {t.name: t.xxh3 for t in target_entry.tensors}
            (staging / MANIFEST_FILE).write_text(
                json.dumps(
                    {
                        "run_id": self.run_id,
                        "version": version,
                        "view": self.view,
                        "root_hash": target_entry.root_hash,
                        # Which event these bits are: a cache entry is served only for that very event.
                        "event_id": self._events[version].event_id,
                        "tensors": digests,
                    },
                    indent=1,
                    sort_keys=True,
                )
            )
            fsync_tree(staging)
            final = self.path_of(version)
            os.rename(staging, final)  # atomic: a version directory is complete or absent
        except BaseException:
            # Cleanup, then re-raise whatever it was (a failed edge, an outage, a cancellation): a
            # half-built staging directory must not outlive any failure. Nothing is swallowed here.
            shutil.rmtree(staging, ignore_errors=True)
            raise
        route = " -> ".join([f"{kind}:v{start_version}", *(f"{e.kind}:v{e.target}" for e in edges)])
        log.info("materialized", version=version, view=self.view, route=route, downloaded_bytes=fetched)
        return Materialized(version, self.view, final, target_entry.root_hash, fetched, route)

    @staticmethod
    def _extra_files(directory: Path) -> list[str]:
        return [
            p.name
            for p in directory.iterdir()
            if p.is_file()
            and not p.name.endswith(".safetensors")
            and p.name not in (CONFIG_FILE, INDEX_FILE, MANIFEST_FILE)
        ]

    def _download(self, blob: BlobPointer, path: Path, edge: _Edge | None, start: tuple[str, int] | None) -> int:
        """Fetch and verify one blob; a checksum failure is retried once (a transfer can go wrong), then
        the part is given up (and set aside with backoff by the caller)."""
        for attempt in (1, 2):
            try:
                ref = self.blobs.get_to_file(blob.uri, path, expected=blob.sha256)
                return ref.bytes
            except BlobIntegrityError as exc:
                if attempt == 2:
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

    def _apply_patch(
        self, edge: _Edge, blob: BlobPointer, tensors: dict[str, torch.Tensor], path: Path, *, verify_base: bool
    ) -> int:
        size = self._download(blob, path, edge, None)
        data = path.read_bytes()
        path.unlink()
        try:
            header, payload = patch_codec.read_header(data)
            unknown = set(header.tensor_names()) - set(tensors)
            if unknown:
                raise _EdgeFailed(
                    edge,
                    None,
                    f"patch v{edge.base}->v{edge.target} names unknown tensors {sorted(unknown)[:3]}",
                    blob.uri,
                )
            # to_bits gives views of the loaded tensors, so the in-place apply updates them.
            bits = {name: to_bits(tensor) for name, tensor in tensors.items()}
            for group in header.groups:
                patch_codec.apply_group(group, payload, bits, inplace=True, verify_base=verify_base)
        except patch_codec.ChecksumMismatch as exc:
            if exc.which == "base":
                raise _EdgeFailed(
                    edge,
                    ("cache", edge.base) if edge.base in self.cached_versions() else None,
                    f"refused: base of v{edge.base}->v{edge.target} does not match ({exc.message})",
                    blob.uri,
                ) from exc
            raise _EdgeFailed(
                edge, None, f"patch v{edge.base}->v{edge.target} produced wrong bits ({exc.message})", blob.uri
            ) from exc
        except patch_codec.PatchFormatError as exc:
            raise _EdgeFailed(edge, None, f"patch {blob.uri} is unreadable: {exc.message}", blob.uri) from exc
        return size

    def _check_start(self, tensors: dict[str, torch.Tensor], version: int, start: tuple[str, int]) -> None:
        expected = {t.name: t.xxh3 for t in self._view_of(self._events[version]).tensors}
        for name, tensor in tensors.items():
            if checksum(to_bits(tensor)) != expected.get(name):
                raise _EdgeFailed(None, start, f"cached v{version} tensor {name} does not match its version")

    def _verify_shard(
        self,
        tensors: dict[str, torch.Tensor],
        expected: dict[str, str],
        version: int,
        weight_map: dict[str, str],
        shard: str,
        blame: tuple[_Edge | None, tuple[str, int] | None],
    ) -> None:
        wanted = {n for n, s in weight_map.items() if s == shard}
        if set(tensors) != wanted:
            raise _EdgeFailed(None, None, f"shard {shard} holds {sorted(set(tensors) ^ wanted)[:3]} unexpectedly")
        for name, tensor in tensors.items():
            actual = checksum(to_bits(tensor))
            if actual != expected.get(name):
                # never served: the staging directory is dropped and the route replanned without it
                raise _EdgeFailed(
                    *blame,
                    f"v{version} tensor {name} ({dtype_name(tensor.dtype)}) hashes to {actual}, "
                    f"the version says {expected.get(name)}",
                )

    # ---------------------------------------------------------------- switch and clean up

    def _point_current(self, path: Path) -> None:
        link = self.root / "current"
        tmp = self.root / f".current-{uuid.uuid4().hex}"
        os.symlink(path.name, tmp)
        os.replace(tmp, link)  # atomic switch for readers that follow `current`

    def _collect_garbage(self, keep_also: int) -> None:
        versions = self.cached_versions()
        keep = set(versions[-self.settings.keep_versions :]) | {keep_also}
        for v in versions:
            if v not in keep:
                trash = self.root / f".trash-{v}-{uuid.uuid4().hex[:6]}"
                os.rename(self.path_of(v), trash)
                shutil.rmtree(trash, ignore_errors=True)
        for stale in self.root.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)  # left by a process killed mid-materialize (we hold the lock)


def verify_directory(path: Path) -> str:
    """Recompute a materialized directory's root hash from its files (for audits and tests)."""
    from safetensors import safe_open

    entries = []
    for shard in sorted(set(read_weight_map(path).values())):
        with safe_open(str(path / shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                tensor = f.get_tensor(name)
                entries.append((name, dtype_name(tensor.dtype), tuple(tensor.shape), checksum(to_bits(tensor))))
    return root_hash(entries)
