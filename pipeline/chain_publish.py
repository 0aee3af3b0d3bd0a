"""Publishing policy versions: views, keyframes or patches, blobs first, then the fenced event.

The trainer calls `ChainPublisher.publish(version, state_dict)` after each
optimizer step. For every configured view it computes the served bits, diffs
them against the previous version's bits kept in memory, uploads a patch per
keyframe shard (or a whole keyframe every K versions), and only then appends
the PolicyVersion event: create-only and fenced on the previous version, so a
second trainer fails instead of forking the chain. An unavailable store is waited
out by the uploads themselves (`blobs.outage_patience_s`, pipeline/blobstore/outage.py):
the event waits with them and is never appended before every blob it names is stored. With a signing key the event is
signed (`pipeline/version_signing.py`) before it is appended: islands pinned to the
key serve nothing else.

Besides its own patch (or keyframe), a version lists skip patches from older versions the
publisher still holds: the configured skip distances, and for a keyframe also the previous
version, so a follower never downloads a whole keyframe just because the trainer wrote one.

Sharded trainers publish in parts. Shards are the units of the publish layout
(`pipeline/publish_layout.py`), planned from source parameter names and shapes, never from the
number of ranks. Each rank holds the full tensors of the source parameters it owns
(`layout.owned(rank, world_size)`) and calls `publish_part`: the views of those parameters only,
its units' shard files or patches and skip patches uploaded, its own history kept. Rank 0 collects
every rank's `VersionPart` and calls `append_parts`: the parts checked to make one whole version,
the keyframe's index/config/extra files written, one event appended; the other ranks `advance`.
`publish()` is exactly that with one rank, so a 1-rank and an N-rank trainer publish the same
files, digests and root hashes (only blob URIs differ: they carry the writer id).

Every rank must agree on a version's kind: `needs_keyframe` is the local rule (every K versions,
no history of the previous version, a changed layout); the trainer all-reduces it (any rank's True
wins) and passes the agreed answer to every rank's `publish_part`.
"""

from __future__ import annotations

import asyncio
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pipeline import patch_codec
from pipeline.bits import checksum, dtype_name, to_bits
from pipeline.blobstore import BlobStore
from pipeline.config import ChainSettings
from pipeline.errors import SprawlError
from pipeline.eventlog import EventLog
from pipeline.keyframe import write_metadata_files, write_shard
from pipeline.logs import get_logger
from pipeline.patch_codec import TensorBits
from pipeline.publish_layout import PublishLayout
from pipeline.subjects import policy_filter, token
from pipeline.version_log import chain_head
from pipeline.version_parts import UnitSkip, UnitView, VersionPart, ViewPart, join_parts, view_version, weight_map
from pipeline.version_signing import key_id, sign_version
from pipeline.views import get_view
from schemas import BlobPointer, PolicyVersion, TensorDigest, ViewVersion

log = get_logger(__name__)

UNITS_AT_ONCE = 4
"""Units a view encodes and uploads at the same time: enough to keep the codec pool and the store busy."""
TIED_HEAD = "lm_head.weight"
"""Not served when embeddings are tied (`disk_layout` drops it), so not planned or published either."""


def _same_tensors(a: Mapping[str, TensorBits], b: Mapping[str, TensorBits]) -> bool:
    """Same names, dtypes and shapes: what a patch from `a` to `b` needs."""
    return a.keys() == b.keys() and all((a[n].dtype, a[n].shape) == (b[n].dtype, b[n].shape) for n in a)


class VersionOutOfOrder(SprawlError):
    def __init__(self, requested: int, head: int | None):
        expected = 0 if head is None else head + 1
        super().__init__(
            f"cannot publish version {requested}: the chain's head is {head}, the next version is {expected}",
            hint="versions are consecutive; a rewound trainer must resume from the head",
        )


class NoPublishLayout(SprawlError):
    def __init__(self) -> None:
        super().__init__(
            "this publisher has no publish layout yet",
            hint="pass source_shapes (every parameter's global shape) to ChainPublisher, or call plan_layout",
        )


class KeyframeRequired(SprawlError):
    def __init__(self, version: int, view: str, reason: str):
        super().__init__(
            f"version {version} was to be a patch, but view(s) {view} cannot patch it: {reason}",
            hint="all-reduce needs_keyframe across ranks (any True wins) and pass the agreed answer to every rank",
        )


@dataclass
class _ViewState:
    """What the publisher remembers of one view: recent versions' bits, of the units it published."""

    history: dict[int, dict[str, TensorBits]] = field(default_factory=dict)
    checksums: dict[int, dict[str, str]] = field(default_factory=dict)
    """xxh3-128 per tensor of the versions in `history`: a patch's base is never hashed twice."""
    layouts: dict[int, str] = field(default_factory=dict)
    """The layout id each version in `history` was cut along: patches only between equal layouts."""


class ChainPublisher:
    def __init__(
        self,
        event_log: EventLog,
        blobs: BlobStore,
        *,
        run_id: str,
        model_config: Mapping[str, Any],
        settings: ChainSettings,
        extra_files: Mapping[str, bytes] | None = None,
        signing_key: Ed25519PrivateKey | None = None,
        writer_id: str | None = None,
        source_shapes: Mapping[str, Sequence[int]] | None = None,
    ):
        """`signing_key`: sign every version with it. None publishes unsigned versions, which islands
        pinned to a key refuse; the trainer passes None only under `trust.allow_unsigned_versions`.

        `writer_id`: the blob key prefix's writer (random when None); sharded ranks pass one id, rank
        0's, so one version's blobs lie under one prefix. `source_shapes`: every source parameter's
        global shape, to plan the publish layout now (sharded ranks need it before their first part);
        without it `publish()` plans from its first state dict."""
        for name in settings.views:
            get_view(name)  # unknown views fail here, not after an optimizer step
        self.log = event_log
        self.blobs = blobs
        self.run_id = token(run_id, "run_id")
        self.model_config = dict(model_config)
        self.settings = settings
        self.extra_files = dict(extra_files or {})
        self.writer_id = token(writer_id, "writer_id") if writer_id is not None else uuid.uuid4().hex[:12]
        self.signing_key = signing_key
        self._tied = bool(self.model_config.get("tie_word_embeddings", False))
        self._views = {name: _ViewState() for name in settings.views}
        self._layout: PublishLayout | None = None
        if source_shapes is not None:
            self.plan_layout(source_shapes)
        self._head: int | None = None
        self._head_seq = 0
        self._opened = False
        self._pool = ThreadPoolExecutor(max_workers=patch_codec._threads())
        self._unit_pool = ThreadPoolExecutor(max_workers=UNITS_AT_ONCE, thread_name_prefix="publish-unit")
        """Per-unit work (write and upload a shard, encode and upload a patch); separate from `_pool`,
        which the codec waits on from inside these threads."""

    async def open(self) -> int | None:
        """Find the chain's head in the log; returns it (None for an empty chain)."""
        head = await chain_head(self.log, self.run_id)
        self._head, self._head_seq = (head.version, head.stream_seq) if head else (None, 0)
        self._opened = True
        return self._head

    def start_at(self, head: int | None) -> None:
        """A rank that has no connection to the log (every rank but 0): take the head rank 0 read."""
        self._head, self._head_seq = head, 0
        self._opened = True

    @property
    def head(self) -> int | None:
        return self._head

    @property
    def layout(self) -> PublishLayout:
        """The publish layout versions are cut along; which parameters each rank owns."""
        if self._layout is None:
            raise NoPublishLayout()
        return self._layout

    def plan_layout(self, source_shapes: Mapping[str, Sequence[int]]) -> PublishLayout:
        """(Re)plan the layout from every source parameter's global shape (a tied lm_head left out: it
        is not served). A layout that differs from the previous version's makes the next one a keyframe."""
        shapes = {n: tuple(int(d) for d in s) for n, s in source_shapes.items() if not (self._tied and n == TIED_HEAD)}
        self._layout = PublishLayout.plan(
            shapes, max_shard_bytes=self.settings.max_shard_bytes, min_units=self.settings.publish_units
        )
        return self._layout

    def needs_keyframe(self, version: int) -> bool:
        """This rank's rule: every `keyframe_every` versions, or when a view lacks the previous version's
        bits or cut them along another layout (first version, a restart, a changed model)."""
        layout_id = self.layout.layout_id
        return version % self.settings.keyframe_every == 0 or any(
            state.layouts.get(version - 1) != layout_id for state in self._views.values()
        )

    async def publish(
        self,
        version: int,
        state_dict: Mapping[str, torch.Tensor],
        *,
        trainer_step: int | None = None,
        consumed_trajectories: int = 0,
        lineage_uri: str | None = None,
        lineage_sha256: str | None = None,
    ) -> PolicyVersion:
        """Publish a whole model from one process: `publish_part` as rank 0 of 1, then `append_parts`."""
        await self._check_next(version)
        owned = self._served_sources(state_dict)
        shapes = {n: tuple(t.shape) for n, t in owned.items()}
        if self._layout is None or self._layout.shapes != shapes:
            self.plan_layout(shapes)
        part = await self.publish_part(version, owned, rank=0, world_size=1, keyframe=self.needs_keyframe(version))
        return await self.append_parts(
            version,
            [part],
            trainer_step=trainer_step,
            consumed_trajectories=consumed_trajectories,
            lineage_uri=lineage_uri,
            lineage_sha256=lineage_sha256,
        )

    async def publish_part(
        self,
        version: int,
        owned_state_dict: Mapping[str, torch.Tensor],
        *,
        rank: int,
        world_size: int,
        keyframe: bool,
    ) -> VersionPart:
        """Compute, upload and remember this rank's units of `version` in every view; returns what rank 0
        needs to append it. `owned_state_dict`: exactly `layout.owned(rank, world_size)`, full tensors
        (a tied lm_head may be included; it is ignored). `keyframe`: the ranks' agreed decision."""
        await self._check_next(version)
        layout = self.layout
        owned = self._served_sources(owned_state_dict)
        layout.check_owned(rank, world_size, {n: tuple(t.shape) for n, t in owned.items()})
        if not keyframe and self.needs_keyframe(version):  # a patch where one process writes a keyframe
            raise KeyframeRequired(version, ", ".join(self.settings.views), "this rank's rule says keyframe")
        units = layout.units_of(rank, world_size)
        # Views are independent (own history, own blobs): compute, diff and upload them concurrently.
        views = await asyncio.gather(
            *(
                asyncio.to_thread(self._view_part, name, version, owned, layout, units, keyframe)
                for name in self.settings.views
            )
        )
        return VersionPart(
            version=version,
            rank=rank,
            world_size=world_size,
            writer_id=self.writer_id,
            layout_id=layout.layout_id,
            units=units,
            views=list(views),
        )

    async def append_parts(
        self,
        version: int,
        parts: Sequence[VersionPart],
        *,
        trainer_step: int | None = None,
        consumed_trajectories: int = 0,
        lineage_uri: str | None = None,
        lineage_sha256: str | None = None,
    ) -> PolicyVersion:
        """Rank 0: check that `parts` (one per rank) make `version` whole, upload a keyframe's non-tensor
        files, and append the one signed, fenced event. Nothing is appended when a check fails."""
        await self._check_next(version)
        joined = join_parts(
            parts, version=version, views=self.settings.views, layout=self.layout, writer_id=self.writer_id
        )
        views = await asyncio.gather(
            *(
                asyncio.to_thread(self._view_version, name, kind, version, units)
                for name, (kind, units) in joined.items()
            )
        )
        event = PolicyVersion(
            run_id=self.run_id,
            version=version,
            parent_version=self._head,
            views=list(views),
            trainer_step=version if trainer_step is None else trainer_step,
            consumed_trajectories=consumed_trajectories,
            lineage_uri=lineage_uri,
            lineage_sha256=lineage_sha256,
        )
        if self.signing_key is not None:
            event = sign_version(event, self.signing_key)
        result = await self.log.append(
            event, expected_last_subject_seq=self._head_seq, fence_subject=policy_filter(self.run_id)
        )
        self._head, self._head_seq = version, result.seq
        log.info(
            "policy version published",
            version=version,
            stream_seq=result.seq,
            ranks=len(parts),
            signed_by=key_id(self.signing_key) if self.signing_key is not None else None,
            views={v.view: {"kind": v.kind, "bytes": v.bytes, "changed": v.changed_elements} for v in views},
        )
        return event

    def advance(self, version: int, *, stream_seq: int = 0) -> None:
        """Another rank appended `version`: move this publisher's head to it (versions stay consecutive)."""
        if not self._opened:
            raise SprawlError("advance() before open()", hint="open() (or publish_part) first: it reads the head")
        self._require_next(version)
        self._head, self._head_seq = version, stream_seq

    def close(self) -> None:
        self._unit_pool.shutdown()
        self._pool.shutdown()

    # ---------------------------------------------------------------- helpers

    async def _check_next(self, version: int) -> None:
        if not self._opened:
            await self.open()
        self._require_next(version)

    def _require_next(self, version: int) -> None:
        if version != (0 if self._head is None else self._head + 1):
            raise VersionOutOfOrder(version, self._head)

    def _served_sources(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: t for n, t in state_dict.items() if not (self._tied and n == TIED_HEAD)}

    # ---------------------------------------------------------------- one view of one rank (in a thread)

    def _view_part(
        self,
        name: str,
        version: int,
        owned: Mapping[str, torch.Tensor],
        layout: PublishLayout,
        units: list[int],
        keyframe: bool,
    ) -> ViewPart:
        view = get_view(name)
        state = self._views[name]
        # A view is a function of each source tensor alone, so computing it per unit gives exactly the
        # served tensors of that unit's file.
        tensors = {
            u: view.compute(
                {n: owned[n] for n in layout.units[u]},
                tie_word_embeddings=self._tied,
                model_type=self.model_config.get("model_type"),
            )
            for u in units
        }
        unit_bits = {
            u: {n: TensorBits(dtype_name(t.dtype), tuple(t.shape), to_bits(t)) for n, t in group.items()}
            for u, group in tensors.items()
        }
        bits = {n: b for group in unit_bits.values() for n, b in group.items()}
        names = sorted(bits)
        sums = dict(zip(names, self._pool.map(lambda n: checksum(bits[n].bits), names), strict=True))

        def patchable_from(base: int) -> bool:
            older = state.history.get(base)
            return older is not None and state.layouts[base] == layout.layout_id and _same_tensors(older, bits)

        if not keyframe and not patchable_from(version - 1):
            raise KeyframeRequired(version, name, "this rank holds no bits of the previous version on this layout")
        distances = set(self.settings.skip_distances) | ({1} if keyframe and self.settings.keyframe_patches else set())
        skip_bases = [version - k for k in sorted(distances) if patchable_from(version - k)]
        prefix = f"runs/{self.run_id}/policy/v{version:08d}-{self.writer_id}/{name}"

        def upload(job: tuple[int, int | None]) -> tuple[BlobPointer, dict[str, int]]:
            """(unit, None): the unit's keyframe shard; (unit, base): its patch from version `base`."""
            unit, base = job
            shard = layout.shard_file(unit)
            if base is None:
                path = Path(tmp) / shard
                write_shard(path, tensors[unit])
                changed = {n: len(b.bits) for n, b in unit_bits[unit].items()}
                return self._put_file(path, f"{prefix}/keyframe/{shard}"), changed
            key = f"{prefix}/patch-from-v{base}/{shard.removesuffix('.safetensors')}.sprp"
            return self._upload_patch(name, state, unit_bits[unit], base, version, key, shard, sums)

        # Units are written, encoded and uploaded side by side (an encode also spreads its chunks over the
        # codec pool): one shard's tensors alone leave most of the pool and the store idle.
        own = [(u, None if keyframe else version - 1) for u in units]
        jobs = own + [(u, base) for u in units for base in skip_bases]
        with tempfile.TemporaryDirectory(prefix="sprawl-keyframe-") as tmp:
            done = dict(zip(jobs, self._unit_pool.map(upload, jobs), strict=True))
        unit_views = []
        for u, job in zip(units, own, strict=True):
            blob, changed = done[job]
            skips = [
                UnitSkip(base_version=b, blob=done[u, b][0], changed_elements=sum(done[u, b][1].values()))
                for b in skip_bases
            ]
            unit_views.append(
                UnitView(
                    unit=u,
                    blob=blob,
                    tensors=[
                        TensorDigest(name=n, dtype=b.dtype, shape=list(b.shape), xxh3=sums[n], changed=changed[n])
                        for n, b in sorted(unit_bits[u].items())
                    ],
                    tensor_bytes=sum(t.numel() * t.element_size() for t in tensors[u].values()),
                    skips=skips,
                )
            )
        state.history[version], state.checksums[version], state.layouts[version] = bits, sums, layout.layout_id
        horizon = max([1, *self.settings.skip_distances])
        for old in [v for v in state.history if v < version - horizon + 1]:
            del state.history[old], state.checksums[old], state.layouts[old]
        return ViewPart(view=name, kind="keyframe" if keyframe else "patch", units=unit_views)

    def _upload_patch(
        self,
        name: str,
        state: _ViewState,
        target: dict[str, TensorBits],
        base_version: int,
        target_version: int,
        key: str,
        shard: str,
        target_sums: dict[str, str],
    ) -> tuple[BlobPointer, dict[str, int]]:
        """One unit's patch base_version -> target_version under `key`, named by its `shard` file; its
        changed elements per tensor."""
        base, names = state.history[base_version], sorted(target)
        patch = patch_codec.encode(
            {n: base[n] for n in names},
            {n: target[n] for n in names},
            view=name,
            base_version=base_version,
            target_version=target_version,
            chunk_elements=self.settings.chunk_elements,
            level=self.settings.zstd_level,
            pool=self._pool,
            base_checksums=state.checksums[base_version],
            target_checksums=target_sums,
        )
        header, _ = patch_codec.read_header(patch)
        changed = {t.name: t.changed for g in header.groups for t in g.tensors}
        ref = self.blobs.put_bytes(patch, key=key)
        return BlobPointer(uri=ref.uri, sha256=ref.checksum, bytes=ref.bytes, name=shard), changed

    def _put_file(self, path: Path, key: str) -> BlobPointer:
        ref = self.blobs.put_file(path, key)
        return BlobPointer(uri=ref.uri, sha256=ref.checksum, bytes=ref.bytes, name=path.name)

    # ---------------------------------------------------------------- one view of the event (rank 0, in a thread)

    def _view_version(
        self, name: str, kind: Literal["keyframe", "patch"], version: int, units: list[UnitView]
    ) -> ViewVersion:
        metadata: list[BlobPointer] = []
        if kind == "keyframe":  # the files that are not shards: written from the joined parts
            view = get_view(name)
            with tempfile.TemporaryDirectory(prefix="sprawl-keyframe-") as tmp:
                files = write_metadata_files(
                    Path(tmp),
                    weight_map(units, self.layout),
                    sum(u.tensor_bytes for u in units),
                    {**self.model_config, **view.config_overrides(self.model_config)},
                    self.extra_files,
                )
                prefix = f"runs/{self.run_id}/policy/v{version:08d}-{self.writer_id}/{name}/keyframe"
                metadata = list(self._pool.map(lambda f: self._put_file(Path(tmp) / f, f"{prefix}/{f}"), files))
        return view_version(name, kind, version, units, metadata_blobs=metadata)
