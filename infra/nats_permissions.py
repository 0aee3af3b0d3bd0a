"""What each role may do on the log: subjects it publishes, streams it reads, JetStream API it calls.

Derived from the topology (`pipeline/topology.py`), so a new stream or kind is granted in one place.
Publishing is scoped to the role's own kinds of its own run (`rl.<run>.traj.>` for a sampler); no
role but `admin` may create, change, purge or delete a stream. Reading is granted per stream: the
JetStream API calls that read (consumer create/info/next, message get, stream info) name the stream
in their subject, and for a consumer created with a single filter also the filter, but message gets
and stream info carry the subject in their body, so a reader of a stream can read every run in it
(one stream holds all runs). Runs that must not see each other belong on separate accounts or servers.

Replies come back on the client's inbox; each identity gets its own inbox prefix (`nats.inbox_prefix`)
and may subscribe only there, so one island cannot read the replies (and pushed messages) of another.
"""

from __future__ import annotations

from infra.nats_auth import Permissions
from infra.roles import GRANTS, Role
from pipeline.topology import (
    STREAMS,
    SUBJECT_ROOT,
    ConsumerRole,
    Kind,
    Stream,
    consumers_of_run,
    follower_name,
    token,
)


def inbox_prefix(role: Role | str, identity: str) -> str:
    """The reply-subject prefix of one identity: `_INBOX_<role>_<id>`, one token."""
    return f"_INBOX_{Role(role).value}_{token(identity, 'identity')}"


def _reading(stream: Stream, run: str) -> list[str]:
    s = stream.name
    return [
        f"$JS.API.STREAM.INFO.{s}",
        f"$JS.API.STREAM.MSG.GET.{s}",
        f"$JS.API.DIRECT.GET.{s}",
        f"$JS.API.DIRECT.GET.{s}.{SUBJECT_ROOT}.{run}.>",
        # Ephemeral and ordered consumers (no name in the subject) and named ones with one filter of this run.
        f"$JS.API.CONSUMER.CREATE.{s}",
        f"$JS.API.CONSUMER.CREATE.{s}.*",
        f"$JS.API.CONSUMER.CREATE.{s}.*.{SUBJECT_ROOT}.{run}.>",
        f"$JS.API.CONSUMER.DURABLE.CREATE.{s}.*",
        f"$JS.API.CONSUMER.INFO.{s}.*",
        f"$JS.API.CONSUMER.DELETE.{s}.*",
        f"$JS.API.CONSUMER.MSG.NEXT.{s}.*",
        f"$JS.ACK.{s}.>",
        f"$JS.FC.{s}.>",
    ]


# The role that binds each declared consumer; every other role is kept off it.
_BINDS = {ConsumerRole.SAMPLERS: Role.SAMPLER, ConsumerRole.REWARDS: Role.REWARDS, ConsumerRole.ARCHIVER: Role.ARCHIVER}


def _others_durables(role: Role, run: str) -> list[str]:
    """A role may read a stream without touching the cursors other roles share on it: pulling from the
    archiver's consumer and acking would take messages out of the archive, deleting the samplers' would
    stop the run, re-creating one with another filter would blind whoever binds it."""
    denied = []
    for consumer in consumers_of_run(run):
        s, name = consumer.stream.name, consumer.name
        # Declared by the admin (`sprawl infra apply`) and bound by workers, never created by them: a
        # "create" of an existing name is an update (another filter, a later start), so it is denied too.
        denied += [
            f"$JS.API.CONSUMER.DELETE.{s}.{name}",
            f"$JS.API.CONSUMER.CREATE.{s}.{name}",
            f"$JS.API.CONSUMER.CREATE.{s}.{name}.>",
            f"$JS.API.CONSUMER.DURABLE.CREATE.{s}.{name}",
        ]
        if _BINDS[consumer.role] is not role:
            denied += [f"$JS.API.CONSUMER.MSG.NEXT.{s}.{name}", f"$JS.ACK.{s}.{name}.>"]
    if role is not Role.TRAINER:
        # The trainer's feeds: re-filtered, its trainer would see an idle feed and train on nothing. (A reward
        # worker's prompt feed has a random name, and no role but the admin may list consumer names.)
        for stream in STREAMS:
            name = follower_name(run, "trainer", stream)
            denied += [
                f"$JS.API.CONSUMER.{op}.{stream.name}.{name}"
                for op in ("CREATE", "DURABLE.CREATE", "DELETE", "MSG.NEXT")
            ]
            denied += [f"$JS.API.CONSUMER.CREATE.{stream.name}.{name}.>", f"$JS.ACK.{stream.name}.{name}.>"]
    return denied


def permissions_for(role: Role | str, run_id: str, inbox: str) -> Permissions:
    """The NATS permissions of `role` in run `run_id`, replies on `inbox` (see `inbox_prefix`)."""
    role = Role(role)
    if role is Role.ADMIN:
        return Permissions(publish=(">",), subscribe=(">",))
    run = token(run_id, "run_id")
    grant = GRANTS[role]
    publish = ["$JS.API.INFO", "$JS.API.STREAM.NAMES"]
    for kind in grant.publishes:
        if kind is Kind.DEAD_LETTERS:
            # Only of messages it reads (`rl.<run>.deadletter.<stream>.<seq>`): a sampler cannot plant a
            # letter where a trajectory's or a reward's refusal will have to go.
            publish += [f"{SUBJECT_ROOT}.{run}.{kind.value}.{stream.label}.>" for stream in grant.reads]
            continue
        publish += [f"{SUBJECT_ROOT}.{run}.{kind.value}", f"{SUBJECT_ROOT}.{run}.{kind.value}.>"]
    for stream in grant.reads:
        publish += _reading(stream, run)
    for stream in STREAMS:
        if stream not in grant.reads and any(p.kind in grant.publishes for p in stream.patterns):
            # Reading back what it appends: whether its event is already there (a restarted worker's
            # idempotency check, a publish that timed out), by stream info and message get.
            publish += [f"$JS.API.STREAM.INFO.{stream.name}", f"$JS.API.STREAM.MSG.GET.{stream.name}"]
    # Live notifications of what it may read anyway (an island hears of a new version at once).
    live = [subject for stream in grant.reads for subject in stream.run_subjects(run)]
    return Permissions(
        publish=tuple(dict.fromkeys(publish)),
        subscribe=(f"{inbox}.>", *live),
        deny_publish=tuple(_others_durables(role, run)),
    )
