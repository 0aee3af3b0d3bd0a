"""Reading the log from a position: replays that rebuild a projection, and live feeds that follow one.

A replay uses an ephemeral, ack-less consumer that is deleted when the replay ends. It ends only when
the server says the stream has nothing more for it: a fetch that times out while messages are still
pending raises LogUnavailable (retry later) instead of ending the replay early, so a projection is
never rebuilt from a silently truncated history.

A live feed (`Follower`, `tail`) reads through a named consumer that its reader creates from its own
position and creates again when the server loses it, so it outlives a nats-server restart or outage;
durable work cursors stay with the workers that own them (`pipeline/consumer.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import api

from pipeline.errors import LogUnavailable, PoisonEvent, StreamNotDeclared
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


async def decoded(event_log: EventLog, msg: Msg) -> Replayed | None:
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
                if (item := await decoded(event_log, msg)) is not None:
                    yield item


async def _pending_on_the_servers_word(sub, what: str, timeout: BaseException) -> int:
    """After a fetch got no answer: how many messages the server still holds for this consumer.
    No answer to that either raises LogUnavailable: silence is not "none left"."""
    try:
        info = await sub.consumer_info()
    except NO_ANSWER as exc:
        raise LogUnavailable(what, timeout) from exc
    return info.num_pending


# ---------------------------------------------------------------- live feeds

FOLLOWER_INACTIVE_THRESHOLD_S = 300.0
"""A follower's consumer that nobody pulls from for this long (its reader was killed) is reaped by the
server. Longer than any outage a reader rides out, so a live reader finds its consumer again."""

OUTAGE_WARNING_EVERY_S = 10.0
"""While the log does not answer, a follower repeats its warning (with how long it has lasted) this often."""


class Follower:
    """A live feed of `subject_filter` on `stream`, from `start_seq` on, until `stop` is set.

    It reads through a named consumer that it creates itself from its own position (file storage, so a
    server restarted from its store still has it; no acks, since the reader keeps its position; an
    inactive threshold, so the consumer of a killed reader is reaped). The position is the reader's:
    `next_seq` moves past a message only once the reader asks for the one after it.

    A server that loses the consumer (a restart, a deletion) or messages delivered into a broken
    connection never end or silently stall the feed: the consumer is re-created from `next_seq`. A
    loss is detected, not guessed: the server says the consumer is not found, a delivery skips a
    consumer sequence, or two fetches in a row come back empty while the server says it holds
    messages for us. A log that does not answer is waited out for as long as it takes, with a warning
    repeated every `OUTAGE_WARNING_EVERY_S` saying how long it has lasted, and the feed resumes by
    itself (from `next_seq`, on a re-created consumer) when the server answers again.
    """

    def __init__(
        self,
        event_log: EventLog,
        stream: str,
        subject_filter: str,
        start_seq: int,
        name: str,
        *,
        batch: int = 256,
        idle_timeout_s: float = 0.5,
        inactive_threshold_s: float = FOLLOWER_INACTIVE_THRESHOLD_S,
    ):
        self.log = event_log
        self.stream = stream
        self.subject_filter = subject_filter
        self.name = name
        self.batch = batch
        self.idle_timeout_s = idle_timeout_s
        self.inactive_threshold_s = inactive_threshold_s
        self.next_seq = max(start_seq, 1)
        """The first stream sequence the reader has not taken yet; where a re-created consumer starts."""
        self.recreated = 0
        """How often the consumer was created again, after a loss or an outage (the first creation does not count)."""
        self._created_once = False
        self._missing_since: float | None = None
        self.down_since: float | None = None
        """Monotonic time since which the log has not answered; None while it answers."""
        self._sub = None
        self._consumer_seq = 0
        self._suspect = False
        self._warned_at = 0.0
        self._retry_delay_s = 0.5

    async def messages(self, stop: asyncio.Event) -> AsyncIterator[Msg]:
        """The raw messages (for readers that glance at a few fields of busy streams)."""
        try:
            while not stop.is_set():
                for msg in await self._next_batch(stop):
                    yield msg
                    self.next_seq = msg.metadata.sequence.stream + 1
        finally:
            await self._drop_consumer(delete=True)

    async def events(self, stop: asyncio.Event) -> AsyncIterator[Replayed]:
        """The decoded events; one that cannot decode is skipped (it was dead-lettered when consumed)."""
        async for msg in self.messages(stop):
            if (item := await decoded(self.log, msg)) is not None:
                yield item

    # ------------------------------------------------------------ fetching

    async def _next_batch(self, stop: asyncio.Event) -> list[Msg]:
        while not stop.is_set():
            if self.log.nc.is_closed:
                raise LogUnavailable(f"following {self.subject_filter} on {self.stream}", "the connection is closed")
            if self._sub is None and not await self._created(stop):
                continue
            assert self._sub is not None
            try:
                msgs = await self._sub.fetch(self.batch, timeout=self.idle_timeout_s)
            except TimeoutError:  # nats-py raises its own subclass or a bare asyncio timeout
                _raise_if_cancelled()
                if await self._idle_or_lost(stop):
                    return []
                continue
            except (*NO_ANSWER, nats.errors.Error) as exc:
                _raise_if_cancelled()
                await self._after_failed_fetch(exc, stop)
                continue
            self._answered()
            return await self._in_order(msgs)
        return []

    async def _created(self, stop: asyncio.Event) -> bool:
        """Create the consumer; False (after waiting) when the log did not answer. A stream the server
        does not have, or a config it refuses, raises: waiting would never fix those."""
        try:
            await self._create()
        except nats.js.errors.NotFoundError as exc:
            if not self._created_once:
                raise StreamNotDeclared(self.subject_filter) from exc  # never there: a configuration error
            if self._missing_since is None:
                self._missing_since = time.monotonic()
            if time.monotonic() - self._missing_since >= self.log.settings.stream_missing_grace_s:
                raise StreamNotDeclared(self.subject_filter) from exc
            # a restarted server still restoring its streams (LogSettings.stream_missing_grace_s)
            await self._wait_out(
                exc, stop, "the server says the stream is missing; the feed waits in case it is restoring it"
            )
            return False
        except (*NO_ANSWER, nats.js.errors.ServiceUnavailableError, nats.errors.NoRespondersError) as exc:
            _raise_if_cancelled()
            await self._wait_out(exc, stop)
            return False
        self._missing_since = None
        self._answered()
        return True

    async def _idle_or_lost(self, stop: asyncio.Event) -> bool:
        """After a fetch that got nothing: True if the feed is simply idle; False if it had to recover."""
        info = await self._consumer_info(stop)
        if info is None:
            return False
        delivered = info.delivered.consumer_seq if info.delivered is not None else 0
        behind = bool(info.num_pending) or delivered > self._consumer_seq
        if behind and self._suspect:
            # Twice in a row: not a message that arrived just as the fetch gave up.
            await self._lost(
                f"fetches come back empty while the server holds {info.num_pending} pending and has delivered "
                f"up to {delivered} (this reader has {self._consumer_seq})"
            )
            return False
        self._suspect = behind
        return True

    async def _after_failed_fetch(self, exc: BaseException, stop: asyncio.Event) -> None:
        """A fetch that raised: the consumer is gone (re-create it), or the log is away (wait it out)."""
        info = await self._consumer_info(stop)
        if info is not None:  # the server answers and has the consumer: a passing error, try again
            log.warning("follower fetch failed, retrying", stream=self.stream, consumer=self.name, error=repr(exc))
            await _sleep_unless(stop, self._retry_delay_s)

    async def _consumer_info(self, stop: asyncio.Event):
        """The consumer's info; None after handling a lost consumer or a log that did not answer."""
        try:
            info = await self.log.js.consumer_info(self.stream, self.name)
        except nats.js.errors.NotFoundError:
            await self._lost("the server no longer has the consumer")
            return None
        except (*NO_ANSWER, nats.js.errors.ServiceUnavailableError, nats.errors.Error) as exc:
            _raise_if_cancelled()
            await self._wait_out(exc, stop)
            return None
        self._answered()
        return info

    async def _in_order(self, msgs: list[Msg]) -> list[Msg]:
        """The messages up to the first one after a gap in the consumer's sequence; a gap means the
        server delivered messages this reader never received, so the consumer is re-created."""
        kept = []
        for msg in msgs:
            sequence = msg.metadata.sequence
            if sequence.consumer != self._consumer_seq + 1:
                await self._lost(f"delivery {sequence.consumer} came after {self._consumer_seq}: messages were lost")
                break
            self._consumer_seq = sequence.consumer
            self._suspect = False
            if sequence.stream >= self.next_seq:
                kept.append(msg)
        return kept

    # ------------------------------------------------------------ the consumer

    async def _create(self) -> None:
        """Create the consumer at `next_seq`, replacing one of the same name (a previous incarnation's
        position is not ours)."""
        config = api.ConsumerConfig(
            name=self.name,
            durable_name=self.name,
            description=f"follower of {self.subject_filter}, position kept by its reader",
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=self.next_seq,
            ack_policy=api.AckPolicy.NONE,
            filter_subject=self.subject_filter,
            inactive_threshold=self.inactive_threshold_s,
            mem_storage=False,
        )
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await self.log.js.delete_consumer(self.stream, self.name)
        await self.log.js.add_consumer(self.stream, config)
        self._sub = await self.log.js.pull_subscribe_bind(durable=self.name, stream=self.stream)
        self.recreated += self._created_once
        self._created_once = True
        self._consumer_seq = 0
        self._suspect = False
        log.info("follower consumer created", stream=self.stream, consumer=self.name, from_seq=self.next_seq)

    async def _lost(self, reason: str) -> None:
        log.warning(
            "follower re-creates its consumer",
            stream=self.stream,
            consumer=self.name,
            reason=reason,
            from_seq=self.next_seq,
        )
        await self._drop_consumer(delete=False)

    async def _drop_consumer(self, *, delete: bool) -> None:
        """Forget the subscription (and, when the reader is done, delete the consumer). Best effort: a
        consumer left behind is reaped after its inactive threshold."""
        sub, self._sub = self._sub, None
        if sub is None:
            return
        with contextlib.suppress(nats.errors.Error, TimeoutError):
            await sub.unsubscribe()
        if delete and not self.log.nc.is_closed:
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                await asyncio.wait_for(self.log.js.delete_consumer(self.stream, self.name), 2.0)

    # ------------------------------------------------------------ outages

    async def _wait_out(
        self,
        exc: BaseException,
        stop: asyncio.Event,
        what: str = "the log does not answer; the feed waits and resumes by itself",
    ) -> None:
        """The log did not answer: say so (again every OUTAGE_WARNING_EVERY_S, with how long), wait, and
        re-create the consumer once it answers, from `next_seq`."""
        now = time.monotonic()
        if self.down_since is None:
            self.down_since, self._warned_at = now, -math.inf
        if now - self._warned_at >= OUTAGE_WARNING_EVERY_S:
            log.warning(
                what,
                stream=self.stream,
                consumer=self.name,
                down_s=round(now - self.down_since, 1),
                next_seq=self.next_seq,
                error=repr(exc),
            )
            self._warned_at = now
        await self._drop_consumer(delete=False)  # what survives the outage is re-created from our position
        await _sleep_unless(stop, self._retry_delay_s)
        self._retry_delay_s = min(self._retry_delay_s * 2, 5.0)

    def _answered(self) -> None:
        if self.down_since is not None:
            log.info(
                "the log answers again; the feed resumes",
                stream=self.stream,
                consumer=self.name,
                down_s=round(time.monotonic() - self.down_since, 1),
                next_seq=self.next_seq,
            )
            self.down_since = None
        self._retry_delay_s = 0.5


async def _sleep_unless(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


def _raise_if_cancelled() -> None:
    """nats-py can turn a cancellation into a timeout; a loop that retries timeouts must not swallow it."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def tail_messages(
    event_log: EventLog,
    stream: str,
    subject_filter: str,
    start_seq: int,
    stop: asyncio.Event,
    *,
    name: str | None = None,
    batch: int = 256,
    idle_timeout_s: float = 0.5,
) -> AsyncIterator[Msg]:
    """The raw messages of a live feed (a `Follower`), for readers that only glance at a few fields of
    busy streams. `name`: the consumer's name (`pipeline.topology.follower_name`); default: a fresh one
    for this feed."""
    follower = Follower(
        event_log,
        stream,
        subject_filter,
        start_seq,
        name or f"follower-{uuid.uuid4().hex[:12]}",
        batch=batch,
        idle_timeout_s=idle_timeout_s,
    )
    async for msg in follower.messages(stop):
        yield msg


async def tail(
    event_log: EventLog, stream: str, subject_filter: str, start_seq: int, stop: asyncio.Event, **follow
) -> AsyncIterator[Replayed]:
    """Like `replay`, but keeps following the stream until `stop` is set (a projection's live feed).
    `follow`: `name`, `batch` and `idle_timeout_s`, as for `tail_messages`."""
    async for msg in tail_messages(event_log, stream, subject_filter, start_seq, stop, **follow):
        if (item := await decoded(event_log, msg)) is not None:
            yield item
