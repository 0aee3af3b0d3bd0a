"""A tensor's xxh3-128 computed chunk by chunk, in order, while its chunks are coded or applied.

A large tensor's checksum is one sequential hash over all its bytes: computed after every chunk is
done, it is a serial pass over memory that no longer sits in cache (for a 128 MB tensor, as long as
all its chunks' work spread over two threads). Fed each chunk's bytes as soon as that chunk and all
before it are done, the hash runs beside the other chunks, on bytes that are still hot. The result
is the same digest as pipeline.bits.checksum of the whole tensor.
"""

from __future__ import annotations

import threading

import numpy as np
import xxhash


class OrderedHash:
    """xxh3-128 of `bits`, fed range by range in order as ranges are reported done (any order, any
    thread). Whoever completes the next range in order hashes it and any done after it; the others
    return at once, so no thread ever waits for another."""

    def __init__(self, bits: np.ndarray, bounds: list[tuple[int, int]]):
        self._bits = bits
        self._bounds = bounds
        self._done = [False] * len(bounds)
        self._next = 0
        self._busy = False
        self._lock = threading.Lock()
        self._hash = xxhash.xxh3_128()

    def done(self, index: int) -> None:
        with self._lock:
            self._done[index] = True
            if self._busy:
                return
            self._busy = True
        while True:
            with self._lock:
                if self._next >= len(self._bounds) or not self._done[self._next]:
                    self._busy = False
                    return
                lo, hi = self._bounds[self._next]
            if hi > lo:
                self._hash.update(memoryview(np.ascontiguousarray(self._bits[lo:hi])).cast("B"))
            with self._lock:
                self._next += 1

    def hexdigest(self) -> str:
        """The digest once every range is done (the caller's futures say when)."""
        if self._next != len(self._bounds):
            raise RuntimeError(f"hash of {len(self._bounds)} ranges read after {self._next}")
        return self._hash.hexdigest()
