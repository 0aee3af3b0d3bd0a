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
"""

from __future__ import annotations

import asyncio
import tempfile
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pipeline import patch_codec
from pipeline.bits import checksum, dtype_name, root_hash, to_bits
from pipeline.blobstore import BlobStore
from pipeline.config import ChainSettings
from pipeline.errors import SprawlError
from pipeline.eventlog import EventLog
from pipeline.keyframe import write_checkpoint
from pipeline.logs import get_logger
from pipeline.patch_codec import TensorBits
from pipeline.subjects import policy_filter, token
from pipeline.version_log import chain_head
from pipeline.version_signing import key_id, sign_version
from pipeline.views import get_view
from schemas import BlobPointer, PolicyVersion, SkipPatch, TensorDigest, ViewVersion

log = get_logger(__name__)


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


@dataclass
class _ViewState:
    """What the publisher remembers of one view: recent versions' bits and the shard layout."""

    history: dict[int, dict[str, TensorBits]] = field(default_factory=dict)
    checksums: dict[int, dict[str, str]] = field(default_factory=dict)
    """xxh3-128 per tensor of the versions in `history`: a patch's base is never hashed twice."""
    weight_map: dict[str, str] = field(default_factory=dict)


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
    ):
        """`signing_key`: sign every version with it. None publishes unsigned versions, which islands
        pinned to a key refuse; the trainer passes None only under `trust.allow_unsigned_versions`."""
        for name in settings.views:
            get_view(name)  # unknown views fail here, not after an optimizer step
        self.log = event_log
        self.blobs = blobs
        self.run_id = token(run_id, "run_id")
        self.model_config = dict(model_config)
        self.settings = settings
        self.extra_files = dict(extra_files or {})
        self.writer_id = uuid.uuid4().hex[:12]
        self.signing_key = signing_key
        self._views = {name: _ViewState() for name in settings.views}
        self._head: int | None = None
        self._head_seq = 0
        self._opened = False
        self._pool = ThreadPoolExecutor(max_workers=patch_codec._threads())

    async def open(self) -> int | None:
        """Find the chain's head in the log; returns it (None for an empty chain)."""
        head = await chain_head(self.log, self.run_id)
        self._head, self._head_seq = (head.version, head.stream_seq) if head else (None, 0)
        self._opened = True
        return self._head

    @property
    def head(self) -> int | None:
        return self._head

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
        if not self._opened:
            await self.open()
        expected = 0 if self._head is None else self._head + 1
        if version != expected:
            raise VersionOutOfOrder(version, self._head)
        # Views are independent (own history, own blobs): compute, diff and upload them concurrently.
        views = list(
            await asyncio.gather(
                *(asyncio.to_thread(self._publish_view, name, version, state_dict) for name in self.settings.views)
            )
        )
        event = PolicyVersion(
            run_id=self.run_id,
            version=version,
            parent_version=self._head,
            views=views,
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
            signed_by=key_id(self.signing_key) if self.signing_key is not None else None,
            views={v.view: {"kind": v.kind, "bytes": v.bytes, "changed": v.changed_elements} for v in views},
        )
        return event

    def close(self) -> None:
        self._pool.shutdown()

    # ---------------------------------------------------------------- per view (runs in a thread)

    def _publish_view(self, name: str, version: int, state_dict: Mapping[str, torch.Tensor]) -> ViewVersion:
        view = get_view(name)
        tie = bool(self.model_config.get("tie_word_embeddings", False))
        tensors = view.compute(state_dict, tie_word_embeddings=tie)
        bits = {n: TensorBits(dtype_name(t.dtype), tuple(t.shape), to_bits(t)) for n, t in tensors.items()}
        state = self._views[name]
        previous = state.history.get(version - 1)
        prefix = f"runs/{self.run_id}/policy/v{version:08d}-{self.writer_id}/{name}"
        keyframe = (
            version % self.settings.keyframe_every == 0
            or previous is None
            or not _same_tensors(previous, bits)
            or set(bits) != set(state.weight_map)
        )
        names = sorted(bits)
        sums = dict(zip(names, self._pool.map(lambda n: checksum(bits[n].bits), names), strict=True))
        digests = [
            TensorDigest(name=n, dtype=bits[n].dtype, shape=list(bits[n].shape), xxh3=sums[n], changed=0) for n in names
        ]
        layout_before = dict(state.weight_map)
        if keyframe:
            blobs, changed_by_tensor = self._upload_keyframe(name, view, tensors, prefix, state)
            base_version = None
        else:
            assert previous is not None
            blobs, changed_by_tensor = self._upload_patch(
                name,
                previous,
                bits,
                version - 1,
                version,
                f"{prefix}/patch-from-v{version - 1}",
                state,
                (state.checksums[version - 1], sums),
            )
            base_version = version - 1
        digests = [
            TensorDigest(name=d.name, dtype=d.dtype, shape=d.shape, xxh3=d.xxh3, changed=changed_by_tensor[d.name])
            for d in digests
        ]
        # Patches are cut along the shards of this version's layout: one from v-k is only usable by a
        # follower whose copy of v-k has the same shards (always so unless a keyframe re-cut them).
        distances = set(self.settings.skip_distances) | ({1} if keyframe and self.settings.keyframe_patches else set())
        skips = []
        for k in sorted(distances) if state.weight_map == layout_before else []:
            older = state.history.get(version - k)
            if older is None or not _same_tensors(older, bits):
                continue
            skip_blobs, skip_changed = self._upload_patch(
                name,
                older,
                bits,
                version - k,
                version,
                f"{prefix}/patch-from-v{version - k}",
                state,
                (state.checksums[version - k], sums),
            )
            skips.append(
                SkipPatch(
                    base_version=version - k,
                    blobs=skip_blobs,
                    bytes=sum(b.bytes for b in skip_blobs),
                    changed_elements=sum(skip_changed.values()),
                )
            )
        state.history[version] = bits
        state.checksums[version] = sums
        horizon = max([1, *self.settings.skip_distances])
        for old in [v for v in state.history if v < version - horizon + 1]:
            del state.history[old]
            del state.checksums[old]
        return ViewVersion(
            view=name,
            kind="keyframe" if keyframe else "patch",
            base_version=base_version,
            blobs=blobs,
            tensors=digests,
            root_hash=root_hash([(d.name, d.dtype, tuple(d.shape), d.xxh3) for d in digests]),
            bytes=sum(b.bytes for b in blobs),
            changed_elements=sum(changed_by_tensor.values()),
            total_elements=sum(len(b.bits) for b in bits.values()),
            skip_patches=skips,
        )

    def _upload_keyframe(self, name, view, tensors, prefix, state) -> tuple[list[BlobPointer], dict[str, int]]:
        config = {**self.model_config, **view.config_overrides()}
        with tempfile.TemporaryDirectory(prefix="sprawl-keyframe-") as tmp:
            directory = Path(tmp)
            files = write_checkpoint(
                directory, tensors, config, max_shard_bytes=self.settings.max_shard_bytes, extra_files=self.extra_files
            )
            pointers = list(self._pool.map(lambda f: self._put_file(directory / f, f"{prefix}/keyframe/{f}", f), files))
            from pipeline.keyframe import read_weight_map

            state.weight_map = read_weight_map(directory)
        return pointers, {n: t.numel() for n, t in tensors.items()}

    def _put_file(self, path: Path, key: str, file_name: str) -> BlobPointer:
        ref = self.blobs.put_file(path, key)
        return BlobPointer(uri=ref.uri, sha256=ref.checksum, bytes=ref.bytes, name=file_name)

    def _upload_patch(
        self, name, base, target, base_version, target_version, prefix, state, known: tuple[dict, dict]
    ) -> tuple[list[BlobPointer], dict[str, int]]:
        by_shard: dict[str, list[str]] = {}
        for tensor_name, shard in state.weight_map.items():
            by_shard.setdefault(shard, []).append(tensor_name)
        pointers, changed = [], {}
        for shard, names in sorted(by_shard.items()):
            patch = patch_codec.encode(
                {n: base[n] for n in names},
                {n: target[n] for n in names},
                view=name,
                base_version=base_version,
                target_version=target_version,
                chunk_elements=self.settings.chunk_elements,
                level=self.settings.zstd_level,
                pool=self._pool,
                base_checksums=known[0],
                target_checksums=known[1],
            )
            header, _ = patch_codec.read_header(patch)
            changed.update({t.name: t.changed for g in header.groups for t in g.tensors})
            ref = self.blobs.put_bytes(patch, key=f"{prefix}/{shard.removesuffix('.safetensors')}.sprp")
            pointers.append(BlobPointer(uri=ref.uri, sha256=ref.checksum, bytes=ref.bytes, name=shard))
        return pointers, changed
