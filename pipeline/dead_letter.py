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
from pipeline.subjects import token
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
        log.info("already dead-lettered", stream=dead.stream, stream_seq=dead.original_seq, consumer=consumer)
        return False
    if result.duplicate:
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


def run_of(subject: str) -> str:
    """The run token of `rl.<run>.…`, or `unknown`: a dead letter must never fail on a bad subject."""
    tokens = subject.split(".")
    try:
        return token(tokens[1], "run_id") if len(tokens) > 1 else "unknown"
    except ValueError:
        return "unknown"
