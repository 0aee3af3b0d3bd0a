"""One stream's archiver: fetch, classify, buffer, write, ack — in that order, per message.

Every message ends one of three ways:
- an event: buffered as a row, written with its flush, then acked;
- poison (does not decode, unknown type, invalid, on a subject its body disagrees with, a claim
  check whose blob is missing or corrupt, or that points outside the run's claims, e.g. at a
  bucket that does not exist: `EventLog.resolve` says which): dead-lettered first
  (`pipeline.dead_letter`; a message of the DEADLETTER stream itself never is), then buffered as an
  `undecodable` row with the reason and class, written and acked like any other;
- neither, because something did not answer (the object store for a PUT or a claim-check GET, the
  log for a fetch or a dead-letter append): the same operation is retried with backoff (`Waits`),
  visibly, holding what it concerns unacked, and kept alive with in-progress acks so JetStream does
  not hand it out again meanwhile.
Anything else — the consumer deleted, credentials refused, a bug — is raised, and the archiver
process exits with it. Progress is per message (`workers.archiver.progress`): a redelivery of a
sequence some file already holds is acked without being written again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from dataclasses import dataclass

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg

from pipeline.blobstore import BlobStore
from pipeline.dead_letter import dead_letter
from pipeline.errors import (
    BlobAccessDenied,
    BlobStoreError,
    BlobStoreUnavailable,
    BucketNotFound,
    ConsumerNotDeclared,
    PoisonEvent,
    SprawlError,
    TransientError,
)
from pipeline.eventlog import NO_ANSWER, EventLog
from pipeline.logs import get_logger
from pipeline.topology import DEADLETTER, ConsumerRole, Stream, consumer_for
from schemas import Event, encode_event
from schemas.archive import LOG_SEQ, UNDECODABLE
from workers.archiver.progress import ArchivedSeqs
from workers.archiver.rows import archive_files, event_row, undecodable_row
from workers.archiver.settings import ArchiveSection
from workers.archiver.waits import Abandoned, Waits, WaitState

log = get_logger(__name__)

FETCH_TIMEOUT_S = 0.5
"""How long one pull waits for messages; also how often the stop event and the flush timer are looked at."""
CONSUMER_CHECK_S = 5.0
"""While fetches come back empty, ask the server for the consumer this often: a stalled log then shows
as a waiting state, and a deleted consumer as the fatal error it is, instead of an idle archiver."""
LOG_NO_ANSWER = (
    TimeoutError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.NoRespondersError,
    nats.js.errors.ServiceUnavailableError,
)
"""The log did not answer, for now. (A closed connection is not here: it does not come back.)"""


class ArchiverFailed(SprawlError):
    """A stream archiver met an error nobody typed (a bug): the process stops, naming the stream."""


@dataclass
class Pending:
    """A message held until its row is written."""

    msg: Msg
    event_type: str
    row: dict
    size: int
    """The event's encoded bytes (a claim-checked one's own, not its claim's): what `flush_bytes` counts."""


@dataclass
class StreamStats:
    archived: int = 0
    """Rows written (and their messages acked)."""
    skipped: int = 0
    """Redeliveries of sequences already archived, acked without being written again."""
    undecodable: int = 0
    """Poison messages archived as `undecodable`."""
    dead_lettered: int = 0
    """... of which this archiver appended the dead letter (others may have been first)."""


class StreamArchiver:
    def __init__(
        self,
        event_log: EventLog,
        blobs: BlobStore,
        run_id: str,
        stream: Stream,
        settings: ArchiveSection,
        archived: ArchivedSeqs,
        waits: Waits,
        ack_deadline_s: float,
    ):
        self.log, self.blobs, self.run_id, self.stream, self.settings = event_log, blobs, run_id, stream, settings
        self.consumer = consumer_for(run_id, ConsumerRole.ARCHIVER, stream)
        self.archived = archived
        self.waits = waits
        self.buffer: dict[int, Pending] = {}
        """Stream sequence -> the message holding it, until written; a redelivery replaces its entry."""
        self.oldest: float | None = None
        self.buffered_bytes = 0
        """The encoded size of what `buffer` holds (`ArchiveSection.flush_bytes`)."""
        self.stats = StreamStats()
        self._keepalive_s = max(0.2, ack_deadline_s / 3)
        self._last_check = time.monotonic()

    @property
    def label(self) -> str:
        return self.stream.label

    async def run(self, stop: asyncio.Event) -> None:
        """Archive until `stop`, then write what is buffered. Raises what is fatal (see the module)."""
        sub = await self.log.js.pull_subscribe_bind(durable=self.consumer.name, stream=self.stream.name)
        keepalive = asyncio.create_task(self._keep_alive(), name=f"archiver-keepalive-{self.label}")
        try:
            while not stop.is_set():
                for msg in await self._fetch(sub, stop):
                    await self._take(msg, stop)
                if self._flush_due():
                    await self.flush(stop)
            await self.flush(stop)
        except Abandoned:
            log.warning("stopped while waiting, the unwritten left unacked", stream=self.label, held=len(self.buffer))
        except SprawlError:
            raise
        except Exception as exc:
            log.exception("stream archiver failed", stream=self.label)
            what = f"{type(exc).__name__}: {exc}"
            raise ArchiverFailed(f"the archiver of stream {self.stream.name} failed: {what}") from exc
        finally:
            keepalive.cancel()
            with contextlib.suppress(*NO_ANSWER, nats.errors.Error):  # the connection may be what failed
                await sub.unsubscribe()

    # ---------------------------------------------------------------- reading

    async def _fetch(self, sub, stop: asyncio.Event) -> list[Msg]:
        try:
            msgs = await sub.fetch(self.settings.fetch_batch, timeout=FETCH_TIMEOUT_S)
        except TimeoutError:  # nothing new, or a stalled server: the consumer check tells them apart
            msgs = []
        except nats.js.errors.NotFoundError as exc:
            raise ConsumerNotDeclared(self.stream.name, self.consumer.name) from exc
        except (nats.errors.ConnectionReconnectingError, nats.errors.NoRespondersError, nats.js.errors.APIError) as exc:
            log.warning("fetch refused; asking for the consumer", stream=self.label, error=repr(exc))
            await self._check_consumer(stop)
            return []
        if not msgs and time.monotonic() - self._last_check >= CONSUMER_CHECK_S:
            await self._check_consumer(stop)
        return msgs

    async def _check_consumer(self, stop: asyncio.Event) -> None:
        """Return once the server has confirmed the consumer; ConsumerNotDeclared if it says it is gone."""

        async def ask() -> None:
            try:
                await self.log.js.consumer_info(self.stream.name, self.consumer.name)
            except nats.js.errors.NotFoundError as exc:
                raise ConsumerNotDeclared(self.stream.name, self.consumer.name) from exc

        await self.waits.until_done(
            ask, stream=self.label, state=WaitState.LOG_UNAVAILABLE, transient=LOG_NO_ANSWER, stop=stop
        )
        self._last_check = time.monotonic()

    async def _take(self, msg: Msg, stop: asyncio.Event) -> None:
        seq = msg.metadata.sequence.stream
        if seq in self.archived:  # written before, its ack lost (a kill, an outage): not twice
            self.stats.skipped += 1
            await _ack(msg)
            return
        if seq in self.buffer:  # its ack wait ran out while we held it: keep the newer delivery only
            self.buffer[seq].msg = msg
            return
        event_type, row, size = await self._row(msg, stop)
        if not self.buffer:
            self.oldest = time.monotonic()
        self.buffer[seq] = Pending(msg, event_type, row, size)
        self.buffered_bytes += size

    async def _row(self, msg: Msg, stop: asyncio.Event) -> tuple[str, dict, int]:
        """The message's row, as an event or as `undecodable` (dead-lettered first), and its size."""
        resolve = functools.partial(self.log.resolve, msg.data, subject=msg.subject)
        try:
            event = await self.waits.until_done(
                resolve,
                stream=self.label,
                state=WaitState.S3_UNAVAILABLE,
                transient=(BlobStoreUnavailable,),
                stop=stop,
            )
        except PoisonEvent as exc:
            reason, error_class = exc.message, exc.error_class
        except (BlobAccessDenied, BlobStoreUnavailable, BucketNotFound):
            # Our credentials refused, an outage we gave up on, or our own bucket gone (resolve fetches
            # only from the run's claims prefix; a pointer elsewhere is poison there): fatal.
            raise
        except BlobStoreError as exc:  # the store refused this one pointer (a key it will not serve): for good
            reason, error_class = exc.message, "claim_check_unreadable"
        else:
            return type(event).type_tag(), event_row(self.stream, msg, event), _encoded_size(msg, event)
        await self._dead_letter(msg, reason, error_class, stop)
        self.stats.undecodable += 1
        return UNDECODABLE, undecodable_row(self.stream, msg, reason, error_class), len(msg.data)

    async def _dead_letter(self, msg: Msg, reason: str, error_class: str, stop: asyncio.Event) -> None:
        if self.stream == DEADLETTER:  # a refused dead letter is archived, never dead-lettered again
            return
        append = functools.partial(
            dead_letter,
            self.log,
            msg,
            stream=self.stream.name,
            consumer=self.consumer.name,
            reason=reason,
            error_class=error_class,
            run_id=self.run_id,
        )
        appended = await self.waits.until_done(
            append, stream=self.label, state=WaitState.LOG_UNAVAILABLE, transient=(TransientError,), stop=stop
        )
        self.stats.dead_lettered += int(appended)

    # ---------------------------------------------------------------- writing

    def _flush_due(self) -> bool:
        if not self.buffer:
            return False
        waited = time.monotonic() - (self.oldest or 0)
        return (
            len(self.buffer) >= self.settings.flush_events
            or self.buffered_bytes >= self.settings.flush_bytes
            or waited >= self.settings.flush_interval_s
        )

    async def flush(self, stop: asyncio.Event) -> None:
        """Write the buffer (one file per event type and day), then ack everything in it."""
        if not self.buffer:
            return
        batch = list(self.buffer.values())
        files = archive_files(self.run_id, self.stream, [(p.event_type, p.row) for p in batch])
        for file in files:
            data = await asyncio.to_thread(file.to_parquet)
            put = functools.partial(asyncio.to_thread, self.blobs.put_bytes, data, file.key.to_key())
            await self.waits.until_done(
                put, stream=self.label, state=WaitState.S3_UNAVAILABLE, transient=(BlobStoreUnavailable,), stop=stop
            )
        # Every file is durable: from here on a lost ack only means a redelivery, which `archived` skips.
        self.archived.add_all(p.row[LOG_SEQ] for p in batch)
        self.buffer.clear()
        self.buffered_bytes = 0
        self.oldest = None
        for pending in batch:
            await _ack(pending.msg)
        self.stats.archived += len(batch)

    async def _keep_alive(self) -> None:
        """Tell JetStream we still hold the buffered messages (a slow or retried flush must not get
        them redelivered, and each redelivery spends one of the consumer's deliveries)."""
        while True:
            await asyncio.sleep(self._keepalive_s)
            for pending in list(self.buffer.values()):
                with contextlib.suppress(*NO_ANSWER, nats.errors.Error):
                    await pending.msg.in_progress()


_SMALL_MESSAGE_BYTES = 4096
"""Above this a message is its event itself (a claim check is a few hundred bytes): its length is the size."""


def _encoded_size(msg: Msg, event: Event) -> int:
    """A message's own bytes, or for a claim check those of the event it stood in for (re-encoded: only
    small messages are, so this costs little)."""
    if len(msg.data) > _SMALL_MESSAGE_BYTES:
        return len(msg.data)
    return max(len(msg.data), len(encode_event(event)))


async def _ack(msg: Msg) -> None:
    # Not awaited for confirmation: correctness rests on `archived`, not on the ack arriving.
    with contextlib.suppress(*NO_ANSWER, nats.errors.Error):
        await msg.ack()
