"""Materializing a policy version: exact served bits on local disk, in HF layout, verified.

`Materializer.materialize(version)` plans the cheapest way there by bytes to
download (a cached version or the nearest keyframe, then patches or
skip-patches), applies it shard by shard (memory stays at one shard), checks
every tensor's xxh3-128 against the version event, and renames the finished
directory into place: the previous version is untouched until the new one is
complete. A file lock serializes processes sharing a cache, so two samplers on
one host neither corrupt it nor download twice.

Failure handling: a blob that fails its sha256 is fetched once more, then the
edge is abandoned and the plan recomputed (in the end: the keyframe path); a
missing blob is named by key; a base whose bits differ from what a patch
expects is refused; a version not yet in the log is waited for, never guessed.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import shutil
import tempfile
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
from pipeline.subjects import token
from pipeline.version_log import wait_for_version
from schemas import BlobPointer, PolicyVersion, ViewVersion

log = get_logger(__name__)

MANIFEST_FILE = "sprawl-version.json"
MAX_WALK_BACK = 64
"""How far below the nearest keyframe a cached version may be and still be worth walking up from."""


class MaterializeError(SprawlError):
    pass


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


class _EdgeFailed(Exception):
    def __init__(self, edge: _Edge | None, start: tuple[str, int] | None, reason: str):
        self.edge, self.start, self.reason = edge, start, reason
        super().__init__(reason)


class Materializer:
    def __init__(self, event_log: EventLog, blobs: BlobStore, *, run_id: str, view: str, settings: MaterializeSettings):
        self.log = event_log
        self.blobs = blobs
        self.run_id = token(run_id, "run_id")
        self.view = view
        self.settings = settings
        self.root = settings.cache_dir.resolve() / self.run_id / view
        self.root.mkdir(parents=True, exist_ok=True)
        self._events: dict[int, PolicyVersion] = {}

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
        target = await self._event(version)
        self._view_of(target)
        lowest = await self._gather_events(version)
        return await asyncio.to_thread(self._materialize_locked, version, lowest)

    # ---------------------------------------------------------------- events

    async def _event(self, version: int) -> PolicyVersion:
        if version not in self._events:
            self._events[version] = await wait_for_version(
                self.log, self.run_id, version, self.settings.wait_for_version_s
            )
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
        # Always down to the nearest keyframe: it is the fallback when a patch route breaks.
        while self._view_of(await self._event(v)).kind != "keyframe" and v > 0:
            v -= 1
        lowest = v
        below = [c for c in cached if lowest - MAX_WALK_BACK <= c < lowest]
        if below:
            for w in range(max(below), lowest):
                await self._event(w)
            lowest = max(below)
        return lowest

    # ---------------------------------------------------------------- planning

    def _plan(self, lowest: int, version: int, failed: set, bad_starts: set) -> tuple[tuple[str, int], list[_Edge]]:
        cached = set(self.cached_versions())
        best: dict[int, tuple[int, tuple[str, int] | None, _Edge | None]] = {}
        for v in range(lowest, version + 1):
            entry = self._view_of(self._events[v])
            options: list[tuple[int, tuple[str, int] | None, _Edge | None]] = []
            if v in cached and ("cache", v) not in bad_starts:
                options.append((0, ("cache", v), None))
            if entry.kind == "keyframe" and ("keyframe", v) not in bad_starts:
                options.append((entry.bytes, ("keyframe", v), None))
            edges = []
            if entry.kind == "patch" and entry.base_version is not None:
                edges.append(_Edge("patch", entry.base_version, v, tuple(entry.blobs), entry.bytes))
            edges += [_Edge("skip", s.base_version, v, tuple(s.blobs), s.bytes) for s in entry.skip_patches]
            for edge in edges:
                if edge.base in best and edge not in failed:
                    options.append((best[edge.base][0] + edge.bytes, None, edge))
            if options:
                best[v] = min(options, key=lambda o: o[0])
        if version not in best:
            raise MaterializeError(
                f"no usable route to version {version} of view {self.view!r}",
                hint="every route failed for the reasons given; keep serving the last good version",
            )
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

    def _materialize_locked(self, version: int, lowest: int) -> Materialized:
        with open(self.root / ".lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            done = self.path_of(version)
            if (done / MANIFEST_FILE).exists():
                manifest = json.loads((done / MANIFEST_FILE).read_text())
                self._point_current(done)
                return Materialized(version, self.view, done, manifest["root_hash"], 0, f"cache:v{version}")
            failed: set[_Edge] = set()
            bad_starts: set[tuple[str, int]] = set()
            reasons: list[str] = []
            while True:
                try:
                    start, edges = self._plan(lowest, version, failed, bad_starts)
                except MaterializeError as exc:
                    detail = "; ".join(reasons) if reasons else "nothing was tried"
                    raise MaterializeError(f"{exc.message}: {detail}", hint=exc.hint) from None
                try:
                    result = self._execute(version, start, edges)
                except _EdgeFailed as exc:
                    if exc.edge is None and exc.start is None:
                        # Nothing to route around: the target version's own files are inconsistent.
                        raise MaterializeError(
                            exc.reason, hint="this version's blobs do not fit together; do not serve it"
                        ) from exc
                    reasons.append(exc.reason)
                    log.warning("materialize route failed, replanning", version=version, reason=exc.reason)
                    if exc.edge is not None:
                        failed.add(exc.edge)
                    if exc.start is not None:
                        bad_starts.add(exc.start)
                    continue
                self._point_current(result.path)
                self._collect_garbage(keep_also=version)
                return result

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
                self._verify_shard(tensors, expected, version, weight_map, shard)
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
        """Fetch and verify one blob; a checksum failure is retried once, then the route is abandoned."""
        for attempt in (1, 2):
            try:
                ref = self.blobs.get_to_file(blob.uri, path, expected=blob.sha256)
                return ref.bytes
            except BlobIntegrityError as exc:
                if attempt == 2:
                    raise _EdgeFailed(edge, start, f"{blob.uri} is corrupt after a refetch: {exc.message}") from exc
                log.warning("blob failed verification, refetching once", uri=blob.uri)
            except BlobNotFound as exc:
                raise _EdgeFailed(edge, start, f"missing blob {blob.uri}") from exc
        raise AssertionError("unreachable")

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
                    edge, None, f"patch v{edge.base}->v{edge.target} names unknown tensors {sorted(unknown)[:3]}"
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
                ) from exc
            raise _EdgeFailed(
                edge, None, f"patch v{edge.base}->v{edge.target} produced wrong bits ({exc.message})"
            ) from exc
        except patch_codec.PatchFormatError as exc:
            raise _EdgeFailed(edge, None, f"patch {blob.uri} is unreadable: {exc.message}") from exc
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
    ) -> None:
        wanted = {n for n, s in weight_map.items() if s == shard}
        if set(tensors) != wanted:
            raise _EdgeFailed(None, None, f"shard {shard} holds {sorted(set(tensors) ^ wanted)[:3]} unexpectedly")
        for name, tensor in tensors.items():
            actual = checksum(to_bits(tensor))
            if actual != expected.get(name):
                raise MaterializeError(
                    f"v{version} tensor {name} ({dtype_name(tensor.dtype)}) hashes to {actual}, "
                    f"the version says {expected.get(name)}",
                    hint="the rebuilt bits do not match the signed version; do not serve it",
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
