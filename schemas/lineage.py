"""The lineage blob of a policy version: which trajectories (and their rewards) trained into it.

The trainer writes it (JSON, blob first) before the version event that points at it
(`PolicyVersion.lineage_uri`); a restarted trainer reads it back to re-derive the version, and the
audit joins it to the archive. Members are JSON arrays `[trajectory_id, trajectory_seq,
reward_seq]`, the layout the trainer has always written, so every lineage blob ever written decodes.
"""

from __future__ import annotations

import msgspec


class LineageMember(msgspec.Struct, frozen=True, array_like=True):
    """One trajectory of a group, encoded as a JSON array (a version lists thousands)."""

    trajectory_id: str
    trajectory_seq: int
    """Stream sequence of the trajectory event on TRAJECTORIES."""
    reward_seq: int
    """Stream sequence of its reward event on REWARDS."""


class LineageGroup(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """One prompt group of the batch, with the members the update used."""

    group_id: str
    members: list[LineageMember]


class Lineage(msgspec.Struct, frozen=True, forbid_unknown_fields=False, omit_defaults=True):
    """What version `version` was trained on, group by group, in batch order."""

    version: int
    groups: list[LineageGroup]
    quarantined_islands: list[str] = []
    """Islands the drift guard had quarantined for this update: their trajectories are in `groups` (they
    were forwarded and measured) but left the loss. Re-deriving the version applies the same set.
    Written only when non-empty (a blob without it is byte-identical to one from before the field), and
    a reader that predates it ignores it (unknown fields are allowed)."""

    slices: int | None = None
    """How many slices the update cut the batch into (`trainer.micro_batches`, or the number of ranks):
    part of the computation, so a trainer restarted with another count cannot re-derive the version bit
    for bit and refuses, naming both. None: written before the field (one slice)."""

    ranks: int | None = None
    """How many ranks summed those slices' gradients. With three or more slices the order of the sum
    depends on it (2 ranks x 4 slices: (s0+s2)+(s1+s3); one process: ((s0+s1)+s2)+s3), so a trainer of
    another number of ranks cannot re-derive the version bit for bit and refuses, naming both. None:
    written before the field, or by one process (omitted, so such blobs are byte-identical to older ones)."""

    def trajectory_ids(self) -> list[str]:
        return [m.trajectory_id for g in self.groups for m in g.members]


class LineageDecodeError(ValueError):
    """The bytes are not a lineage blob (truncated, another object, or a layout this code cannot read)."""


_decoder = msgspec.json.Decoder(Lineage)


def encode_lineage(lineage: Lineage) -> bytes:
    return msgspec.json.encode(lineage)


def decode_lineage(data: bytes) -> Lineage:
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError too
        raise LineageDecodeError(f"not a lineage blob: {exc}") from exc


def lineage_key(run_id: str, version: int) -> str:
    """Where the lineage of a version lives in the blob store (one object per version, never rewritten)."""
    return f"runs/{run_id}/lineage/v{version:08d}.json"
