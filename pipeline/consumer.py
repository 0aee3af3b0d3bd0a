"""Consuming the log: bind a declared durable pull consumer and run a handler per event.

Every failure has a class, and each class ends in one clear place:
- poison (`PoisonEvent`, or an event that cannot even be decoded: malformed, unknown type, failed
  validation, a corrupt or missing claim check) -> terminated and dead-lettered at once, with the
  original bytes, stream, sequence, consumer and reason;
- transient (`TransientError`: the log or the blob store did not answer, a prompt group not seen
  yet) -> nak'ed with backoff (at least its `retry_after_s`) and retried for `transient_retry_s`
  from its first failure, counted and logged as it goes, then dead-lettered. While the log or the
  blob store is down (`LogUnavailable`, `BlobStoreUnavailable`) the consumer also pauses fetching,
  so a down dependency does not burn the deliveries of the messages behind it;
- anything else is a bug or a failure nobody typed -> logged with its traceback, retried up to
  `bug_attempts` deliveries, then dead-lettered, so one bad event cannot crash-loop the worker.
Whatever the class, a message the server would not deliver again (`max_deliver`) is dead-lettered.
A handler that returns normally is acked (after its side effects are durable).

Handlers must be idempotent on `event_id`: a crash between side effect and ack redelivers. The
consumer also remembers recently applied event ids, so a redelivery caused by a lost ack (e.g. a
server restart) is acked without running the handler twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import nats.errors
import nats.js.errors
import structlog
from nats.aio.msg import Msg

from pipeline.dead_letter import dead_letter
from pipeline.errors import (
    BlobAccessDenied,
    BlobStoreUnavailable,
    BucketNotFound,
    ConsumerNotDeclared,
    LogUnavailable,
    PoisonEvent,
    SprawlError,
    TransientError,
)
from pipeline.eventlog import NO_ANSWER, EventLog
from pipeline.logs import get_logger
from schemas import Event

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
    transient_retries: int = 0
    """Naks of transient failures (a subset of `nacked`)."""
    dead_lettered: int = 0
    pauses: int = 0
    """Times fetching paused because the log or the blob store was down."""
    failing: int = 0
    """Messages failing right now (transiently or not), each waiting for its next delivery."""


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
        transient_retry_s: float = 900.0,
        bug_attempts: int = 3,
    ):
        """`transient_retry_s` and `bug_attempts`: how long a transient failure is retried, and how many
        deliveries any other failure gets, before the message is dead-lettered (`StreamSettings` holds
        the configured values: workers pass `settings.streams.transient_retry_s` and `.bug_attempts`)."""
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
        self.transient_retry_s = transient_retry_s
        self.bug_attempts = bug_attempts
        self._failing_since: OrderedDict[int, float] = OrderedDict()
        self._paused_until = 0.0
        self._max_deliver = -1
        self._backoff: list[float] = []
        self._ack_wait = 30.0
        self._sub = None
        self._missing_since: float | None = None

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
            if (pause := self._paused_until - time.monotonic()) > 0:
                # A dependency is down: taking more messages now would only burn their deliveries.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), pause)
                continue
            try:
                msgs = await self._sub.fetch(self.batch, timeout=self.fetch_timeout_s)
            except TimeoutError:  # nats-py raises its own subclass or a bare asyncio timeout
                continue
            except nats.js.errors.NotFoundError as exc:
                await self._missing(exc)
                continue
            except (*_TRANSIENT_NATS, nats.js.errors.ServiceUnavailableError, nats.js.errors.APIError) as exc:
                log.warning("fetch failed, retrying", consumer=self.durable, error=repr(exc))
                await asyncio.sleep(0.5)
                await self._rebind_if_missing()
                continue
            self._missing_since = None
            await asyncio.gather(*(self._handle_slot(m) for m in msgs))

    async def _rebind_if_missing(self) -> None:
        with contextlib.suppress(*_TRANSIENT_NATS, nats.js.errors.ServiceUnavailableError):
            try:
                await self.log.js.consumer_info(self.stream, self.durable)
            except nats.js.errors.NotFoundError as exc:
                await self._missing(exc)

    async def _missing(self, exc: Exception) -> None:
        """The server says our consumer (or its stream) does not exist. Right after a restart JetStream
        says so while it still restores them (seen under load): believed only after
        `log.stream_missing_grace_s`, then ConsumerNotDeclared (fatal: nothing but `sprawl infra apply` fixes it)."""
        now = time.monotonic()
        if self._missing_since is None:
            self._missing_since = now
        if now - self._missing_since >= self.log.settings.stream_missing_grace_s:
            raise ConsumerNotDeclared(self.stream, self.durable) from exc
        log.warning(
            "the server does not report our consumer; waiting in case it is restoring its streams",
            consumer=self.durable,
            missing_s=round(now - self._missing_since, 1),
        )
        await asyncio.sleep(1.0)

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
            except (BucketNotFound, BlobAccessDenied):
                # `resolve` only reads claims under this run's own prefix (a pointer elsewhere is poison), so
                # this is our own store's bucket gone, or our identity refused (a revoked token, a role
                # without the grant): fatal configuration, not the message's fault, and retrying would
                # only dead-letter good messages.
                raise
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
            self._recovered(seq)
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
        interval = keepalive_interval_s(self._ack_wait, self._backoff)
        while True:
            await asyncio.sleep(interval)
            with contextlib.suppress(*_TRANSIENT_NATS):
                await msg.in_progress()

    async def _retry_later(self, msg: Msg, delivered: int, exc: Exception, run_id: str | None) -> None:
        seq = msg.metadata.sequence.stream
        now = time.monotonic()
        failing_for = now - self._failing_since.setdefault(seq, now)
        self.stats.failing = len(self._failing_since)
        transient = isinstance(exc, TransientError)
        last_delivery = self._max_deliver > 0 and delivered >= self._max_deliver
        if transient and (failing_for >= self.transient_retry_s or last_delivery):
            reason = (
                f"still failing after {failing_for:.0f}s and {delivered} deliveries "
                f"(transient failures are retried for {self.transient_retry_s:g}s); last error: {exc!r}"
            )
            await self._dead_letter(msg, reason, type(exc).__name__, run_id=run_id)
            return
        if not transient and (delivered >= self.bug_attempts or last_delivery):
            reason = f"gave up after {delivered} deliveries; last error: {exc!r}"
            await self._dead_letter(msg, reason, type(exc).__name__, run_id=run_id)
            return
        delay = self._retry_delays[min(delivered - 1, len(self._retry_delays) - 1)]
        if isinstance(exc, TransientError) and exc.retry_after_s is not None:
            delay = max(delay, exc.retry_after_s)
        log.warning(
            "transient failure, will retry" if transient else "handler failed, will retry",
            error=repr(exc),
            delivered=delivered,
            retry_in_s=delay,
            failing_for_s=round(failing_for, 1),
            failing_messages=self.stats.failing,
        )
        with contextlib.suppress(*_TRANSIENT_NATS):
            await msg.nak(delay=delay)
        self.stats.nacked += 1
        if transient:
            self.stats.transient_retries += 1
        if isinstance(exc, LogUnavailable | BlobStoreUnavailable):
            if self._paused_until <= now:
                self.stats.pauses += 1
                log.warning("the log or the blob store is down: fetching paused", pause_s=delay, error=str(exc))
            self._paused_until = max(self._paused_until, now + delay)

    def _recovered(self, seq: int) -> None:
        """The message at `seq` is done with (applied or dead-lettered): its failures are history."""
        if self._failing_since.pop(seq, None) is not None:
            self.stats.failing = len(self._failing_since)

    async def _dead_letter(self, msg: Msg, reason: str, error_class: str, run_id: str | None) -> None:
        try:
            await dead_letter(
                self.log,
                msg,
                stream=self.stream,
                consumer=self.durable,
                reason=reason,
                error_class=error_class,
                run_id=run_id,
            )
        except (SprawlError, nats.errors.Error) as exc:  # the log or (for a big payload) the blob store
            # Losing nothing beats a clean queue: leave it for redelivery.
            log.error("dead-letter append failed; message left for redelivery", error=repr(exc))
            with contextlib.suppress(*_TRANSIENT_NATS):
                await msg.nak(delay=1.0)
            return
        self._recovered(msg.metadata.sequence.stream)
        with contextlib.suppress(*_TRANSIENT_NATS):
            await msg.term()
        self.stats.dead_lettered += 1


def keepalive_interval_s(ack_wait_s: float, backoff_s: list[float]) -> float:
    """How often a handler in progress tells the server it is alive: a third of the shortest ack wait
    the consumer has (JetStream uses the backoff's first delay as the ack wait), so two keepalives can
    be late before the message would be redelivered to another worker."""
    return max(0.2, min([ack_wait_s, *backoff_s]) / 3)
