"""The archiver process: one supervised task per stream; the first to fail takes the process down.

On start it asks the server for each archiver consumer (its ack floor, its ack deadline), reads from
the archive which sequences above those floors are already written (`progress`), then runs every
stream's archiver in one TaskGroup. A task that raises cancels the others and the process exits
non-zero with that one error: the archiver is never alive and idle with an error inside it.
"""

from __future__ import annotations

import asyncio
import functools

import nats.js.errors

from pipeline.blobstore import BlobStore, open_blob_store
from pipeline.config import S3BlobSettings
from pipeline.errors import BlobStoreUnavailable, ConsumerNotDeclared, SprawlError, TransientError
from pipeline.eventlog import EventLog
from pipeline.logs import get_logger
from pipeline.topology import STREAMS, ConsumerRole, Stream, consumer_for
from workers.archiver.progress import ArchivedSeqs, archived_seqs
from workers.archiver.settings import ArchiverSettings
from workers.archiver.stream import LOG_NO_ANSWER, ArchiverFailed, StreamArchiver
from workers.archiver.waits import Waits, WaitState
from workers.lifecycle import run_connected

log = get_logger(__name__)


class ArchiveIncomplete(TransientError):
    """A drain stopped with events still unwritten (the object store did not answer)."""


class Archiver:
    def __init__(self, settings: ArchiverSettings, event_log: EventLog, blobs: BlobStore):
        self.settings, self.log, self.blobs = settings, event_log, blobs
        self.waits = Waits(settings.archive)
        """What the archiver waits out now, and its retry counters: the process's status."""
        self.streams: list[StreamArchiver] = []
        self.ready = asyncio.Event()
        """Set once every stream's progress is known and its archiver is fetching."""

    async def run(self, stop: asyncio.Event) -> None:
        run_id = self.settings.run_id
        deadlines: dict[str, float] = {}
        floors: dict[str, int] = {}
        for stream in STREAMS:
            info = await self._consumer_info(stream, stop)
            floors[stream.label] = info.ack_floor.stream_seq if info.ack_floor else 0
            waits = [info.config.ack_wait or 30.0, *(info.config.backoff or [])]
            deadlines[stream.label] = min(waits)
        # After the floors: a sequence above a floor read now was either written before we list, or
        # will be written by us (one archiver per run).
        listing = functools.partial(asyncio.to_thread, archived_seqs, self.blobs, run_id, floors)
        archived = await self.waits.until_done(
            listing, stream="*", state=WaitState.S3_UNAVAILABLE, transient=(BlobStoreUnavailable,), stop=stop
        )
        self.streams = [
            StreamArchiver(
                self.log,
                self.blobs,
                run_id,
                stream,
                self.settings.archive,
                archived.get(stream.label, ArchivedSeqs()),
                self.waits,
                deadlines[stream.label],
            )
            for stream in STREAMS
        ]
        log.info("archiver started", already_archived={label: len(seqs) for label, seqs in archived.items()})
        self.ready.set()
        try:
            async with asyncio.TaskGroup() as group:
                for archiver in self.streams:
                    group.create_task(archiver.run(stop), name=f"archiver-{archiver.label}")
        except ExceptionGroup as failed:
            raise _first_error(failed) from None

    async def _consumer_info(self, stream: Stream, stop: asyncio.Event):
        consumer = consumer_for(self.settings.run_id, ConsumerRole.ARCHIVER, stream)

        async def ask():
            try:
                return await self.log.js.consumer_info(stream.name, consumer.name)
            except nats.js.errors.NotFoundError as exc:
                raise ConsumerNotDeclared(stream.name, consumer.name) from exc

        return await self.waits.until_done(
            ask, stream=stream.label, state=WaitState.LOG_UNAVAILABLE, transient=LOG_NO_ANSWER, stop=stop
        )

    @property
    def archived(self) -> int:
        return sum(s.stats.archived for s in self.streams)

    @property
    def undecodable(self) -> int:
        return sum(s.stats.undecodable for s in self.streams)

    @property
    def buffered(self) -> int:
        return sum(len(s.buffer) for s in self.streams)


def _first_error(group: BaseExceptionGroup) -> BaseException:
    """The error a failed stream task raised (the others were only cancelled because of it)."""
    first = group.exceptions[0]
    if isinstance(first, BaseExceptionGroup):
        return _first_error(first)
    if isinstance(first, SprawlError | asyncio.CancelledError | KeyboardInterrupt):
        return first
    return ArchiverFailed(f"the archiver failed: {type(first).__name__}: {first}")


def open_archive_store(settings: ArchiverSettings) -> BlobStore:
    """The archiver's store, whose writes do not wait out an outage themselves: the archiver waits it
    out in its own `Waits` (S3_UNAVAILABLE), which a stop interrupts, with its messages held unacked."""
    blobs = settings.blobs
    if isinstance(blobs, S3BlobSettings):
        blobs = blobs.model_copy(update={"outage_patience_s": 0.0})
    return open_blob_store(blobs)


async def run_archiver(settings: ArchiverSettings) -> None:
    async def body(event_log: EventLog, stop: asyncio.Event) -> None:
        await Archiver(settings, event_log, open_archive_store(settings)).run(stop)

    await run_connected(settings, "archiver", body)


async def drain_once(settings: ArchiverSettings) -> int:
    """Archive everything in the log right now and return how many rows were written (for `--fresh`
    queries, `sprawl up`'s last archive and benchmarks). Raises ArchiveIncomplete if the object store
    stopped answering before the end."""
    event_log = await EventLog.connect(settings, worker="archiver-drain")
    try:
        archiver = Archiver(settings, event_log, open_archive_store(settings))
        stop = asyncio.Event()
        task = asyncio.create_task(archiver.run(stop))
        while True:
            await asyncio.sleep(0.2)
            if task.done():
                task.result()  # raises what ended it
                raise ArchiverFailed("the archiver ended before the drain did")
            if not archiver.ready.is_set():
                continue
            # A poison message is dead-lettered before its row is buffered: a dead letter appended
            # while we count may sit on a stream counted before it; count again then.
            refused = archiver.undecodable
            pending = 0
            for stream in STREAMS:
                consumer = consumer_for(settings.run_id, ConsumerRole.ARCHIVER, stream)
                info = await event_log.js.consumer_info(stream.name, consumer.name)
                pending += info.num_pending + info.num_ack_pending
            # All that is left sits in our buffers: the stop flushes it.
            if pending - archiver.buffered <= 0 and archiver.undecodable == refused:
                break
        stop.set()
        await task
        unwritten = archiver.buffered
        if unwritten:
            raise ArchiveIncomplete(
                f"the drain stopped with {unwritten} events unwritten: the object store did not answer",
                hint="`sprawl stack status`; the events stay in the log, unacked, for the next drain",
            )
        return archiver.archived
    finally:
        await event_log.close()
