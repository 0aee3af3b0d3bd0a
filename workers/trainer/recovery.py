"""Lineage: which trajectories each version consumed, written with the version and read back to
re-derive versions that a restarted trainer's checkpoint does not cover.

Re-derivation replays the same batches through the same deterministic update and must hash, view
by view, to the root hashes the log recorded; anything else is a `RecoveryMismatch`, never a
silently forked chain.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import NamedTuple

import torch

from pipeline.batching import GroupBatchItem
from pipeline.blobstore import BlobRef, BlobStore
from pipeline.errors import SprawlError
from pipeline.eventlog import EventLog
from pipeline.topology import REWARDS, TRAJECTORIES
from pipeline.version_log import fetch_version
from schemas import PolicyVersion, Reward, Trajectory
from schemas.lineage import Lineage, LineageGroup, LineageMember, decode_lineage, encode_lineage, lineage_key


class RecoveryMismatch(SprawlError):
    def __init__(self, message: str, hint: str | None = None):
        super().__init__(
            message,
            hint=hint
            or "the update must be deterministic and its inputs unchanged (the same trainer settings, slices"
            " and ranks as when the version was computed); inspect with `sprawl audit lineage`",
        )


class RecordedBatch(NamedTuple):
    """What a version was trained on, as its lineage says."""

    event: PolicyVersion
    batch: list[GroupBatchItem]
    quarantined: frozenset[str]
    """The islands whose rows left the loss (the drift guard's quarantine) in that update."""


async def put_lineage(
    blobs: BlobStore,
    run_id: str,
    version: int,
    batch: list[GroupBatchItem],
    quarantined: frozenset[str] = frozenset(),
    slices: int | None = None,
    ranks: int = 1,
) -> BlobRef:
    """Write the lineage blob; its uri and sha256 go into the (signed) version event."""
    lineage = Lineage(
        version=version,
        slices=slices,
        ranks=ranks if ranks > 1 else None,
        quarantined_islands=sorted(quarantined),
        groups=[
            LineageGroup(
                group_id=item.group_id,
                members=[
                    LineageMember(t.trajectory_id, ts, rs)
                    for t, ts, rs in zip(item.trajectories, item.trajectory_seqs, item.reward_seqs, strict=True)
                ],
            )
            for item in batch
        ],
    )
    return await asyncio.to_thread(blobs.put_bytes, encode_lineage(lineage), lineage_key(run_id, version))


async def read_lineage(
    event_log: EventLog, blobs: BlobStore, run_id: str, version: int
) -> tuple[PolicyVersion, Lineage]:
    """The version's event and its lineage blob (checked against the event's digest)."""
    event = await fetch_version(event_log, run_id, version)
    if event is None or event.lineage_uri is None:
        raise RecoveryMismatch(f"version {version} has no lineage: it cannot be re-derived")
    # Checked against the event's digest where it has one (events before it name only the uri): a
    # rewritten lineage blob must not make a restarted trainer re-derive from other trajectories.
    data = await asyncio.to_thread(blobs.get_bytes, event.lineage_uri, expected=event.lineage_sha256)
    return event, decode_lineage(data)


async def batch_from_lineage(event_log: EventLog, blobs: BlobStore, run_id: str, version: int) -> RecordedBatch:
    """The version's event, the exact batch it was trained on and the islands quarantined in that
    update, read back from the log."""
    event, lineage = await read_lineage(event_log, blobs, run_id, version)
    batch = await recorded_batch(event_log, lineage)
    return RecordedBatch(event, batch, frozenset(lineage.quarantined_islands))


def check_same_summation(lineage: Lineage, slices: int, ranks: int) -> None:
    """Refuse to re-derive a version whose gradients were summed in another order than this trainer
    sums them: another number of slices, or (with three or more slices) another number of ranks."""
    recorded_slices, recorded_ranks = lineage.slices or 1, lineage.ranks or 1
    if recorded_slices != slices:
        raise RecoveryMismatch(
            f"version {lineage.version} was computed in {recorded_slices} slice(s); this trainer cuts batches"
            f" into {slices} (trainer.micro_batches, or one per rank): it cannot re-derive it bit for bit",
            hint=f"restart with trainer.micro_batches = {recorded_slices} (and a number of ranks dividing it)",
        )
    if slices > 2 and recorded_ranks != ranks:
        # Two terms sum the same in either order; three or more are summed per rank first, then across.
        raise RecoveryMismatch(
            f"version {lineage.version} summed its {slices} slices' gradients on {recorded_ranks} rank(s); this"
            f" trainer has {ranks} rank(s), which sum them in another order: it cannot re-derive it bit for bit",
            hint=f"restart with trainer.ranks = {recorded_ranks} until the next checkpoint covers the chain's head",
        )


async def recorded_batch(event_log: EventLog, lineage: Lineage) -> list[GroupBatchItem]:
    """The exact batch a lineage names, its trajectories and rewards read back from the log."""
    version = lineage.version
    batch = []
    for group in lineage.groups:
        trajectories, rewards, tseqs, rseqs = [], [], [], []
        for member in group.members:
            trajectory_id, tseq, rseq = member.trajectory_id, member.trajectory_seq, member.reward_seq
            traj = await event_log.resolve((await event_log.js.get_msg(TRAJECTORIES.name, tseq)).data)
            reward = await event_log.resolve((await event_log.js.get_msg(REWARDS.name, rseq)).data)
            if not isinstance(traj, Trajectory) or traj.trajectory_id != trajectory_id:
                raise RecoveryMismatch(f"lineage of v{version}: {TRAJECTORIES.name} seq {tseq} is not {trajectory_id}")
            if not isinstance(reward, Reward) or reward.trajectory_id != trajectory_id:
                raise RecoveryMismatch(f"lineage of v{version}: {REWARDS.name} seq {rseq} is not for {trajectory_id}")
            trajectories.append(traj)
            rewards.append(reward)
            tseqs.append(tseq)
            rseqs.append(rseq)
        batch.append(GroupBatchItem(group.group_id, trajectories, rewards, tseqs, rseqs))
    return batch


def view_digests(
    state: Mapping[str, torch.Tensor],
    views: list[str],
    *,
    tie_word_embeddings: bool,
    model_type: str | None = None,
) -> dict[str, list[tuple[str, str, tuple[int, ...], str]]]:
    """Per view, the manifest digest (name, dtype, shape, xxh3) of every served tensor of `state` (a
    whole model's, or the share one rank owns: digests of shares merge into the whole's). `model_type`
    is the model's `config.model_type`: the served names and quantized tensors follow its family, as
    the publisher's do (None: the legacy Qwen3-MoE layout)."""
    from pipeline.bits import checksum, dtype_name, to_bits
    from pipeline.views import get_view

    out = {}
    for name in views:
        tensors = get_view(name).compute(state, tie_word_embeddings=tie_word_embeddings, model_type=model_type)
        out[name] = [(n, dtype_name(t.dtype), tuple(t.shape), checksum(to_bits(t))) for n, t in tensors.items()]
    return out


def root_hashes(model: torch.nn.Module, views: list[str]) -> dict[str, str]:
    """Each view's manifest root hash for the model's current weights (one process)."""
    from pipeline.bits import root_hash

    tie = bool(model.config.to_dict().get("tie_word_embeddings", False))
    digests = view_digests(model.state_dict(), views, tie_word_embeddings=tie, model_type=model.config.model_type)
    return {name: root_hash(sorted(d)) for name, d in digests.items()}


def check_rederived(event: PolicyVersion, ours: dict[str, str]) -> None:
    for view in event.views:
        if ours.get(view.view) != view.root_hash:
            raise RecoveryMismatch(
                f"re-derived v{event.version} {view.view} hashes to {ours.get(view.view)}, the log says "
                f"{view.root_hash}: the update is not deterministic or the inputs changed"
            )
