"""Dead-lettering one refused message: the DeadLetter event built from the message, and its append.

Every consumer of a stream that meets a poison message dead-letters it, not only the one that would
have handled it: the archiver reads every stream, so garbage on a stream nobody else consumes (or
that nobody consumes right now) still ends on the dead-letter stream within one fetch. Several
consumers refusing the same message append the same dead letter (its business key, and so its
Nats-Msg-Id and its subject, is the message's stream and sequence): the second append is a
duplicate or, where the log keeps one message per dead-letter subject, an `AppendConflict`, and
both mean "already dead-lettered", which is what the caller wanted.
"""

from __future__ import annotations

from nats.aio.msg import Msg

from pipeline.errors import AppendConflict
from pipeline.eventlog import EventLog
from pipeline.logs import get_logger
from pipeline.subjects import policy_subject, subject_for, token
from pipeline.topology import DEADLETTER, POLICY
from schemas import DeadLetter
from schemas.envelope import new_event_id, now_utc

log = get_logger(__name__)


def dead_letter_for(
    msg: Msg, *, stream: str, consumer: str, reason: str, error_class: str, run_id: str | None = None
) -> DeadLetter:
    """The DeadLetter of `msg`: where it was (stream, sequence, subject), who refused it and why, and
    its original bytes and headers. `stream` is a stream's name or label; `run_id` defaults to the run
    token of the message's subject."""
    meta = msg.metadata
    return DeadLetter(
        run_id=run_id or run_of(msg.subject),
        event_id=new_event_id(),
        produced_at=now_utc(),
        reason=reason,
        error_class=error_class,
        stream=stream.lower(),
        consumer=consumer,
        original_subject=msg.subject,
        original_seq=meta.sequence.stream,
        num_delivered=meta.num_delivered,
        payload=bytes(msg.data),
        headers={k: str(v) for k, v in (msg.headers or {}).items()},
    )


async def dead_letter(
    event_log: EventLog,
    msg: Msg,
    *,
    stream: str,
    consumer: str,
    reason: str,
    error_class: str,
    run_id: str | None = None,
) -> bool:
    """Append the dead letter of `msg`. True: this call stored it; False: it was already there (an
    earlier attempt of ours, or another consumer that refused the same message first).

    Raises what `EventLog.append` raises when it could not store it (`LogUnavailable` and the blob
    store's `BlobStoreUnavailable` are transient: keep the message unacked and try again later).
    """
    dead = dead_letter_for(msg, stream=stream, consumer=consumer, reason=reason, error_class=error_class, run_id=run_id)
    try:
        result = await event_log.append(dead)
    except AppendConflict:
        # One dead letter per (stream, seq) is all the log keeps: someone refused this message first.
        await _check_the_letter_there(event_log, dead)
        log.info("already dead-lettered", stream=dead.stream, stream_seq=dead.original_seq, consumer=consumer)
        return False
    if result.duplicate:  # the msg id is the (stream, seq): our earlier attempt, or a planted letter
        await _check_the_letter_there(event_log, dead)
        return False
    log.warning(
        "dead-lettered",
        stream=dead.stream,
        stream_seq=dead.original_seq,
        consumer=consumer,
        error_class=error_class,
        reason=reason,
    )
    return True


async def _check_the_letter_there(event_log: EventLog, ours: DeadLetter) -> None:
    """The letter that took our subject must be a letter of the same message: one that holds other bytes
    was planted (a hostile worker of a role that may dead-letter this stream) to hide the refusal from
    the audit. Logged as an error; the refusal itself was counted by whoever refused."""
    subject = subject_for(ours)
    try:
        there = await event_log.resolve((await event_log.js.get_last_msg(DEADLETTER.name, subject)).data, subject)
    except Exception as exc:  # a check on the way out: it must never turn a refusal into a crash
        log.warning("could not read back the dead letter already at its subject", subject=subject, error=repr(exc))
        return
    if (
        not isinstance(there, DeadLetter)
        or there.payload != ours.payload
        or there.original_subject != ours.original_subject
    ):
        log.error(
            "the dead letter at this subject does not hold the refused message: planted?",
            subject=subject,
            planted_by=getattr(there, "producer", "?"),
            refusal=ours.reason,
        )


def run_of(subject: str) -> str:
    """The run token of `rl.<run>.…`, or `unknown`: a dead letter must never fail on a bad subject."""
    tokens = subject.split(".")
    try:
        return token(tokens[1], "run_id") if len(tokens) > 1 else "unknown"
    except ValueError:
        return "unknown"


async def dead_letter_refused_version(
    event_log: EventLog, *, run_id: str, version: int, event_id: str, reason: str, error_class: str, refused_by: str
) -> bool:
    """Dead-letter a policy version an island refused (its signature, or a blob against its signed
    digest), with the version event's original bytes, so `sprawl audit dead-letters` shows who refused
    what and why. One dead letter per version event (its POLICY stream sequence): the same island
    refusing it again, or a second island, finds it there. True: this call stored it.

    Raises what `EventLog.append` raises when the log does not take it (the island retries later)."""
    subject = policy_subject(run_id, version)
    msg = await event_log.js.get_last_msg(POLICY.name, subject)
    dead = DeadLetter(
        run_id=run_id,
        event_id=new_event_id(),
        produced_at=now_utc(),
        reason=f"policy version {version} (event {event_id}) refused by {refused_by}: {reason}",
        error_class=error_class,
        stream=POLICY.label,
        consumer=refused_by,
        original_subject=subject,
        original_seq=msg.seq,
        num_delivered=1,
        payload=bytes(msg.data or b""),
        headers={k: str(v) for k, v in (msg.headers or {}).items()},
    )
    try:
        result = await event_log.append(dead)
    except AppendConflict:
        await _check_the_letter_there(event_log, dead)
        log.info("refused version already dead-lettered", version=version, stream_seq=msg.seq, refused_by=refused_by)
        return False
    if result.duplicate:  # the msg id is the (stream, seq): our earlier attempt, or a planted letter
        await _check_the_letter_there(event_log, dead)
        return False
    log.warning("refused version dead-lettered", version=version, stream_seq=msg.seq, error_class=error_class)
    return True
