"""What the archiver writes: one row per message, and one Parquet file per event type and day.

A row is the log's envelope of the message (`schemas.archive.ROW_COLUMNS`: stream, sequence,
subject, when the log stored it, the bytes it stored) beside the decoded event's fields under their
own names. The two never share a column: a dead letter's `stream` is the stream of the message it
refused and its `payload` the refused bytes, while `log_stream` is DEADLETTER.
"""

from __future__ import annotations

import io
import json
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
from nats.aio.msg import Msg

from pipeline.topology import Stream
from schemas import Event
from schemas.archive import JSON_TEXT_FIELDS, LOG_SEQ, ROW_COLUMNS, ArchiveKey, archive_date


def envelope(stream: Stream, msg: Msg) -> dict:
    """The `log_*` columns of a message: where and when the log stored it, and what it stored."""
    meta = msg.metadata
    values = (stream.label, meta.sequence.stream, msg.subject, meta.timestamp, bytes(msg.data))
    return dict(zip(ROW_COLUMNS, values, strict=True))


def event_row(stream: Stream, msg: Msg, event: Event) -> dict:
    fields = _columns(msgspec.to_builtins(event, builtin_types=(datetime, bytes)))
    fields.pop("type", None)  # the event_type column (and partition) says it
    row = envelope(stream, msg)
    assert not fields.keys() & row.keys(), f"{type(event).type_tag()} has a field named like a log_ column"
    return {**fields, **row, "event_type": type(event).type_tag()}


def undecodable_row(stream: Stream, msg: Msg, reason: str, error_class: str) -> dict:
    return {**envelope(stream, msg), "reason": reason, "error_class": error_class}


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


@dataclass(frozen=True)
class ArchiveFile:
    key: ArchiveKey
    rows: list[dict]

    def to_parquet(self) -> bytes:
        buffer = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(self.rows), buffer, compression="zstd")
        return buffer.getvalue()


def archive_files(run_id: str, stream: Stream, rows: list[tuple[str, dict]]) -> list[ArchiveFile]:
    """The files of one flush: `rows` ((event type, row) pairs) split by event type and day, each
    file's rows in stream order and its key naming its range and row count."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for event_type, row in rows:
        published = row["log_published_at"]
        day = archive_date(published if isinstance(published, datetime) else None)
        groups[(event_type, day)].append(row)
    files = []
    for (event_type, day), group in groups.items():
        group.sort(key=lambda row: row[LOG_SEQ])
        key = ArchiveKey(
            run_id=run_id,
            event_type=event_type,
            date=day,
            stream=stream.label,
            first_seq=group[0][LOG_SEQ],
            last_seq=group[-1][LOG_SEQ],
            rows=len(group),
        )
        files.append(ArchiveFile(key, group))
    return files
