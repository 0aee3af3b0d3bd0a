"""The archive's layout: where the archiver puts each Parquet file, and what its rows hold.

    archive/run_id=<run>/event_type=<type>/date=<YYYY-MM-DD>/<stream>-<first seq>-<last seq>-n<rows>.parquet

A hive layout, so DuckDB reads `run_id`, `event_type` and `date` as columns; files are named by
their stream-sequence range and row count, so a retried flush overwrites its file instead of adding
a duplicate, and a restarted archiver knows which sequences a file holds from its name alone when
the file is dense (rows = last - first + 1), reading only its `log_seq` column otherwise. (Files of
older archivers have no `-n<rows>`: they are read.) The archiver writes keys and the audit reads
them through `ArchiveKey` only.

A row is the log's envelope of the message (the `log_*` columns: where and when the log stored it,
and the bytes it stored) beside the decoded event's own fields, under their own names: the two
never share a column, so a dead letter's `stream` and `payload` (the refused message's) survive.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Annotated

import msgspec

ARCHIVE_ROOT = "archive"
"""Top-level prefix of the archive in the bucket."""
UNKNOWN_DATE = "unknown"
"""The date of a message the server stored without a timestamp."""
UNDECODABLE = "undecodable"
"""The event type of messages that did not decode (archived with the reason, never dropped)."""

LOG_SEQ = "log_seq"
"""The column of a row's stream sequence (what a restarted archiver reads of a file that is not dense)."""
ROW_COLUMNS = ("log_stream", LOG_SEQ, "log_subject", "log_published_at", "log_payload")
"""Columns every archived row has, besides its event's fields: the stream (label), the stream
sequence, the subject, when the log stored it and the bytes it stored. Prefixed so no event field
can collide with them (tests/test_archiver.py checks every event type)."""
UNDECODABLE_COLUMNS = ("reason", "error_class")
"""What an undecodable row has besides ROW_COLUMNS: why it did not decode, and its poison class."""
JSON_TEXT_FIELDS = frozenset(
    {"per_group", "components", "details", "kernels", "headers", "metadata", "tensors", "series", "per_island"}
)
"""Event fields with open-ended keys (or mixed arrays), archived as JSON text instead of a struct column."""

_DIGITS = 12  # sequence numbers are zero-padded so file names sort in stream order
_KEY = re.compile(
    rf"^{ARCHIVE_ROOT}/run_id=(?P<run_id>[^/]+)/event_type=(?P<event_type>[^/]+)/date=(?P<date>[^/]+)/"
    rf"(?P<stream>[a-z_]+)-(?P<first_seq>\d{{{_DIGITS}}})-(?P<last_seq>\d{{{_DIGITS}}})(?:-n(?P<rows>[1-9]\d*))?"
    r"\.parquet$"
)

Date = Annotated[str, msgspec.Meta(pattern=rf"^(\d{{4}}-\d{{2}}-\d{{2}}|{UNKNOWN_DATE})$")]
StreamLabel = Annotated[str, msgspec.Meta(pattern=r"^[a-z_]+$", description="lowercase stream name")]
Seq = Annotated[int, msgspec.Meta(ge=1, lt=10**_DIGITS)]


class ArchiveKey(msgspec.Struct, frozen=True, kw_only=True):
    """One Parquet file of the archive: events of one type, one day and one stream, in a sequence range."""

    run_id: str
    event_type: str
    """An event's `type` tag (e.g. `trajectory.v1`), or `undecodable`."""
    date: Date
    """UTC day the server stored the events."""
    stream: StreamLabel
    first_seq: Seq
    """Stream sequence of the file's first event."""
    last_seq: Seq
    """... and of its last; a retried flush covers the same range and overwrites the file."""
    rows: Seq | None = None
    """How many rows (one per sequence) the file holds; None in the keys of older archivers."""

    @property
    def dense(self) -> bool:
        """The file holds every sequence from first to last: its name alone says which."""
        return self.rows == self.last_seq - self.first_seq + 1

    def to_key(self) -> str:
        rows = f"-n{self.rows}" if self.rows is not None else ""
        return (
            f"{event_type_prefix(self.run_id, self.event_type)}date={self.date}/"
            f"{self.stream}-{self.first_seq:0{_DIGITS}d}-{self.last_seq:0{_DIGITS}d}{rows}.parquet"
        )

    @classmethod
    def parse(cls, key: str) -> ArchiveKey:
        """The key's fields; ValueError for a key that is not an archive file's."""
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"{key!r} is not an archive file key ({ARCHIVE_ROOT}/run_id=/event_type=/date=/...)")
        fields = match.groupdict()
        numbers = {name: int(fields[name]) for name in ("first_seq", "last_seq", "rows") if fields[name] is not None}
        return cls(**{**fields, **numbers})

    @classmethod
    def parse_listing(cls, keys: Iterable[str]) -> list[ArchiveKey]:
        """The archive files among listed keys; anything else under the prefix is not the archiver's."""
        return [cls.parse(k) for k in keys if _KEY.match(k)]


def archive_date(published_at: datetime | None) -> str:
    """The `date=` of an event: the UTC day the server stored it."""
    if published_at is None:
        return UNKNOWN_DATE
    return published_at.astimezone(UTC).strftime("%Y-%m-%d")


def run_prefix(run_id: str) -> str:
    """Everything archived of one run."""
    return f"{ARCHIVE_ROOT}/run_id={run_id}/"


def event_type_prefix(run_id: str, event_type: str) -> str:
    return f"{run_prefix(run_id)}event_type={event_type}/"


def parquet_glob(run_id: str, event_type: str = "*", stream: str = "*") -> str:
    """A glob over the run's files (of one event type, of one stream), for DuckDB's `read_parquet`."""
    return f"{event_type_prefix(run_id, event_type)}date=*/{stream}-*.parquet"
