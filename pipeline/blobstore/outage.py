"""Riding out an object-store outage on writes: wait with backoff, visibly, for up to a patience.

Every blob the run writes (policy keyframes and patches, lineage, trainer checkpoints, claim-checked
events) comes before the event that points at it, so a writer that gave up at the first refused
connection stopped the run over an outage of seconds: the trainer exited, a sampler lost its
trajectory's append. `ride_out_outage` retries the same write while the store is unavailable
(`BlobStoreUnavailable`: refused, reset, timed out, throttled), waiting 1 s, 2 s, 4 s ... at most
10 s between attempts, until the write lands or the store has been unavailable for the patience
(`blobs.outage_patience_s`). Then it fails loudly, as before, with `BlobStoreOutlasted` (still a
`BlobStoreUnavailable`, so every caller's handling is unchanged): nothing is dropped, nothing faked,
and since the event is appended only after its blobs, no event ever names a blob that is not stored.

Only the outage is retried: a refusal (credentials, grants), a missing bucket or a checksum the
server rejected gets the same answer every time and raises at once.

While it waits the writer is visible: one structlog warning per failed attempt (`blob store
unavailable: waiting`, with what is being written, since when and for how long), a line when the
store answers again, and `blob_store_waits()`, this process's writes waiting right now, for
whatever reports the process's health.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from pipeline.errors import BlobStoreUnavailable, SprawlError
from pipeline.logs import get_logger

log = get_logger(__name__)

T = TypeVar("T")

FIRST_RETRY_S = 1.0
"""Wait before the second attempt; doubled after every failed attempt ..."""
MAX_RETRY_S = 10.0
"""... up to this: an outage that ends is noticed within 10 s, and a long one costs one attempt per 10 s."""


class BlobStoreOutlasted(BlobStoreUnavailable):
    """The store stayed unavailable for longer than the writer's patience: the write is given up."""

    def __init__(self, last: BlobStoreUnavailable, what: str, waited_s: float, attempts: int, patience_s: float):
        self.last, self.what, self.waited_s, self.attempts = last, what, waited_s, attempts
        self.endpoint, self.retry_after_s = last.endpoint, None
        SprawlError.__init__(
            self,
            f"the blob store was unavailable for {waited_s:.1f}s ({attempts} attempts) while writing {what}, "
            f"longer than blobs.outage_patience_s={patience_s:g}: {last.message}",
            hint=f"{last.hint}; a longer outage is waited out with a larger blobs.outage_patience_s "
            "(SPRAWL_BLOBS__OUTAGE_PATIENCE_S)",
        )


@dataclass(frozen=True)
class BlobWait:
    """One write waiting for the store right now."""

    what: str
    since: float
    """Unix time the first failed attempt began."""
    attempts: int
    error: str
    """The last attempt's error."""


_waits: dict[int, BlobWait] = {}
_waits_lock = threading.Lock()
_wait_ids = itertools.count()


def blob_store_waits() -> list[BlobWait]:
    """This process's writes waiting for the blob store now, oldest first (empty while it answers)."""
    with _waits_lock:
        return sorted(_waits.values(), key=lambda w: w.since)


def blob_store_waiting_since() -> float | None:
    """Unix time since which a write of this process has been waiting for the store; None if none is."""
    waits = blob_store_waits()
    return waits[0].since if waits else None


def ride_out_outage(
    write: Callable[[], T],
    *,
    what: str,
    patience_s: float,
    sleep: Callable[[float], object] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """`write()`'s result, retried with backoff while it raises BlobStoreUnavailable, for up to
    `patience_s` seconds after the first failure; then BlobStoreOutlasted. `write` must be safe to
    repeat (an S3 PUT of the same key and bytes is). Blocking: call it from a thread, as every blob
    store call is. `patience_s` 0: one attempt, its error raised as it is. `sleep` and `clock`: the
    waiting and the time it is measured by (a test's own)."""
    if patience_s <= 0:
        return write()
    delay = FIRST_RETRY_S
    attempts = 0
    began = since = 0.0
    wait_id = next(_wait_ids)
    try:
        while True:
            if not attempts:  # the outage is counted from the start of the first attempt it failed
                began, since = clock(), time.time()
            try:
                result = write()
            except BlobStoreUnavailable as exc:
                attempts += 1
                waited = clock() - began
                with _waits_lock:
                    _waits[wait_id] = BlobWait(what, since, attempts, exc.message)
                if waited >= patience_s:
                    log.error(
                        "blob store unavailable for longer than the patience: giving up",
                        what=what,
                        waited_s=round(waited, 1),
                        attempts=attempts,
                        patience_s=patience_s,
                        error=exc.message,
                    )
                    raise BlobStoreOutlasted(exc, what, waited, attempts, patience_s) from exc
                pause = min(delay, patience_s - waited)  # the last attempt lands at the patience, not past it
                log.warning(
                    "blob store unavailable: waiting",
                    what=what,
                    since=since,
                    waited_s=round(waited, 1),
                    attempts=attempts,
                    retry_in_s=round(pause, 2),
                    patience_s=patience_s,
                    error=exc.message,
                )
                sleep(pause)
                delay = min(delay * 2, MAX_RETRY_S)
                continue
            if attempts:
                log.warning(
                    "blob store answers again",
                    what=what,
                    waited_s=round(clock() - began, 1),
                    attempts=attempts + 1,
                )
            return result
    finally:
        with _waits_lock:
            _waits.pop(wait_id, None)
