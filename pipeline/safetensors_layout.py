"""Where each tensor's bytes lie in a safetensors file, so they can be hashed or patched where they are.

A safetensors file is `u64 little-endian header length N | N bytes of JSON | data`. The JSON maps
each tensor name to `{dtype, shape, data_offsets: [begin, end]}` (offsets relative to the data) plus
an optional `__metadata__`. Nothing in the header depends on the tensors' values, so a patch that
keeps every tensor's dtype and shape can be applied into the file in place: map it, view each
tensor's byte range as unsigned bits (`pipeline.bits`), and let the codec write the changed
positions. Loading the shard and serializing it again (what a version cost before) is not needed.

The header is checked before anything is mapped: every range sized by its dtype and shape, and the
ranges laid end to end from the header to the end of the file, as the safetensors library requires
(a header whose tensors overlap could hash right while two tensors share bytes, and an in-place
write into one would then change the other unseen). The file itself must be a plain file of its
own: a shard that is a symlink, or a hard link another name shares, is refused, so an in-place
write never lands in a file outside the directory being built.

Tensors are normally aligned to their element size (the safetensors writers order them by alignment
and pad the header); one that is not can still be read and hashed, but is not handed to the codec's
kernels to patch in place (`TensorSpan.aligned`).
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import stat
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.bits import bits_dtype, checksum
from pipeline.errors import SprawlError

MAX_HEADER_BYTES = 100 * 1024 * 1024
"""The safetensors format's own limit on the JSON header."""


class ShardLayoutError(SprawlError):
    """A file that is not a well-formed safetensors shard (truncated, a header that lies about its data)."""

    def __init__(self, path: Path, detail: str):
        self.path = path
        super().__init__(
            f"{path} is not a usable safetensors shard: {detail}",
            hint="the version on disk is damaged; it is removed and materialized again",
        )


@dataclass(frozen=True)
class TensorSpan:
    """One tensor's bytes in its file: [begin, end) absolute offsets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def aligned(self) -> bool:
        return self.begin % bits_dtype(self.dtype).itemsize == 0


@dataclass(frozen=True)
class ShardLayout:
    path: Path
    tensors: dict[str, TensorSpan]
    file_bytes: int


def read_layout(path: Path) -> ShardLayout:
    """The shard's tensors and where their bytes are; ShardLayoutError when the header cannot be trusted
    to describe the file (which is then never mapped)."""
    try:
        with os.fdopen(open_plain_file(path, os.O_RDONLY), "rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            head = f.read(8)
            if len(head) < 8:
                raise ShardLayoutError(path, f"{size} bytes, shorter than the header length")
            (header_bytes,) = struct.unpack("<Q", head)
            if header_bytes > MAX_HEADER_BYTES or 8 + header_bytes > size:
                raise ShardLayoutError(path, f"header length {header_bytes} does not fit a file of {size} bytes")
            header = json.loads(f.read(header_bytes))
    except (OSError, ValueError) as exc:  # ValueError: JSON and UTF-8 decoding
        if isinstance(exc, ShardLayoutError):
            raise
        raise ShardLayoutError(path, f"unreadable header ({exc})") from exc
    if not isinstance(header, dict):
        raise ShardLayoutError(path, "the header is not a JSON object")
    data_start = 8 + header_bytes
    tensors: dict[str, TensorSpan] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        tensors[name] = _span(path, name, info, data_start, size)
    _check_tiling(path, tensors, data_start, size)
    return ShardLayout(path, tensors, size)


def open_plain_file(path: Path, flags: int) -> int:
    """A descriptor on `path` if it is a regular file no other name shares: not a symlink (O_NOFOLLOW),
    not a hard link. ShardLayoutError otherwise (OSError as it comes when the file cannot be opened)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if os.path.islink(path):
            raise ShardLayoutError(path, "it is a symlink (a shard must be a file of its own)") from exc
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        raise ShardLayoutError(
            path,
            f"not a plain file of its own (mode {oct(info.st_mode)}, {info.st_nlink} links): never written in place",
        )
    return fd


def _check_tiling(path: Path, tensors: dict[str, TensorSpan], data_start: int, size: int) -> None:
    """The tensors' ranges lie end to end from the data's start to the file's end (the safetensors
    library's own rule): no byte belongs to two tensors, none to no tensor."""
    position = data_start
    for span in sorted(tensors.values(), key=lambda s: (s.begin, s.end)):
        if span.begin != position:
            what = "overlap" if span.begin < position else "leave a gap"
            raise ShardLayoutError(path, f"tensors {what} at byte {min(span.begin, position)} (tensor {span.name!r})")
        position = span.end
    if position != size:
        raise ShardLayoutError(path, f"the tensors end at byte {position}, the file at {size}")


def _span(path: Path, name: str, info: object, data_start: int, size: int) -> TensorSpan:
    try:
        dtype = info["dtype"]  # type: ignore[index]
        shape = tuple(int(d) for d in info["shape"])  # type: ignore[index]
        begin, end = (int(o) for o in info["data_offsets"])  # type: ignore[index]
        width = bits_dtype(dtype).itemsize
    except (KeyError, TypeError, ValueError) as exc:
        raise ShardLayoutError(path, f"tensor {name!r}: malformed entry {info!r} ({exc!r})") from exc
    if any(d < 0 for d in shape) or end - begin != math.prod(shape) * width or begin < 0:
        raise ShardLayoutError(path, f"tensor {name!r}: offsets {begin}..{end} do not hold {shape} x {dtype}")
    if data_start + end > size:
        raise ShardLayoutError(path, f"tensor {name!r} ends at {data_start + end}, past the file's {size} bytes")
    return TensorSpan(name, dtype, shape, data_start + begin, data_start + end)


MADV_POPULATE_WRITE = 23
"""Linux >= 5.14 (not named by Python 3.11's mmap module): fault a range in writable, in the kernel."""


class MappedShard:
    """A shard's file mapped into memory: `arrays` holds each tensor as a flat unsigned-bits array over
    the file's own pages (no copy)."""

    def __init__(self, layout: ShardLayout, *, writable: bool):
        self.layout = layout
        self._map: mmap.mmap | None = None
        if layout.file_bytes == 0 or not layout.tensors:
            self.arrays = {name: np.zeros(0, dtype=bits_dtype(s.dtype)) for name, s in layout.tensors.items()}
            return
        flags = os.O_RDWR if writable else os.O_RDONLY
        with os.fdopen(open_plain_file(layout.path, flags), "r+b" if writable else "rb") as f:
            access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
            self._map = mmap.mmap(f.fileno(), 0, access=access)
        whole = np.frombuffer(self._map, dtype=np.uint8)
        self.arrays = {name: whole[s.begin : s.end].view(bits_dtype(s.dtype)) for name, s in layout.tensors.items()}

    def prefault_for_writes(self, name: str) -> None:
        """Make the tensor's pages writable in one call instead of one page fault per page written.

        Page by page, a write fault (and the filesystem's `page_mkwrite`) costs more than the patch
        itself: measured 40-130 ms per 115 MB here (most with the large folios a file written by
        write() gets), against under 10 ms for the same range populated at once. Every page in the
        range is marked dirty, so only ranges the patch writes nearly everywhere are prefaulted (the
        caller decides). Where the kernel does not know the call, the writes fault page by page."""
        span = self.layout.tensors[name]
        if self._map is None or span.nbytes == 0:
            return
        start = span.begin - span.begin % mmap.PAGESIZE
        with contextlib.suppress(OSError, ValueError):  # an older kernel: plain page faults, just slower
            self._map.madvise(MADV_POPULATE_WRITE, start, span.end - start)

    def close(self) -> None:
        """Unmap (once the caller's views are gone; otherwise when they are). Nothing is flushed on
        purpose: a version's bits are checked against its root hash the first time a process uses it,
        which catches what a crash or a power loss tore, at no cost per version."""
        self.arrays = {}
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a caller still holds a view: unmapped when it is dropped
                self._map.close()
            self._map = None


@contextmanager
def mapped_tensors(layout: ShardLayout, *, writable: bool) -> Iterator[MappedShard]:
    """The shard mapped (`MappedShard`), unmapped on exit. Writable: writes go to the page cache and
    reach the disk with the kernel's writeback."""
    mapped = MappedShard(layout, writable=writable)
    try:
        yield mapped
    finally:
        mapped.close()


def hash_shard(layout: ShardLayout) -> dict[str, str]:
    """xxh3-128 of every tensor's bytes, read from the page cache through a read-only mapping."""
    with mapped_tensors(layout, writable=False) as mapped:
        return {name: checksum(bits) for name, bits in mapped.arrays.items()}
