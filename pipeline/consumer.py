"""Consuming the log: bind a declared durable pull consumer and run a handler per event.

Contract with the handler:
- return normally -> the event is acked (after the handler's side effects are durable);
- raise PoisonEvent -> terminated and dead-lettered with the reason;
- raise TransientError (retry later) -> nak'ed with the consumer's backoff (at least
  its `retry_after_s`), and dead-lettered once the delivery count reaches max_deliver;
- raise anything else -> treated the same way, but logged with its traceback: it is
  a bug or an unexpected failure, and it must dead-letter rather than crash-loop.
Events that cannot even be decoded (malformed, unknown type, failed
validation, corrupt claim check) are dead-lettered without reaching the
handler. Handlers must be idempotent on `event_id`: a crash between side
effect and ack redelivers. The consumer also remembers recently applied
event ids, so a redelivery caused by a lost ack (e.g. a server restart) is
acked without running the handler twice.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import nats.errors
import nats.js.errors
import structlog
from nats.aio.msg import Msg

from pipeline.errors import ConsumerNotDeclared, LogUnavailable, PoisonEvent, SprawlError, TransientError
from pipeline.eventlog import NO_ANSWER, EventLog
from pipeline.logs import get_logger
from pipeline.subjects import token
from schemas import DeadLetter, Event

log = get_logger(__name__)

_TRANSIENT_NATS = NO_ANSWER


@dataclass
class Delivery:
    """One event as handed to a handler, with where it came from."""

    event: Event
    subject: str
    stream: str
    stream_seq: int
    num_delivered: int
    msg: Msg

    async def in_progress(self) -> None:
        """Tell JetStream the handler is still working (resets the ack timer)."""
        await self.msg.in_progress()


Handler = Callable[[Delivery], Awaitable[None]]


@dataclass
class ConsumerStats:
    acked: int = 0
    skipped_duplicates: int = 0
    nacked: int = 0
    dead_lettered: int = 0


class Consumer:
    def __init__(
        self,
        event_log: EventLog,
        stream: str,
        durable: str,
        handler: Handler,
        *,
        batch: int = 16,
        concurrency: int = 1,
        fetch_timeout_s: float = 1.0,
        remember_applied: int = 50_000,
        retry_delays_s: tuple[float, ...] = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0),
    ):
        self.log = event_log
        self.stream = stream
        self.durable = durable
        self.handler = handler
        self.batch = batch
        self.fetch_timeout_s = fetch_timeout_s
        self.stats = ConsumerStats()
        self._slots = asyncio.Semaphore(concurrency)
        self._applied: OrderedDict[str, None] = OrderedDict()
        self._remember = remember_applied
        self._retry_delays = retry_delays_s
        self._max_deliver = -1
        self._backoff: list[float] = []
        self._ack_wait = 30.0
        self._sub = None

    async def bind(self) -> None:
        """Bind to the declared consumer; never creates one.

        ConsumerNotDeclared only on the server's "not found"; a server that does not answer raises
        LogUnavailable (retry later), never "not declared"."""
        try:
            info = await self.log.js.consumer_info(self.stream, self.durable)
            self._sub = await self.log.js.pull_subscribe_bind(durable=self.durable, stream=self.stream)
        except nats.js.errors.NotFoundError as exc:
            raise ConsumerNotDeclared(self.stream, self.durable) from exc
        except _TRANSIENT_NATS as exc:
            raise LogUnavailable(f"binding consumer {self.durable!r} on stream {self.stream!r}", exc) from exc
        self._max_deliver = info.config.max_deliver or -1
        self._backoff = list(info.config.backoff or [])
        self._ack_wait = float(info.config.ack_wait or 30.0)
        log.info("consumer bound", stream=self.stream, consumer=self.durable, max_deliver=self._max_deliver)

    async def run(self, stop: asyncio.Event) -> ConsumerStats:
        """Fetch and handle until `stop` is set; survives server restarts by waiting and re-fetching."""
        if self._sub is None:
            await self.bind()
        assert self._sub is not None
        try:
            await self._fetch_loop(stop)
        finally:
            with contextlib.suppress(*_TRANSIENT_NATS, nats.errors.BadSubscriptionError):
                await self._sub.unsubscribe()
            self._sub = None
        return self.stats

    async def _fetch_loop(self, stop: asyncio.Event) -> None:
        assert self._sub is not None
        while not stop.is_set():
            try:
                msgs = await self._sub.fetch(self.batch, timeout=self.fetch_timeout_s)
            except TimeoutError:  # nats-py raises its own subclass or a bare asyncio timeout
                continue
            except nats.js.errors.NotFoundError as exc:
                raise ConsumerNotDeclared(self.stream, self.durable) from exc
            except (*_TRANSIENT_NATS, nats.js.errors.ServiceUnavailableError, nats.js.errors.APIError) as exc:
                log.warning("fetch failed, retrying", consumer=self.durable, error=repr(exc))
                await asyncio.sleep(0.5)
                await self._rebind_if_missing()
                continue
            await asyncio.gather(*(self._handle_slot(m) for m in msgs))

    async def _rebind_if_missing(self) -> None:
        with contextlib.suppress(*_TRANSIENT_NATS, nats.js.errors.ServiceUnavailableError):
            try:
                await self.log.js.consumer_info(self.stream, self.durable)
            except nats.js.errors.NotFoundError as exc:
                raise ConsumerNotDeclared(self.stream, self.durable) from exc

    async def _handle_slot(self, msg: Msg) -> None:
        async with self._slots:
            await self.handle(msg)

    async def handle(self, msg: Msg) -> None:
        meta = msg.metadata
        seq, delivered = meta.sequence.stream, meta.num_delivered
        with structlog.contextvars.bound_contextvars(stream_seq=seq, subject=msg.subject, consumer=self.durable):
            try:
                event = await self.log.resolve(msg.data, subject=msg.subject)
            except PoisonEvent as exc:
                await self._dead_letter(msg, exc.message, exc.error_class, run_id=None)
                return
            except SprawlError as exc:  # the blob store is down or refuses us: try again later
                await self._retry_later(msg, delivered, exc, run_id=None)
                return
            except Exception as exc:
                # Poison boundary: a decoder bug must not crash-loop the worker on this message. Logged
                # with its traceback, retried with backoff, dead-lettered (with its bytes) at max_deliver.
                log.exception("decoding raised an unexpected error", delivered=delivered)
                await self._retry_later(msg, delivered, exc, run_id=None)
                return
            if event.event_id in self._applied:
                self.stats.skipped_duplicates += 1
                log.info("redelivery of an applied event acked", event_id=event.event_id)
                await self._ack(msg)
                return
            delivery = Delivery(event, msg.subject, self.stream, seq, delivered, msg)
            keepalive = asyncio.create_task(self._keep_alive(msg))
            try:
                await self.handler(delivery)
            except PoisonEvent as exc:
                await self._dead_letter(msg, exc.message, exc.error_class, run_id=event.run_id)
                return
            except TransientError as exc:  # the handler says: not now, retry later
                await self._retry_later(msg, delivered, exc, run_id=event.run_id)
                return
            except Exception as exc:
                # Poison boundary, the handler contract: whatever else a handler raises (a bug, an error
                # its author did not type) is retried with backoff and dead-lettered at max_deliver, so one
                # bad event cannot crash-loop the worker. Logged with its traceback and the event's identity.
                log.exception(
                    "handler raised an unexpected error",
                    event_id=event.event_id,
                    event_type=type(event).type_tag(),
                    run_id=event.run_id,
                    delivered=delivered,
                )
                await self._retry_later(msg, delivered, exc, run_id=event.run_id)
                return
            finally:
                keepalive.cancel()
            self._remember_applied(event.event_id)
            await self._ack(msg)

    def _remember_applied(self, event_id: str) -> None:
        self._applied[event_id] = None
        while len(self._applied) > self._remember:
            self._applied.popitem(last=False)

    async def _ack(self, msg: Msg) -> None:
        try:
            await msg.ack_sync(timeout=5.0)
            self.stats.acked += 1
        except _TRANSIENT_NATS as exc:
            # The event is applied; a redelivery will be recognised by its event id.
            log.warning("ack not confirmed; a redelivery will be skipped", error=repr(exc))

    async def _keep_alive(self, msg: Msg) -> None:
        interval = max(0.2, min([self._ack_wait, *self._backoff]) / 3)
        while True:
            await asyncio.sleep(interval)
            with contextlib.suppress(*_TRANSIENT_NATS):
                await msg.in_progress()

    async def _retry_later(self, msg: Msg, delivered: int, exc: Exception, run_id: str | None) -> None:
        if self._max_deliver > 0 and delivered >= self._max_deliver:
            reason = f"gave up after {delivered} deliveries; last error: {exc!r}"
            await self._dead_letter(msg, reason, type(exc).__name__, run_id=run_id)
            return
        delay = self._retry_delays[min(delivered - 1, len(self._retry_delays) - 1)]
        if isinstance(exc, TransientError) and exc.retry_after_s is not None:
            delay = max(delay, exc.retry_after_s)
        log.warning("handler failed, will retry", error=repr(exc), delivered=delivered, retry_in_s=delay)
        with contextlib.suppress(*_TRANSIENT_NATS):
            await msg.nak(delay=delay)
        self.stats.nacked += 1

    async def _dead_letter(self, msg: Msg, reason: str, error_class: str, run_id: str | None) -> None:
        meta = msg.metadata
        dead = DeadLetter(
            run_id=run_id or _run_of(msg.subject),
            reason=reason,
            error_class=error_class,
            stream=self.stream.lower(),
            consumer=self.durable,
            original_subject=msg.subject,
            original_seq=meta.sequence.stream,
            num_delivered=meta.num_delivered,
            payload=bytes(msg.data),
            headers={k: str(v) for k, v in (msg.headers or {}).items()},
        )
        try:
            await self.log.append(dead)
        except (SprawlError, nats.errors.Error) as exc:  # the log or (for a big payload) the blob store
            # Losing nothing beats a clean queue: leave it for redelivery.
            log.error("dead-letter append failed; message left for redelivery", error=repr(exc))
            with contextlib.suppress(*_TRANSIENT_NATS):
                await msg.nak(delay=1.0)
            return
        log.warning("dead-lettered", reason=reason, error_class=error_class)
        with contextlib.suppress(*_TRANSIENT_NATS):
            await msg.term()
        self.stats.dead_lettered += 1


def _run_of(subject: str) -> str:
    """The run token of `rl.<run>.…`, or `unknown`: a dead letter must never fail on a bad subject."""
    tokens = subject.split(".")
    try:
        return token(tokens[1], "run_id") if len(tokens) > 1 else "unknown"
    except ValueError:
        return "unknown"
