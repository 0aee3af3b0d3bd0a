"""The roles of a run and what each may do with the log's kinds of event: the one source that the
log's permissions (`infra/nats_permissions.py`) and the blob store's (`infra/s3_identities.py`) derive
from, so a role can never append an event whose claim check it may not write, or read one it may not
resolve."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from pipeline.topology import (
    DEADLETTER,
    METRICS,
    POLICY,
    PROMPTS,
    REWARDS,
    STREAMS,
    TRAINER,
    TRAJECTORIES,
    Kind,
    Stream,
)


class Role(StrEnum):
    ADMIN = "admin"
    """The stack and its operator: declares streams (`sprawl infra apply`), drives prompts in `sprawl up`."""
    TRAINER = "trainer"
    SAMPLER = "sampler"
    REWARDS = "rewards"
    ARCHIVER = "archiver"
    AUDITOR = "auditor"


WORKER_ROLES: tuple[Role, ...] = tuple(role for role in Role if role is not Role.ADMIN)
"""The roles with limited grants (the admin may do everything)."""


@dataclass(frozen=True)
class Grant:
    publishes: tuple[Kind, ...]
    """Kinds of event the role appends, in its own run only (and so may claim-check)."""
    reads: tuple[Stream, ...]
    """Streams it reads (and so the kinds whose claim checks it resolves)."""

    @property
    def consumes(self) -> tuple[Kind, ...]:
        return tuple(dict.fromkeys(p.kind for stream in self.reads for p in stream.patterns))


GRANTS: dict[Role, Grant] = {
    # Its own kinds, and prompts: the trainer's cluster owns the run and may drive it (`sprawl up`'s
    # prompt driver runs beside it); dead letters of what its consumers refuse.
    Role.TRAINER: Grant(
        (Kind.POLICY, Kind.TRAINER, Kind.METRICS, Kind.PROMPTS, Kind.DEAD_LETTERS),
        (POLICY, PROMPTS, TRAJECTORIES, REWARDS, TRAINER, METRICS, DEADLETTER),
    ),
    # Samplers dead-letter prompt groups they cannot decode and versions they refuse to serve.
    Role.SAMPLER: Grant((Kind.TRAJECTORIES, Kind.HEARTBEATS, Kind.DEAD_LETTERS), (POLICY, PROMPTS)),
    Role.REWARDS: Grant((Kind.REWARDS, Kind.DEAD_LETTERS), (PROMPTS, TRAJECTORIES)),
    # The archiver writes nothing to the log but the dead letters of the poison it finds on any stream.
    Role.ARCHIVER: Grant((Kind.DEAD_LETTERS,), STREAMS),
    Role.AUDITOR: Grant((), STREAMS),
}
