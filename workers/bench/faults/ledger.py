"""What the run's log, archive and lineage blobs hold, read by the harness itself.

The invariants are judged from these readings, never from what a worker says about itself: the log
is scanned raw (an ephemeral, ack-less consumer per stream, every message of the run, decodable or
not), the archive through DuckDB over its Parquet files (`pipeline.sql.open_duckdb`), and the lineage
blob of every version from the blob store.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from datetime import datetime

import nats.errors
from nats.js import api

from pipeline.errors import PoisonEvent, SprawlError, TransientError
from pipeline.eventlog import EventLog
from pipeline.topology import STREAMS, Stream
from schemas import Event, PolicyVersion
from schemas.archive import ROW_COLUMNS, UNDECODABLE, ArchiveKey, parquet_glob, run_prefix
from schemas.lineage import Lineage, LineageDecodeError, decode_lineage

_STREAM_COLUMN, _SEQ_COLUMN = ROW_COLUMNS[:2]
"""Every archived row's stream label and stream sequence (the first two of the archiver's own columns)."""


@dataclass(frozen=True)
class LoggedMessage:
    """One message of the run as the server holds it."""

    stream: str
    """The stream's label (lowercase), as the archive names it."""
    seq: int
    subject: str
    stored_at: datetime
    event_type: str
    """The event's type tag, or `undecodable` (what the archiver files it under)."""
    event: Event | None
    data: bytes
    headers: dict[str, str]


async def scan_stream(
    event_log: EventLog, stream: Stream, run_id: str | None, *, batch: int = 512
) -> list[LoggedMessage]:
    """Every message of `run_id` (None: of every run) on `stream`, in stream order. Raises when the
    server stops answering."""
    subject_filter = stream.run_filter(run_id) if run_id is not None else stream.subjects[0]
    config = api.ConsumerConfig(
        ack_policy=api.AckPolicy.NONE,
        deliver_policy=api.DeliverPolicy.ALL,
        filter_subject=subject_filter,
        inactive_threshold=60.0,
        mem_storage=True,
        num_replicas=1,
    )
    sub = await event_log.js.pull_subscribe(subject_filter, durable=None, stream=stream.name, config=config)
    out: list[LoggedMessage] = []
    info = None
    try:
        info = await sub.consumer_info()
        remaining = info.num_pending
        while remaining > 0:
            msgs = await sub.fetch(min(batch, remaining), timeout=10.0)
            for msg in msgs:
                remaining = msg.metadata.num_pending
                out.append(await _logged(event_log, stream, msg))
    finally:
        with contextlib.suppress(nats.errors.Error, TimeoutError):
            await sub.unsubscribe()
        if info is not None:  # else the server reaps it after `inactive_threshold`
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                await event_log.js.delete_consumer(stream.name, info.name)
    return out


async def _logged(event_log: EventLog, stream: Stream, msg) -> LoggedMessage:
    try:
        event: Event | None = await event_log.resolve(msg.data, subject=msg.subject)
    except PoisonEvent:
        event = None
    except TransientError:
        raise  # the store did not answer: this reading would be wrong, not merely incomplete
    except SprawlError:  # e.g. a claim check to a bucket that does not exist: it can never decode
        event = None
    meta = msg.metadata
    return LoggedMessage(
        stream=stream.label,
        seq=meta.sequence.stream,
        subject=msg.subject,
        stored_at=meta.timestamp,
        event_type=type(event).type_tag() if event is not None else UNDECODABLE,
        event=event,
        data=bytes(msg.data),
        headers={k: str(v) for k, v in (msg.headers or {}).items()},
    )


async def scan_run(event_log: EventLog, run_id: str) -> dict[str, list[LoggedMessage]]:
    """Stream label -> every message of the run on that stream."""
    return {stream.label: await scan_stream(event_log, stream, run_id) for stream in STREAMS}


async def scan_with_retries(event_log: EventLog, run_id: str, guard_s: float) -> dict[str, list[LoggedMessage]]:
    """`scan_run`, tried again while the log is coming back (after a fault), for at most `guard_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + guard_s
    while True:
        try:
            return await scan_run(event_log, run_id)
        except (nats.errors.Error, TimeoutError, TransientError):
            if loop.time() > deadline:
                raise
            await asyncio.sleep(1.0)


def positions(scan: dict[str, list[LoggedMessage]]) -> set[tuple[str, int]]:
    return {(m.stream, m.seq) for messages in scan.values() for m in messages}


# ---------------------------------------------------------------- the archive


@dataclass(frozen=True)
class ArchivedRow:
    event_type: str
    stream: str
    seq: int


def scan_archive(settings, run_id: str) -> list[ArchivedRow]:
    """Every row archived for the run (duplicates included), read with DuckDB over the Parquet files."""
    from pipeline.blobstore import S3BlobStore, open_blob_store
    from pipeline.sql import open_duckdb

    blobs = open_blob_store(settings.blobs)
    if not ArchiveKey.parse_listing(blobs.list_keys(run_prefix(run_id))):
        return []
    con = open_duckdb(settings)
    try:
        bucket = S3BlobStore(settings.blobs).bucket
        path = f"s3://{bucket}/{parquet_glob(run_id)}"
        rows = con.execute(
            f'SELECT event_type, "{_STREAM_COLUMN}", "{_SEQ_COLUMN}" FROM '
            f"read_parquet('{path}', hive_partitioning = true, union_by_name = true)"
        ).fetchall()
    finally:
        con.close()
    return [ArchivedRow(str(t), str(s), int(q)) for t, s, q in rows]


# ---------------------------------------------------------------- lineage


def versions_in(scan: dict[str, list[LoggedMessage]]) -> list[tuple[PolicyVersion, LoggedMessage]]:
    """The run's policy versions as stored (every message, so a second v1 shows as two)."""
    return [(m.event, m) for m in scan.get("policy", []) if isinstance(m.event, PolicyVersion)]


def read_lineages(blobs, versions: list[PolicyVersion]) -> tuple[dict[int, Lineage], dict[int, str]]:
    """(version -> its lineage, version -> why it could not be read) for every version that has one."""
    found, unreadable = {}, {}
    for event in versions:
        if event.lineage_uri is None:
            continue
        try:
            found[event.version] = decode_lineage(blobs.get_bytes(event.lineage_uri))
        except (SprawlError, LineageDecodeError) as exc:
            unreadable[event.version] = str(exc)
    return found, unreadable
