"""Per-thread scratch buffers reused from chunk to chunk.

Fresh numpy arrays are fresh pages: every chunk paid a page fault per 4 KiB of its position and
plane buffers (measured: more than the diff itself at 10% density). Each pool thread keeps its own
buffers at their high-water mark instead; nothing in them outlives the chunk that filled them.
"""

from __future__ import annotations

import threading

import numpy as np


class Scratch(threading.local):
    def __init__(self) -> None:
        self._buffers: dict[str, np.ndarray] = {}

    def capacity(self, name: str, dtype) -> int:
        """How many elements of `dtype` the buffer `name` holds now (0 before its first use)."""
        buffer = self._buffers.get(name)
        return 0 if buffer is None else len(buffer) // np.dtype(dtype).itemsize

    def array(self, name: str, shape: int | tuple[int, ...], dtype, *, keep: int = 0) -> np.ndarray:
        """A C-contiguous array of `shape` over this thread's buffer `name`, grown when too small;
        when it grows, its first `keep` bytes are carried over."""
        dtype = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, int) else shape
        size = int(np.prod(shape)) * dtype.itemsize
        buffer = self._buffers.get(name)
        if buffer is None or len(buffer) < size:
            grown = np.empty(max(size, 2 * len(buffer) if buffer is not None else 0, 64), dtype=np.uint8)
            if buffer is not None and keep:
                grown[:keep] = buffer[:keep]
            self._buffers[name] = buffer = grown
        return buffer[:size].view(dtype).reshape(shape)
