"""Route parts that failed while materializing a version, and when each may be tried again.

A patch, skip patch or keyframe that fails (corrupt, missing, disagreeing with its version's hashes)
is set aside for an exponential, capped, jittered backoff: plans route around it meanwhile (a skip
patch, the keyframe path, an older keyframe), and it is tried again once the backoff has passed, so a
re-published blob is picked up without any island downloading a bad one in a hot loop. The counters
are what the island's metrics and the tests read.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """How long a failed route part stays set aside: exponential in its failures, capped, jittered."""

    first_s: float = 2.0
    max_s: float = 300.0
    jitter: float = 0.5
    """Up to this fraction of each delay is taken off at random, so islands do not retry in step."""

    def delay(self, failures: int, rng: random.Random) -> float:
        ceiling = min(self.max_s, self.first_s * 2.0 ** min(failures - 1, 60))
        return ceiling * (1.0 - self.jitter * rng.random())


PartKey = tuple
"""A route part: ("patch" | "skip", base, target), ("keyframe", version), or ("version", version)
(a version whose own files disagree, whatever the route)."""


def describe_part(key: PartKey) -> str:
    return f"{key[0]} v{key[1]}->v{key[2]}" if len(key) == 3 else f"{key[0]} v{key[1]}"


@dataclass(frozen=True)
class RouteFailure:
    part: str
    version: int
    """The version the failed part produces."""
    blob: str
    """The blob that failed ("" when the fault is not one blob's)."""
    reason: str
    failures: int
    """Failures in a row of this part (reset when it works)."""
    delay_s: float
    retry_at: float
    """Monotonic time after which plans may use the part again."""


class RouteFailures:
    """The route parts that failed, each kept out of plans until its backoff has passed, and the
    lifetime counters (total, and per blob) that metrics and tests read. Thread-safe: plans run in a
    worker thread while the island reads the counters."""

    def __init__(
        self, backoff: Backoff, *, clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None
    ):
        self.backoff = backoff
        self.total = 0
        self.by_blob: Counter[str] = Counter()
        self._clock = clock
        self._rng = rng or random.Random()
        self._open: dict[PartKey, RouteFailure] = {}
        self._lock = threading.Lock()

    def usable(self, key: PartKey) -> bool:
        with self._lock:
            failure = self._open.get(key)
        return failure is None or self._clock() >= failure.retry_at

    def record(self, key: PartKey, *, blob: str, reason: str) -> RouteFailure:
        with self._lock:
            previous = self._open.get(key)
            failures = 1 if previous is None else previous.failures + 1
            delay = self.backoff.delay(failures, self._rng)
            failure = RouteFailure(describe_part(key), key[-1], blob, reason, failures, delay, self._clock() + delay)
            self._open[key] = failure
            self.total += 1
            if blob:
                self.by_blob[blob] += 1
        return failure

    def cleared(self, key: PartKey) -> None:
        with self._lock:
            self._open.pop(key, None)

    def open(self) -> list[RouteFailure]:
        """Parts that failed last time they were tried, oldest version first."""
        with self._lock:
            return sorted(self._open.values(), key=lambda f: (f.version, f.part))

    def retry_in_s(self, lowest: int = 0, highest: int | None = None) -> float | None:
        """Seconds until the next set-aside part (producing a version in range) may be tried again; None
        when none is waiting (a part whose backoff has passed but that no plan uses is nothing to wait
        for: waking for it would be a busy loop)."""
        now = self._clock()
        waits = [f.retry_at - now for f in self.open() if f.retry_at > now and _within(f.version, lowest, highest)]
        return min(waits, default=None)

    def reasons(self, lowest: int = 0, highest: int | None = None) -> list[str]:
        return [f"{f.part}: {f.reason}" for f in self.open() if _within(f.version, lowest, highest)]


def _within(version: int, lowest: int, highest: int | None) -> bool:
    return version >= lowest and (highest is None or version <= highest)
