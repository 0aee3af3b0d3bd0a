"""The archive's layout: where the archiver puts each Parquet file, and what its rows hold.

    archive/run_id=<run>/event_type=<type>/date=<YYYY-MM-DD>/<stream>-<first seq>-<last seq>.parquet

A hive layout, so DuckDB reads `run_id`, `event_type` and `date` as columns; files are named by
their stream-sequence range, so a retried flush overwrites its file instead of adding a duplicate,
and a restarted archiver finds each stream's high-water mark in the file names alone. The
archiver writes keys and the audit reads them through `ArchiveKey` only.
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

ROW_COLUMNS = ("stream", "seq", "subject", "published_at", "payload")
"""Columns every archived row has, besides its event's fields; they win over an event field of the
same name (a dead letter's own `stream` and `payload` are then read from `payload`)."""
JSON_TEXT_FIELDS = frozenset({"per_group", "components", "details", "kernels", "headers", "metadata", "tensors"})
"""Event fields with open-ended keys (or mixed arrays), archived as JSON text instead of a struct column."""

_DIGITS = 12  # sequence numbers are zero-padded so file names sort in stream order
_KEY = re.compile(
    rf"^{ARCHIVE_ROOT}/run_id=(?P<run_id>[^/]+)/event_type=(?P<event_type>[^/]+)/date=(?P<date>[^/]+)/"
    rf"(?P<stream>[a-z_]+)-(?P<first_seq>\d{{{_DIGITS}}})-(?P<last_seq>\d{{{_DIGITS}}})\.parquet$"
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

    def to_key(self) -> str:
        return (
            f"{event_type_prefix(self.run_id, self.event_type)}date={self.date}/"
            f"{self.stream}-{self.first_seq:0{_DIGITS}d}-{self.last_seq:0{_DIGITS}d}.parquet"
        )

    @classmethod
    def parse(cls, key: str) -> ArchiveKey:
        """The key's fields; ValueError for a key that is not an archive file's."""
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"{key!r} is not an archive file key ({ARCHIVE_ROOT}/run_id=/event_type=/date=/...)")
        fields = match.groupdict()
        return cls(**{**fields, "first_seq": int(fields["first_seq"]), "last_seq": int(fields["last_seq"])})

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
