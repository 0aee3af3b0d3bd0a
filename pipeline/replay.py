"""Replay a stream from a sequence or a time: how projections are rebuilt.

Uses an ephemeral, ack-less consumer that is deleted when the replay ends;
durable cursors stay with the workers that own them.

A replay ends only when the server says the stream has nothing more for it: a
fetch that times out while messages are still pending raises LogUnavailable
(retry later) instead of ending the replay early, so a projection is never
rebuilt from a silently truncated history.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime

import nats.errors
from nats.js import api

from pipeline.errors import LogUnavailable, PoisonEvent
from pipeline.eventlog import NO_ANSWER, EventLog
from pipeline.logs import get_logger
from schemas import Event

log = get_logger(__name__)


@dataclass(frozen=True)
class Replayed:
    stream_seq: int
    subject: str
    event: Event


@contextlib.asynccontextmanager
async def _ephemeral(event_log: EventLog, stream: str, subject_filter: str, **deliver) -> AsyncIterator:
    """An ack-less, in-memory consumer that is deleted when the caller is done with it."""
    config = api.ConsumerConfig(
        ack_policy=api.AckPolicy.NONE,
        filter_subject=subject_filter,
        inactive_threshold=120.0,
        mem_storage=True,
        num_replicas=1,
        **deliver,
    )
    try:
        sub = await event_log.js.pull_subscribe(subject_filter, durable=None, stream=stream, config=config)
        info = await sub.consumer_info()
    except NO_ANSWER as exc:
        raise LogUnavailable(f"opening a replay of {subject_filter} on {stream}", exc) from exc
    try:
        yield sub, info
    finally:
        # Best effort: when the server is gone the consumer goes with it (in-memory), or is reaped
        # after `inactive_threshold`; a failed cleanup must not hide the error that ended the replay.
        with contextlib.suppress(nats.errors.Error, TimeoutError):
            await sub.unsubscribe()
        with contextlib.suppress(nats.errors.Error, TimeoutError):
            await event_log.js.delete_consumer(stream, info.name)


async def _decoded(event_log: EventLog, msg) -> Replayed | None:
    """The message as an event, or None (logged) for one that cannot decode: it was dead-lettered when
    first consumed."""
    try:
        event = await event_log.resolve(msg.data, subject=msg.subject)
    except PoisonEvent as exc:
        log.warning("skipped an undecodable event", stream_seq=msg.metadata.sequence.stream, reason=exc.message)
        return None
    return Replayed(msg.metadata.sequence.stream, msg.subject, event)


async def replay(
    event_log: EventLog,
    stream: str,
    subject_filter: str,
    *,
    start_seq: int | None = None,
    start_time: datetime | None = None,
    batch: int = 256,
    fetch_timeout_s: float = 5.0,
) -> AsyncIterator[Replayed]:
    """Yield every event on `subject_filter` from `start_seq` (or `start_time`, or the start) to the
    current end of the stream.

    Raises LogUnavailable (a TransientError) when the server stops answering before the end: a
    timeout is never taken for the end of the stream."""
    if start_seq is not None:
        deliver = {"deliver_policy": api.DeliverPolicy.BY_START_SEQUENCE, "opt_start_seq": start_seq}
    elif start_time is not None:
        deliver = {"deliver_policy": api.DeliverPolicy.BY_START_TIME, "opt_start_time": start_time.isoformat()}
    else:
        deliver = {"deliver_policy": api.DeliverPolicy.ALL}
    async with _ephemeral(event_log, stream, subject_filter, **deliver) as (sub, info):
        remaining = info.num_pending
        while remaining > 0:
            try:
                msgs = await sub.fetch(min(batch, remaining), timeout=fetch_timeout_s)
            except NO_ANSWER as exc:
                what = f"replaying {subject_filter} on {stream} with {remaining} messages still pending"
                if await _pending_on_the_servers_word(sub, what, exc):
                    raise LogUnavailable(what, exc) from exc
                break  # the server says they are gone (aged out of a LIMITS stream mid-replay)
            for msg in msgs:
                remaining = msg.metadata.num_pending
                if (item := await _decoded(event_log, msg)) is not None:
                    yield item


async def _pending_on_the_servers_word(sub, what: str, timeout: BaseException) -> int:
    """After a fetch got no answer: how many messages the server still holds for this consumer.
    No answer to that either raises LogUnavailable: silence is not "none left"."""
    try:
        info = await sub.consumer_info()
    except NO_ANSWER as exc:
        raise LogUnavailable(what, timeout) from exc
    return info.num_pending


async def tail_messages(
    event_log: EventLog,
    stream: str,
    subject_filter: str,
    start_seq: int,
    stop: asyncio.Event,
    *,
    batch: int = 256,
    idle_timeout_s: float = 0.5,
) -> AsyncIterator:
    """The raw messages of a live feed, for readers that only glance at a few fields of busy streams."""
    deliver = {"deliver_policy": api.DeliverPolicy.BY_START_SEQUENCE, "opt_start_seq": max(start_seq, 1)}
    async with _ephemeral(event_log, stream, subject_filter, **deliver) as (sub, _):
        while not stop.is_set():
            try:
                msgs = await sub.fetch(batch, timeout=idle_timeout_s)
            except TimeoutError:  # nats-py raises its own subclass or a bare asyncio timeout
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    # nats-py's fetch can turn our cancellation into a timeout: do not swallow it.
                    raise asyncio.CancelledError from None
                continue
            for msg in msgs:
                yield msg


async def tail(
    event_log: EventLog, stream: str, subject_filter: str, start_seq: int, stop: asyncio.Event, **fetch
) -> AsyncIterator[Replayed]:
    """Like `replay`, but keeps following the stream until `stop` is set (a projection's live feed).
    `fetch`: `batch` and `idle_timeout_s`, as for `tail_messages`."""
    async for msg in tail_messages(event_log, stream, subject_filter, start_seq, stop, **fetch):
        if (item := await _decoded(event_log, msg)) is not None:
            yield item
