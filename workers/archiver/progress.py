"""Which stream sequences the archive already holds: the archiver's progress, kept per message.

The rule has two halves: a message is acked only once a file holding its row is in the object
store, and a message is written only if no file holds it yet. `ArchivedSeqs` answers both; a stream
archiver builds it on start from the archive itself (before its first fetch) and adds to it after
each PUT. Why nothing is lost or written twice, whatever the order of redelivery and wherever a
SIGKILL lands:

- Killed before a PUT: nothing of the buffer was written or acked; JetStream redelivers every one of
  those messages after its ack wait, none is in a file, so each is written once.
- Killed between a PUT and its acks, or in the middle of the acks: the file is durable and its name
  (or its `log_seq` column) says what it holds. The restarted archiver reads that before it fetches,
  and acks the redeliveries of those sequences without writing them again.
- Redeliveries in any order: membership is per sequence, not a high-water mark, so writing newer
  messages first says nothing about older ones. (The high-water mark it replaces acked redelivered
  older messages unwritten: 214 rows lost after one kill.)
- A redelivery while the message is still buffered (its ack wait ran out during an outage) replaces
  the buffered delivery instead of adding a second row.

What a file holds is read from its key when the file is dense (as many rows as its range has
sequences; a sequence appears at most once per file), and from its `log_seq` column otherwise (a
file of one event type from a stream that interleaves several). Only files reaching above the
consumer's ack floor are read: JetStream never redelivers a sequence at or below it.

One archiver per run at a time: a second one, started later, would not know the first one's newest
files (`sprawl up` runs one, and its final drain runs after that one has stopped).
"""

from __future__ import annotations

import io
from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Iterable

import pyarrow.parquet as pq

from pipeline.blobstore import BlobStore
from schemas.archive import LOG_SEQ, ArchiveKey, run_prefix

_OLD_SEQ = "seq"
"""The sequence column of files written before the envelope columns were prefixed."""


class ArchivedSeqs:
    """A set of stream sequences, stored as disjoint sorted ranges (an archive is mostly runs)."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []

    def __contains__(self, seq: int) -> bool:
        i = bisect_right(self._starts, seq) - 1
        return i >= 0 and seq <= self._ends[i]

    def add_range(self, first: int, last: int) -> None:
        """Add first..last (inclusive), merging with the ranges it overlaps or touches."""
        lo = bisect_left(self._ends, first - 1)  # the first range ending at or after first - 1
        hi = bisect_right(self._starts, last + 1)  # past the last range starting at or before last + 1
        if lo < hi:
            first, last = min(first, self._starts[lo]), max(last, self._ends[hi - 1])
        self._starts[lo:hi] = [first]
        self._ends[lo:hi] = [last]

    def add_all(self, seqs: Iterable[int]) -> None:
        ordered = sorted(set(seqs))
        start = 0
        for i in range(1, len(ordered) + 1):
            if i == len(ordered) or ordered[i] != ordered[i - 1] + 1:
                self.add_range(ordered[start], ordered[i - 1])
                start = i

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._ends, strict=True))

    def __len__(self) -> int:
        return sum(last - first + 1 for first, last in self.ranges)


def archived_seqs(blobs: BlobStore, run_id: str, ack_floors: dict[str, int]) -> dict[str, ArchivedSeqs]:
    """The sequences above each stream's ack floor (keyed by stream label) that archive files hold.

    Lists the run's archive once; reads the `log_seq` column of the files that are not dense and
    reach above their stream's floor. Blob store errors propagate (an unreachable store is not an
    empty archive)."""
    found: dict[str, ArchivedSeqs] = defaultdict(ArchivedSeqs)
    for key in ArchiveKey.parse_listing(blobs.list_keys(run_prefix(run_id))):
        floor = ack_floors.get(key.stream, 0)
        if key.last_seq <= floor:
            continue
        if key.dense:
            found[key.stream].add_range(key.first_seq, key.last_seq)
        else:
            found[key.stream].add_all(_seqs_in(blobs, key))
    return found


def _seqs_in(blobs: BlobStore, key: ArchiveKey) -> list[int]:
    data = blobs.get_bytes(blobs.uri(key.to_key()))
    names = pq.ParquetFile(io.BytesIO(data)).schema_arrow.names
    column = LOG_SEQ if LOG_SEQ in names else _OLD_SEQ
    return pq.read_table(io.BytesIO(data), columns=[column]).column(column).to_pylist()
