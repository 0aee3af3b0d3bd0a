"""The archiver: every event of the run, as Parquet on S3, for SQL audits.

One durable consumer per stream. Messages are buffered and flushed by count and by time into one
Parquet file per event type and day (the key layout is `schemas.archive.ArchiveKey`), and acked
only after the PUT. On start each stream's archived high-water mark is read back from the file
names, and redelivered messages at or below it are acked without being written again: a crash
between PUT and ack duplicates nothing. Rows keep the stream, sequence, subject, envelope, the
decoded fields (nested ones as structs and lists) and the raw payload. Messages that do not decode
are archived too, as `undecodable`, with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import time
from collections import defaultdict
from datetime import datetime

import msgspec
import nats.errors
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import Field

from pipeline.blobstore import BlobStore, open_blob_store
from pipeline.config import Section, SprawlSettings
from pipeline.errors import PoisonEvent
from pipeline.eventlog import NO_ANSWER, EventLog
from pipeline.logs import get_logger
from pipeline.topology import ARCHIVER_MAX_ACK_PENDING, STREAMS, ConsumerRole, Stream, consumer_for
from schemas.archive import JSON_TEXT_FIELDS, UNDECODABLE, ArchiveKey, archive_date, run_prefix
from workers.lifecycle import run_connected

log = get_logger(__name__)


class ArchiveSection(Section):
    flush_events: int = Field(5000, ge=1)
    """Flush a stream's buffer once it holds this many events (above the consumer's max_ack_pending,
    ARCHIVER_MAX_ACK_PENDING, flushes happen by time only: unacked events stop deliveries)."""
    flush_interval_s: float = Field(5.0, gt=0)
    """... or once its oldest event has waited this long (the freshness of SQL queries)."""
    fetch_batch: int = Field(1000, ge=1, le=ARCHIVER_MAX_ACK_PENDING)
    """Messages fetched per pull; at most the archiver consumer's max_ack_pending
    (ARCHIVER_MAX_ACK_PENDING), since a pull may not ask for more than may be unacked."""


class ArchiverSettings(SprawlSettings):
    archive: ArchiveSection = ArchiveSection()
    """Flush policy."""


def archived_high_water(blobs: BlobStore, run_id: str) -> dict[str, int]:
    """The highest stream sequence already archived, per stream label, read from the file names."""
    marks: dict[str, int] = defaultdict(int)
    for key in ArchiveKey.parse_listing(blobs.list_keys(run_prefix(run_id))):
        marks[key.stream] = max(marks[key.stream], key.last_seq)
    return marks


def _row(stream: Stream, msg, event) -> dict:
    meta = msg.metadata
    row = {
        "stream": stream.label,
        "seq": meta.sequence.stream,
        "subject": msg.subject,
        "published_at": meta.timestamp,
        "payload": bytes(msg.data),
    }
    if event is None:
        return row
    fields = _columns(msgspec.to_builtins(event, builtin_types=(datetime, bytes)))
    fields.pop("type", None)
    return {**fields, **row, "event_type": type(event).type_tag()}


def _columns(value, key: str = ""):
    """Maps with open-ended keys become JSON text (not a struct per key); empty structs become null
    (Parquet has no empty struct)."""
    if key in JSON_TEXT_FIELDS and isinstance(value, dict | list):
        return json.dumps(value, sort_keys=True)
    if isinstance(value, dict):
        if not value:
            return None
        return {k: _columns(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_columns(v) for v in value]
    return value


def _table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rows)


class StreamArchiver:
    def __init__(
        self,
        event_log: EventLog,
        blobs: BlobStore,
        run_id: str,
        stream: Stream,
        settings: ArchiveSection,
        high_water: int,
    ):
        self.log, self.blobs, self.run_id, self.stream, self.settings = event_log, blobs, run_id, stream, settings
        self.high_water = high_water
        self.buffer: list[tuple[object, dict, str]] = []  # (msg, row, event_type)
        self.oldest: float | None = None
        self.archived = 0
        self.skipped = 0

    async def run(self, stop: asyncio.Event) -> None:
        consumer = consumer_for(self.run_id, ConsumerRole.ARCHIVER, self.stream)
        sub = await self.log.js.pull_subscribe_bind(durable=consumer.name, stream=self.stream.name)
        try:
            while not stop.is_set():
                try:
                    msgs = await sub.fetch(self.settings.fetch_batch, timeout=0.5)
                except TimeoutError:
                    msgs = []
                except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError):
                    await asyncio.sleep(0.5)
                    continue
                for msg in msgs:
                    await self._take(msg)
                if self.buffer and (
                    len(self.buffer) >= self.settings.flush_events
                    or time.monotonic() - (self.oldest or 0) >= self.settings.flush_interval_s
                ):
                    await self.flush()
            await self.flush()
        finally:
            with contextlib.suppress(*NO_ANSWER, nats.errors.Error):  # the connection may be what failed
                await sub.unsubscribe()

    async def _take(self, msg) -> None:
        seq = msg.metadata.sequence.stream
        if seq <= self.high_water:  # archived before a crash, ack lost: do not write it twice
            self.skipped += 1
            await msg.ack()
            return
        try:
            event = await self.log.resolve(msg.data, subject=msg.subject)
            row, event_type = _row(self.stream, msg, event), type(event).type_tag()
        except PoisonEvent as exc:
            row, event_type = {**_row(self.stream, msg, None), "reason": exc.message}, UNDECODABLE
        if not self.buffer:
            self.oldest = time.monotonic()
        self.buffer.append((msg, row, event_type))

    async def flush(self) -> None:
        """Write the buffer (one file per event type and day), then ack everything in it."""
        if not self.buffer:
            return
        groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
        for _, row, event_type in self.buffer:
            published = row["published_at"]
            groups[(event_type, archive_date(published if isinstance(published, datetime) else None))].append(row)
        for (event_type, day), rows in groups.items():
            table = await asyncio.to_thread(_table, rows)
            buffer = io.BytesIO()
            await asyncio.to_thread(pq.write_table, table, buffer, compression="zstd")
            key = ArchiveKey(
                run_id=self.run_id,
                event_type=event_type,
                date=day,
                stream=self.stream.label,
                first_seq=rows[0]["seq"],
                last_seq=rows[-1]["seq"],
            )
            await asyncio.to_thread(self.blobs.put_bytes, buffer.getvalue(), key.to_key())
        for msg, _, _ in self.buffer:
            # The file is durable: a lost ack only means a redelivery, which `high_water` skips.
            with contextlib.suppress(*NO_ANSWER, nats.errors.Error):
                await msg.ack()
        self.high_water = max(self.high_water, self.buffer[-1][1]["seq"])
        self.archived += len(self.buffer)
        self.buffer.clear()
        self.oldest = None


class Archiver:
    def __init__(self, settings: ArchiverSettings, event_log: EventLog, blobs: BlobStore):
        self.settings, self.log, self.blobs = settings, event_log, blobs
        self.streams: list[StreamArchiver] = []

    async def run(self, stop: asyncio.Event) -> None:
        marks = await asyncio.to_thread(archived_high_water, self.blobs, self.settings.run_id)
        self.streams = [
            StreamArchiver(
                self.log,
                self.blobs,
                self.settings.run_id,
                stream,
                self.settings.archive,
                marks.get(stream.label, 0),
            )
            for stream in STREAMS
        ]
        await asyncio.gather(*(s.run(stop) for s in self.streams))

    @property
    def archived(self) -> int:
        return sum(s.archived for s in self.streams)


async def run_archiver(settings: ArchiverSettings) -> None:
    async def body(event_log: EventLog, stop: asyncio.Event) -> None:
        await Archiver(settings, event_log, open_blob_store(settings.blobs)).run(stop)

    await run_connected(settings, "archiver", body)


async def drain_once(settings: ArchiverSettings) -> int:
    """Archive everything in the log right now and return (for `--fresh` queries and benchmarks)."""
    event_log = await EventLog.connect(settings, worker="archiver-drain")
    try:
        archiver = Archiver(settings, event_log, open_blob_store(settings.blobs))
        stop = asyncio.Event()
        task = asyncio.create_task(archiver.run(stop))
        while True:
            await asyncio.sleep(0.2)
            pending = 0
            for stream in STREAMS:
                consumer = consumer_for(settings.run_id, ConsumerRole.ARCHIVER, stream)
                info = await event_log.js.consumer_info(stream.name, consumer.name)
                pending += info.num_pending + info.num_ack_pending
            buffered = sum(len(s.buffer) for s in archiver.streams)
            if task.done():
                task.result()
            if pending - buffered <= 0:  # all that is left sits in our buffers: the stop flushes it
                break
        stop.set()
        await task
        return archiver.archived
    finally:
        await event_log.close()
