"""The log's topology as data: the subject grammar, every stream, every durable consumer of a run.

One source for each name: `infra/streams.py` applies these declarations (NATS API configs,
idempotently) and every worker names streams, subjects and consumers through them, so renaming
a stream or a consumer is one edit here, not a hunt for string literals. Subjects of single
events are built from the same grammar in `pipeline/subjects.py`.

    POLICY.name                                   -> "POLICY"
    trajectories_filter(run)                      -> "rl.<run>.traj.>"
    group_trajectories_filter(run, group)         -> "rl.<run>.traj.<group>.*"
    consumer_for(run, ConsumerRole.SAMPLERS)      -> RunConsumer(name="<run>-samplers", stream=PROMPTS, ...)
    consumer_for(run, ConsumerRole.ARCHIVER, TRAJECTORIES).name -> "<run>-archiver-trajectories"
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

# ---------------------------------------------------------------- subject grammar

SUBJECT_ROOT = "rl"
"""First token of every subject: `rl.<run>.<kind>[.<qualifier>]`."""
ANY_RUN = "*"
"""The run token of a stream's subjects: one stream holds every run."""

_TOKEN = re.compile(r"^[a-z0-9][a-z0-9_-]*$")


class Kind(StrEnum):
    """The `<kind>` token of a subject: what sort of event travels there."""

    POLICY = "policy"
    PROMPTS = "prompts"
    TRAJECTORIES = "traj"
    REWARDS = "reward"
    METRICS = "metrics"
    HEARTBEATS = "heartbeat"
    DEAD_LETTERS = "deadletter"
    TRAINER = "trainer"


@functools.lru_cache(maxsize=4096)  # run and group ids repeat; append is on the hot path
def token(value: str, what: str) -> str:
    """Validate one subject token; ids become tokens, so a dot or space would split or break a subject."""
    lowered = value.lower()
    if not _TOKEN.fullmatch(lowered):  # fullmatch: `$` alone would accept a trailing newline
        raise ValueError(
            f"{what} {value!r} cannot be a subject token: use letters, digits, '_' or '-' "
            "(no dots, spaces or wildcards)"
        )
    return lowered


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching, as the server does it: `*` is one token, `>` one or more trailing tokens."""
    want, have = pattern.split("."), subject.split(".")
    for i, part in enumerate(want):
        if part == ">":
            return len(have) > i
        if i >= len(have) or (part != "*" and part != have[i]):
            return False
    return len(want) == len(have)


def run_subject(run: str, kind: Kind, *qualifiers: str) -> str:
    """`rl.<run>.<kind>[.<qualifier>...]`; `run` is a validated token or ANY_RUN, qualifiers are already tokens."""
    return ".".join((SUBJECT_ROOT, run, kind.value, *qualifiers))


Qualifier = Literal["", "*", ">"]


@dataclass(frozen=True)
class SubjectPattern:
    """The subjects of one kind: `""` the bare kind, `"*"` exactly one qualifier, `">"` one or more."""

    kind: Kind
    qualifier: Qualifier = ">"

    def for_run(self, run_id: str) -> str:
        run = ANY_RUN if run_id == ANY_RUN else token(run_id, "run_id")
        return run_subject(run, self.kind, *([self.qualifier] if self.qualifier else []))


# ---------------------------------------------------------------- streams


class Dedup(StrEnum):
    """Which dedup window of `StreamSettings` a stream uses."""

    EVENTS = "events"
    """`duplicate_window_s`: covers a publisher's retries."""
    POLICY = "policy"
    """`policy_duplicate_window_s`: versions are rare and must never double."""


@dataclass(frozen=True)
class Stream:
    """One stream: one retention class, holding its kinds of subjects for every run."""

    name: str
    patterns: tuple[SubjectPattern, ...]
    description: str
    deny_delete: bool = False
    deny_purge: bool = False
    dedup: Dedup = Dedup.EVENTS
    retention: Literal["limits"] = "limits"
    """The only choice: WORK_QUEUE or INTEREST retention would delete history, and the log *is* the run."""
    replicas: int | None = None
    """None: `StreamSettings.replicas` (1 locally, 3 on a cluster); a number pins this stream."""
    one_message_per_subject: bool = False
    """The server keeps at most one message per subject and refuses the next one (discard new per
    subject). For streams whose subjects name one logical id each (a version, a trajectory, a reward,
    a refused message): a second event for the same id is refused at any time, not only within the
    dedup window, whoever publishes it."""

    @property
    def label(self) -> str:
        """The lowercase name: the stream's token in dead-letter subjects and archive file names."""
        return self.name.lower()

    @property
    def subjects(self) -> tuple[str, ...]:
        """What the stream listens to: its patterns for every run."""
        return self.run_subjects(ANY_RUN)

    def run_subjects(self, run_id: str) -> tuple[str, ...]:
        """This stream's subjects of one run."""
        return tuple(p.for_run(run_id) for p in self.patterns)

    def run_filter(self, run_id: str) -> str:
        """One filter subject for everything of one run in this stream: `rl.<run>.>`. Within a stream
        that holds only its own kinds this matches exactly `run_subjects(run_id)`."""
        return f"{SUBJECT_ROOT}.{token(run_id, 'run_id')}.>"


_POLICY_VERSIONS = SubjectPattern(Kind.POLICY, "*")  # rl.<run>.policy.v<N>
_PROMPT_GROUPS = SubjectPattern(Kind.PROMPTS, "")  # rl.<run>.prompts
_TRAJECTORIES = SubjectPattern(Kind.TRAJECTORIES)  # rl.<run>.traj.<group>.<trajectory_id>
_REWARDS = SubjectPattern(Kind.REWARDS)  # rl.<run>.reward.<group>.<trajectory_id>

POLICY = Stream(
    "POLICY",
    (_POLICY_VERSIONS,),
    "policy version chain (create-only, never deleted)",
    deny_delete=True,
    deny_purge=True,
    dedup=Dedup.POLICY,
    one_message_per_subject=True,
)
PROMPTS = Stream("PROMPTS", (_PROMPT_GROUPS, SubjectPattern(Kind.PROMPTS)), "prompt groups to sample")
TRAJECTORIES = Stream(
    "TRAJECTORIES", (_TRAJECTORIES,), "sampled trajectories, one subject per trajectory", one_message_per_subject=True
)
REWARDS = Stream("REWARDS", (_REWARDS,), "rewards, one subject per trajectory", one_message_per_subject=True)
METRICS = Stream(
    "METRICS", (SubjectPattern(Kind.METRICS), SubjectPattern(Kind.HEARTBEATS)), "trainer metrics and island heartbeats"
)
DEADLETTER = Stream(
    "DEADLETTER",
    (SubjectPattern(Kind.DEAD_LETTERS),),  # rl.<run>.deadletter.<stream>.<original_seq>
    "messages consumers refused, with reasons, one subject per refused message",
    one_message_per_subject=True,
)
TRAINER = Stream("TRAINER", (SubjectPattern(Kind.TRAINER),), "trainer checkpoints, leases and dropped groups")

STREAMS: tuple[Stream, ...] = (POLICY, PROMPTS, TRAJECTORIES, REWARDS, METRICS, DEADLETTER, TRAINER)
"""One stream per retention class."""


def stream_named(name: str) -> Stream:
    """The declared stream called `name` (case-insensitive, so a dead letter's label resolves too)."""
    for stream in STREAMS:
        if stream.name == name.upper():
            return stream
    raise KeyError(f"no stream {name!r} is declared; streams: {', '.join(s.name for s in STREAMS)}")


def policy_filter(run_id: str) -> str:
    """All versions of a run's chain: the fence for create-only version appends."""
    return _POLICY_VERSIONS.for_run(run_id)


def prompts_filter(run_id: str) -> str:
    """A run's prompt groups (the bare `prompts` subject)."""
    return _PROMPT_GROUPS.for_run(run_id)


def trajectories_filter(run_id: str) -> str:
    return _TRAJECTORIES.for_run(run_id)


def rewards_filter(run_id: str) -> str:
    return _REWARDS.for_run(run_id)


def group_trajectories_filter(run_id: str, group_id: str) -> str:
    """The trajectories of one prompt group, one subject each: count its subjects to know how many of the
    group's trajectories the log holds (`pipeline.log_lookup.count_subjects`)."""
    return run_subject(token(run_id, "run_id"), Kind.TRAJECTORIES, token(group_id, "group_id"), "*")


def group_rewards_filter(run_id: str, group_id: str) -> str:
    """The rewards of one prompt group, one subject per trajectory."""
    return run_subject(token(run_id, "run_id"), Kind.REWARDS, token(group_id, "group_id"), "*")


# ---------------------------------------------------------------- durable consumers


class ConsumerRole(StrEnum):
    """Who binds a consumer; also the middle of its name, `<run>-<role>[-<stream>]`."""

    SAMPLERS = "samplers"
    """Sampler islands, sharing one cursor over prompt groups (each group goes to one island)."""
    REWARDS = "rewards"
    """Reward workers, sharing one cursor over trajectories."""
    ARCHIVER = "archiver"
    """The archiver: one consumer per stream, every event."""


@dataclass(frozen=True)
class RunConsumer:
    """A durable consumer of one run, as declared: what infra creates and a worker binds."""

    name: str
    role: ConsumerRole
    stream: Stream
    filter_subjects: tuple[str, ...]
    description: str
    ack_wait_s: float | None = None
    max_deliver: int | None = None
    backoff_s: tuple[float, ...] | None = None
    max_ack_pending: int | None = None
    """None (each of these four): the value of `StreamSettings`."""


@dataclass(frozen=True)
class DurableConsumer:
    """A consumer every run has; names carry the run so runs never share a cursor."""

    role: ConsumerRole
    stream: Stream
    description: str
    patterns: tuple[SubjectPattern, ...] | None = None
    """What it reads of its stream; None: all of the run's subjects there."""
    per_stream: bool = False
    """The role has one consumer per stream, so the stream's label ends the name."""
    ack_wait_s: float | None = None
    max_deliver: int | None = None
    backoff_s: tuple[float, ...] | None = None
    max_ack_pending: int | None = None

    def name(self, run_id: str) -> str:
        base = f"{token(run_id, 'run_id')}-{self.role.value}"
        return f"{base}-{self.stream.label}" if self.per_stream else base

    def for_run(self, run_id: str) -> RunConsumer:
        patterns = self.patterns if self.patterns is not None else self.stream.patterns
        return RunConsumer(
            name=self.name(run_id),
            role=self.role,
            stream=self.stream,
            filter_subjects=tuple(p.for_run(run_id) for p in patterns),
            description=self.description,
            ack_wait_s=self.ack_wait_s,
            max_deliver=self.max_deliver,
            backoff_s=self.backoff_s,
            max_ack_pending=self.max_ack_pending,
        )


ARCHIVER_MAX_ACK_PENDING = 20_000
"""The archiver acks a whole Parquet file's worth of events at once, after the PUT."""

CONSUMERS: tuple[DurableConsumer, ...] = (
    DurableConsumer(ConsumerRole.SAMPLERS, PROMPTS, "sampler islands share prompt groups", patterns=(_PROMPT_GROUPS,)),
    DurableConsumer(ConsumerRole.REWARDS, TRAJECTORIES, "reward workers"),
    *(
        DurableConsumer(
            ConsumerRole.ARCHIVER,
            stream,
            f"archiver: every event of {stream.name}",
            per_stream=True,
            max_ack_pending=ARCHIVER_MAX_ACK_PENDING,
            # Every message must reach the archive, however often a crashing archiver was handed it: no
            # delivery limit (poison is archived as undecodable and dead-lettered, never left behind).
            max_deliver=-1,
        )
        for stream in STREAMS
    ),
)
"""Every durable consumer of a run that `sprawl infra apply` declares. Long-lived readers that start
from a position they keep themselves (the trainer's feeds, the reward worker's prompt projection)
create their own named consumers (`follower_name`), so they have none here."""


def consumers_of_run(run_id: str) -> tuple[RunConsumer, ...]:
    return tuple(c.for_run(run_id) for c in CONSUMERS)


def follower_name(run_id: str, reader: str, stream: Stream) -> str:
    """`<run>-<reader>-<stream label>`: the durable consumer a long-lived reader (the trainer's feeds,
    the reward worker's prompt projection) creates and re-creates itself, from the position it keeps.

    Not declared in CONSUMERS: its start position is the reader's own (a checkpoint, a projection's
    high-water mark), which `sprawl infra apply` cannot know. Named, not ephemeral, so that it survives
    a nats-server restart and the reader binds the same cursor again instead of losing its feed."""
    return f"{token(run_id, 'run_id')}-{token(reader, 'reader')}-{stream.label}"


def consumer_for(run_id: str, role: ConsumerRole | str, stream: Stream | None = None) -> RunConsumer:
    """The consumer a role binds in a run; `stream` picks one of a per-stream role's consumers."""
    role = ConsumerRole(role)
    found = [c for c in CONSUMERS if c.role == role and (stream is None or c.stream == stream)]
    if len(found) != 1:
        where = f" on {stream.name}" if stream is not None else ""
        raise LookupError(
            f"{len(found)} consumers of role {role.value}{where} are declared; "
            + ("name the stream" if found else "declare it in pipeline/topology.py")
        )
    return found[0].for_run(run_id)


_RETIRED: tuple[tuple[Stream, str], ...] = (
    # Declared for the trainer, which follows both streams from its own checkpointed positions instead.
    (TRAJECTORIES, "trainer-traj"),
    (REWARDS, "trainer-rewards"),
)


def retired_consumers(run_id: str) -> tuple[tuple[Stream, str], ...]:
    """(stream, name) of consumers an older topology declared and no worker binds: apply removes them."""
    run = token(run_id, "run_id")
    return tuple((stream, f"{run}-{suffix}") for stream, suffix in _RETIRED)
