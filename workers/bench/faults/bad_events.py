"""Bad events, published as a hostile or careless client would, and where each one ended.

Each class is forged from real events of the run (a trajectory, version 1) so that only the one
thing under test is wrong; forged trajectories get their own trajectory and group ids, so whatever
happens to them is traceable and spoils no real group. Subjects come from `pipeline.subjects`
(`subject_for` of the valid event), except where the subject itself is the forgery.

An outcome is where the event ended, read from the log, never from a worker's say-so:
- `refused`: the server would not store it (the publish raised);
- `dead_letter`: a dead letter for its stream and sequence is in the log (with its reason, and the
  seconds from publishing to the dead letter's storage);
- `acked_without_dead_letter`: every durable consumer that reads it acked it, and none dead-lettered
  it (`effects` says what it did: rewarded, stored twice, ...);
- `stored`: nobody consumes it and it stays in the log (`effects` says what readers now see);
- `pending`: still unacked by some consumer when the watch ended.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime

import nats.js.errors
from nats.js import api

from pipeline.eventlog import CLAIM_CHECK_HEADER, EVENT_TYPE_HEADER, EventLog
from pipeline.subjects import policy_subject, prompts_subject, subject_for
from pipeline.topology import DEADLETTER, STREAMS, Stream, subject_matches
from schemas import ClaimCheck, PolicyVersion, Reward, TrainerMetrics, Trajectory, decode_event, encode_event
from workers.bench.faults.ledger import LoggedMessage, scan_stream

GOOD_OUTCOMES = ("dead_letter", "refused")
"""Where the issue wants every bad event to end (within `GOAL_S`)."""
GOAL_S = 30.0


@dataclass(frozen=True)
class Forged:
    """One bad message: where it goes and its bytes."""

    cls: str
    subject: str
    data: bytes
    headers: dict[str, str] = field(default_factory=dict)
    trajectory_id: str | None = None
    """The trajectory id it carries, when it is a (forged) trajectory: its effects are looked up by it."""
    needs_no_sampler: bool = False
    """Published only once the samplers are stopped (garbage on PROMPTS with no sampler running)."""


@dataclass
class BadEventOutcome:
    cls: str
    outcome: str
    seconds: float | None
    reason: str = ""
    effects: dict = field(default_factory=dict)
    stream: str = ""
    seq: int | None = None

    def summary(self) -> dict:
        return {
            "class": self.cls,
            "outcome": self.outcome,
            "seconds": self.seconds,
            "reason": self.reason,
            "effects": self.effects,
        }


# ---------------------------------------------------------------- forging


def _bad_id(cls: str) -> str:
    return f"bad-{cls.replace('_', '-')}-{uuid.uuid4().hex[:6]}"


def _trajectory_dict(template: Trajectory, cls: str) -> tuple[dict, str]:
    """A valid trajectory with its own ids, as a JSON object, and the subject it belongs on."""
    ident = _bad_id(cls)
    body = json.loads(encode_event(template))
    body |= {"trajectory_id": ident, "group_id": ident, "event_id": uuid.uuid4().hex, "producer": "fault-suite"}
    return body, subject_for(decode_event(json.dumps(body).encode()))


def forge_all(
    run_id: str, trajectory: Trajectory, raw_trajectory: LoggedMessage, v1: PolicyVersion, claims_uri: str
) -> list[Forged]:
    """Every bad-event class of the issue, forged from a real trajectory and the run's version 1.
    `claims_uri`: where the run's own trajectory claims live (`s3://<bucket>/claims/<run>/traj`)."""
    out: list[Forged] = []

    def mutated(cls: str, change) -> None:
        body, subject = _trajectory_dict(trajectory, cls)
        change(body)
        out.append(Forged(cls, subject, json.dumps(body).encode(), trajectory_id=body.get("trajectory_id")))

    body, subject = _trajectory_dict(trajectory, "malformed_json")
    out.append(Forged("malformed_json", subject, json.dumps(body).encode()[:-7], trajectory_id=body["trajectory_id"]))
    mutated("unknown_type", lambda b: b.update(type="no_such_event.v1"))
    mutated("wrong_schema_version", lambda b: b.update(schema_version=7))
    mutated("non_date_produced_at", lambda b: b.update(produced_at="yesterday"))
    mutated("empty_run_id", lambda b: b.update(run_id=""))
    mutated("missing_event_id", lambda b: b.pop("event_id"))
    mutated("body_run_not_subject_run", lambda b: b.update(run_id=f"{run_id}-other"))
    mutated("body_group_not_subject_group", lambda b: b.update(group_id="another-group"))

    def claimed(cls: str, uri: str, size: int) -> None:
        """A claim check standing in for a trajectory that was never stored."""
        body, subject = _trajectory_dict(trajectory, cls)
        claim = ClaimCheck(
            run_id=run_id,
            event_id=body["event_id"],
            producer="fault-suite",
            event_type=Trajectory.type_tag(),
            uri=uri,
            sha256="0" * 64,
            bytes=size,
        )
        headers = {CLAIM_CHECK_HEADER: "1", EVENT_TYPE_HEADER: Trajectory.type_tag()}
        out.append(Forged(cls, subject, encode_event(claim), headers, trajectory_id=body["trajectory_id"]))

    claimed("claim_check_to_missing_bucket", f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/claims/{run_id}/x", 100)
    # Under the run's own claims (so not refused as foreign), saying it holds 300 GiB: refused by its size
    # before any GET. Had a reader tried, the GET would find nothing (the key was never written).
    claimed("claim_check_oversized", f"{claims_uri}/{uuid.uuid4().hex}", 300 << 30)

    second = json.loads(encode_event(v1)) | {"event_id": uuid.uuid4().hex, "producer": "fault-suite"}
    out.append(
        Forged(
            "second_different_v1",
            policy_subject(run_id, 1),
            json.dumps(second).encode(),
            {"Nats-Msg-Id": f"{run_id}:policy.v1.{second['event_id']}"},  # the id a client's append would use
        )
    )
    out.append(
        Forged(
            "republished_trajectory_new_msg_id",
            raw_trajectory.subject,
            raw_trajectory.data,
            {k: v for k, v in raw_trajectory.headers.items() if k != "Nats-Msg-Id"},
            trajectory_id=trajectory.trajectory_id,
        )
    )
    reward_ident = _bad_id("garbage_rewards")
    reward = Reward(
        run_id=run_id,
        trajectory_id=reward_ident,
        group_id=reward_ident,
        value=0.0,
        verifier="fault-suite",
        verifier_version="1",
        duration_s=0.0,
    )
    out.append(Forged("garbage_on_rewards", subject_for(reward), b"\xff\xfe not an event"))
    metrics = TrainerMetrics(run_id=run_id, step=0, version=0, metrics={})
    out.append(Forged("garbage_on_metrics", subject_for(metrics), b"\xff\xfe not an event"))
    out.append(
        Forged(
            "garbage_on_prompts_no_sampler", prompts_subject(run_id), b"\xff\xfe not an event", needs_no_sampler=True
        )
    )
    return out


# ---------------------------------------------------------------- publishing and watching


@dataclass
class Published:
    forged: Forged
    at: datetime
    stream: Stream | None = None
    seq: int | None = None
    refused: str | None = None


async def publish(event_log: EventLog, forged: Forged) -> Published:
    """Publish as a raw client would: its own Nats-Msg-Id, no fence."""
    headers = {"Nats-Msg-Id": f"fault-suite:{forged.cls}:{uuid.uuid4().hex}", **forged.headers}
    at = datetime.now(UTC)
    try:
        ack = await event_log.js.publish(forged.subject, forged.data, headers=headers, timeout=10.0)
    except nats.js.errors.APIError as exc:
        return Published(forged, at, refused=f"{exc.err_code}: {exc.description}")
    stream = next(s for s in STREAMS if s.name == ack.stream)
    if ack.duplicate:
        return Published(forged, at, stream, ack.seq, refused="deduplicated by the server (same msg id)")
    return Published(forged, at, stream, ack.seq)


async def _readers(event_log: EventLog, stream: Stream, subject: str) -> list[api.ConsumerInfo]:
    """The durable, acking consumers on `stream` whose filter covers `subject` (replays do not ack)."""
    infos = await event_log.js.consumers_info(stream.name)
    out = []
    for info in infos:
        config = info.config
        if config.ack_policy == api.AckPolicy.NONE or not config.durable_name:
            continue
        filters = list(config.filter_subjects or []) or [config.filter_subject or ">"]
        if any(subject_matches(f, subject) for f in filters):
            out.append(info)
    return out


async def watch(event_log: EventLog, published: list[Published], guard_s: float) -> list[BadEventOutcome]:
    """Until each bad event has ended somewhere (or `guard_s` has passed): its outcome."""
    outcomes: dict[str, BadEventOutcome] = {}
    for p in published:
        if p.refused is not None:
            outcomes[p.forged.cls] = BadEventOutcome(p.forged.cls, "refused", 0.0, p.refused)
    deadline = time.monotonic() + guard_s
    while True:
        letters = {
            (m.event.stream, m.event.original_seq): m
            for m in await scan_stream(event_log, DEADLETTER, None)
            if m.event is not None and hasattr(m.event, "original_seq")
        }
        for p in published:
            if p.forged.cls in outcomes:
                continue
            letter = letters.get((p.stream.label, p.seq))
            if letter is not None:
                dead = letter.event
                outcomes[p.forged.cls] = BadEventOutcome(
                    p.forged.cls,
                    "dead_letter",
                    round((letter.stored_at - p.at).total_seconds(), 2),
                    f"{dead.error_class}: {dead.reason[:200]} (consumer {dead.consumer})",
                )
                continue
            readers = await _readers(event_log, p.stream, p.forged.subject)
            acked_by = [r.name for r in readers if r.ack_floor.stream_seq >= p.seq]
            if readers and len(acked_by) == len(readers):
                outcomes[p.forged.cls] = BadEventOutcome(
                    p.forged.cls,
                    "acked_without_dead_letter",
                    round((datetime.now(UTC) - p.at).total_seconds(), 1),
                    f"acked by {', '.join(sorted(acked_by))}",
                )
            elif not readers:
                outcomes[p.forged.cls] = BadEventOutcome(p.forged.cls, "stored", None, "no durable consumer reads it")
        if len(outcomes) == len(published) or time.monotonic() > deadline:
            break
        await asyncio.sleep(1.0)
    for p in published:
        if p.forged.cls not in outcomes:
            readers = await _readers(event_log, p.stream, p.forged.subject)
            waiting = [r.name for r in readers if r.ack_floor.stream_seq < p.seq]
            outcomes[p.forged.cls] = BadEventOutcome(
                p.forged.cls, "pending", None, f"unacked after {guard_s:.0f}s by {', '.join(sorted(waiting))}"
            )
        outcome = outcomes[p.forged.cls]
        outcome.stream, outcome.seq = (p.stream.label if p.stream else ""), p.seq
    return [outcomes[p.forged.cls] for p in published]


async def effects(
    event_log: EventLog, run_id: str, published: list[Published], outcomes: list[BadEventOutcome]
) -> None:
    """What the accepted ones did: rewards for forged trajectories (in any run), copies stored, which
    v1 readers now see."""
    from pipeline.topology import POLICY, REWARDS, TRAJECTORIES

    rewards = [m.event for m in await scan_stream(event_log, REWARDS, None) if isinstance(m.event, Reward)]
    trajectories = [m for m in await scan_stream(event_log, TRAJECTORIES, run_id) if isinstance(m.event, Trajectory)]
    by_cls = {o.cls: o for o in outcomes}
    for p in published:
        outcome = by_cls[p.forged.cls]
        ident = p.forged.trajectory_id
        if ident is not None:
            runs = [r.run_id for r in rewards if r.trajectory_id == ident]
            if runs:
                outcome.effects["rewards"] = len(runs)
                outcome.effects["reward_runs"] = sorted(set(runs))
            copies = sum(1 for m in trajectories if m.event.trajectory_id == ident)
            if copies > 1:
                outcome.effects["stored_copies"] = copies
        if p.forged.cls == "second_different_v1":
            policy = [m for m in await scan_stream(event_log, POLICY, run_id) if m.subject == p.forged.subject]
            outcome.effects["v1_messages"] = len(policy)
            if policy and policy[-1].event is not None:
                outcome.effects["readers_see_forged_v1"] = policy[-1].event.producer == "fault-suite"
