"""The lossless patch codec: bits of a target tensor as changes against a base tensor.

Format v2 (little-endian throughout; docs/FORMAT.md has it byte for byte):

    b"SPRWLPCH" | u16 format version (2) | u32 header length | zstd(msgpack PatchHeader) | payload

The header lists groups (tensors of one dtype coded as one flat array), their tensors (name, shape,
xxh3-128 of base and target bits, changed count) and their chunks (start, length, changed, offset
and size of the chunk's record in the payload). Tensors are cut into chunks (default 4 Mi
elements) so work spreads over a thread pool. A chunk record is empty when nothing changed, else

    u8 mode (1 sparse, 2 dense) | u8 transform (0 xor, 1 ulp, 2 raw) | streams

- sparse: 4 streams, the byte planes of the u32 gaps between changed positions (gap = position -
  previous - 1, the first previous being -1), least significant plane first; then `width` streams,
  the byte planes of the changed elements' transformed values;
- dense: `width` streams, the byte planes of every element's transformed value (0 where unchanged
  for xor and ulp).

Transforms (pipeline.codec.kernels): xor with the base bits; ulp, the zigzagged signed distance
between old and new bit patterns in float order; raw, the new bits. The encoder picks per chunk
whichever codes smallest. Each stream is `u8 codec | u32 raw length | u32 coded length | bytes`
with codec 0 stored, 1 constant (one byte repeated), 2 rANS order-0 (pipeline.codec.rans), 3 zstd.

Nothing is computed in floating point: integer operations on unsigned views (pipeline.bits), so
every bit pattern round-trips. The hot loops are numba kernels that release the GIL.
"""

from __future__ import annotations

import math
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import msgspec
import numpy as np
import zstandard

from pipeline.bits import bits_dtype, checksum
from pipeline.codec import kernels, rans
from pipeline.codec.hashing import OrderedHash
from pipeline.codec.scratch import Scratch
from pipeline.errors import SprawlError

MAGIC = b"SPRWLPCH"
FORMAT_VERSION = 2
_PREAMBLE = struct.Struct("<8sHI")
DEFAULT_CHUNK_ELEMENTS = 1 << 22  # measured with bench delta: fewer, larger chunks beat finer thread balance
MAX_CHUNK_ELEMENTS = 1 << 30  # gaps are coded as u32
ZSTD_LEVEL = 3  # for the streams of whole-chunk records, where zstd is tried beside rANS

SPARSE, DENSE = 1, 2
STORED, CONSTANT, RANS, ZSTD = 0, 1, 2, 3
_RECORD_HEAD = struct.Struct("<BB")
_STREAM_HEAD = struct.Struct("<BII")


class PatchFormatError(SprawlError, ValueError):
    """Bytes that are not a patch this codec can read, or a patch that does not fit its base.

    Poison for this patch, never transient: the same bytes fail the same way. A ValueError too, as before."""

    def __init__(
        self,
        message: str,
        *,
        hint: str = "do not apply this patch; materialize from a keyframe instead (the materializer does)",
    ):
        super().__init__(message, hint=hint)


class ChunkEntry(msgspec.Struct, frozen=True, array_like=True):
    start: int
    """First element of the chunk in its group's flat array (0 when the group holds several tensors)."""
    length: int
    changed: int
    offset: int
    """Where the chunk's record starts in the payload."""
    size: int
    """The record's length in bytes: 0 when nothing changed."""


class TensorEntry(msgspec.Struct, frozen=True):
    name: str
    shape: list[int]
    offset: int
    """Where the tensor starts in its group's flat element array."""
    base_checksum: bytes
    """xxh3-128 of the base bits (16 bytes; empty for a new tensor)."""
    target_checksum: bytes
    changed: int


class GroupEntry(msgspec.Struct, frozen=True):
    """Tensors of one dtype coded as one flat array: small tensors share one chunk, a large one is chunked."""

    dtype: str
    elements: int
    has_base: bool
    tensors: list[TensorEntry]
    chunks: list[ChunkEntry]


class PatchHeader(msgspec.Struct, frozen=True):
    format_version: int
    view: str
    base_version: int
    target_version: int
    groups: list[GroupEntry]
    payload_bytes: int

    def tensor_names(self) -> list[str]:
        return [t.name for g in self.groups for t in g.tensors]


@dataclass(frozen=True)
class TensorBits:
    """One tensor's bits (flat unsigned array) with its dtype name and shape."""

    dtype: str
    shape: tuple[int, ...]
    bits: np.ndarray


class _Zstd:
    """Per-thread zstd contexts (they are not thread-safe)."""

    def __init__(self, level: int):
        self.level = level
        self._local = threading.local()

    def compress(self, data) -> bytes:
        ctx = getattr(self._local, "c", None)
        if ctx is None:
            ctx = self._local.c = zstandard.ZstdCompressor(level=self.level)
        return ctx.compress(data)

    def decompress(self, data, size: int) -> bytes:
        ctx = getattr(self._local, "d", None)
        if ctx is None:
            ctx = self._local.d = zstandard.ZstdDecompressor()
        return _one_frame(ctx, data, size)


def _one_frame(ctx: zstandard.ZstdDecompressor, data, limit: int) -> bytes:
    """Exactly one zstd frame that declares its size (at most `limit`), and nothing after it.

    python-zstandard ignores bytes after a frame; a reader written from docs/FORMAT.md refuses them,
    so this one does too (two readers must never disagree on what a patch says)."""
    content_size = zstandard.get_frame_parameters(data).content_size
    if content_size == zstandard.CONTENTSIZE_UNKNOWN or content_size > limit:
        raise zstandard.ZstdError(f"zstd frame declares {content_size} bytes, at most {limit} expected")
    reader = ctx.decompressobj()
    out = reader.decompress(data)
    if not reader.eof or reader.unused_data:
        raise zstandard.ZstdError("zstd frame is incomplete or followed by other bytes")
    return out


# ---------------------------------------------------------------- streams


def _stream_cost(hist: np.ndarray, count: int) -> float:
    """Bytes a stream of `count` symbols with histogram `hist` will take (close estimate)."""
    if count == 0 or np.count_nonzero(hist) <= 1:
        return _STREAM_HEAD.size + (1 if count else 0)
    freqs = rans.normalize(hist)
    coded = rans.cost_bits(hist, freqs) / 8 + rans.table_bytes(freqs) + rans.STATES_BYTES
    return _STREAM_HEAD.size + min(float(count), coded)


def _encode_stream(symbols: np.ndarray, hist: np.ndarray | None, zstd: _Zstd | None) -> bytes:
    """The smallest of stored, constant, rANS and (when `zstd` is given) zstd for one byte stream."""
    count = len(symbols)
    if count == 0:
        return _STREAM_HEAD.pack(STORED, 0, 0)
    if hist is None:
        hist = rans.histogram(symbols)
    nonzero = np.flatnonzero(hist)
    if len(nonzero) == 1:
        return _STREAM_HEAD.pack(CONSTANT, count, 1) + bytes([int(nonzero[0])])
    codec, body = STORED, memoryview(symbols)
    freqs = rans.normalize(hist)
    if rans.cost_bits(hist, freqs) / 8 + rans.table_bytes(freqs) + rans.STATES_BYTES < count:
        out = _SCRATCH.array("rans", count, np.uint8)
        size = rans.encode(symbols, freqs, out)
        if 0 < size < count:
            codec, body = RANS, memoryview(out[:size])
    if zstd is not None and count >= 64:
        packed = zstd.compress(symbols)
        if len(packed) < len(body):
            codec, body = ZSTD, memoryview(packed)
    return _STREAM_HEAD.pack(codec, count, len(body)) + bytes(body)


def _decode_stream(record: np.ndarray, cursor: int, out: np.ndarray) -> int:
    """Decode the stream at `cursor` into `out` (its expected raw length); returns the next cursor."""
    end = len(record)
    if cursor + _STREAM_HEAD.size > end:
        raise PatchFormatError(f"stream header at {cursor} runs past its chunk record ({end} bytes)")
    codec, raw, coded = _STREAM_HEAD.unpack_from(record, cursor)
    cursor += _STREAM_HEAD.size
    if raw != len(out):
        raise PatchFormatError(f"stream holds {raw} symbols, the chunk needs {len(out)}")
    if coded > end - cursor:
        raise PatchFormatError(f"stream of {coded} bytes runs past its chunk record")
    body = record[cursor : cursor + coded]
    if codec == STORED:
        if coded != raw:
            raise PatchFormatError(f"stored stream of {coded} bytes for {raw} symbols")
        out[:] = body
    elif codec == CONSTANT:
        if coded != 1:
            raise PatchFormatError(f"constant stream of {coded} bytes")
        out[:] = body[0]
    elif codec == RANS:
        status = rans.decode(record, cursor, cursor + coded, out, _SCRATCH.array("slots", rans.M, np.uint64))
        if status != 0:
            raise PatchFormatError(f"rANS stream does not decode (status {status})")
    elif codec == ZSTD:
        try:
            raw_bytes = _THREAD_ZSTD.decompress(body, raw)
        except zstandard.ZstdError as exc:
            raise PatchFormatError(f"zstd stream does not decode ({exc})") from exc
        if len(raw_bytes) != raw:
            raise PatchFormatError(f"zstd stream holds {len(raw_bytes)} bytes, expected {raw}")
        out[:] = np.frombuffer(raw_bytes, dtype=np.uint8)
    else:
        raise PatchFormatError(f"unknown stream codec {codec}")
    return cursor + coded


# ---------------------------------------------------------------- one chunk


def _plain(array: np.ndarray) -> np.ndarray:
    """A base-class ndarray over the same memory (np.memmap and friends, for numba)."""
    return array.view(np.ndarray) if type(array) is not np.ndarray else array


def _words(segment: np.ndarray) -> tuple[np.ndarray, int]:
    """The segment's longest prefix viewed as u64 words, and elements per word."""
    per = 8 // segment.dtype.itemsize
    usable = len(segment) - len(segment) % per
    return segment[:usable].view(np.uint64), per


def _encode_chunk(
    zstd: _Zstd, base: list[np.ndarray] | None, target: list[np.ndarray]
) -> tuple[bytes, int, list[int] | None]:
    """Encode one chunk made of one or more segments (consecutive tensors of a group): its record,
    changed count and the changed count per segment (None when there is no base).

    Segments are diffed where they lie, never concatenated: only the changed positions and values
    are gathered."""
    # Contiguous base-class arrays for the kernels (a view, no copy, for what callers pass today).
    target = [np.ascontiguousarray(t) for t in target]
    n = sum(len(t) for t in target)
    width = target[0].dtype.itemsize
    if base is None:  # no base: the chunk is all new
        if n == 0:
            return b"", 0, None  # an empty new tensor: nothing to code (a record would be refused)
        planes = _SCRATCH.array("planes", (width, n), np.uint8)
        at = 0
        for t in target:
            kernels.raw_planes(t, width, planes, at)
            at += len(t)
        streams = [_encode_stream(planes[p], None, zstd) for p in range(width)]
        return _RECORD_HEAD.pack(DENSE, kernels.RAW) + b"".join(streams), n, None
    base = [np.ascontiguousarray(b) for b in base]
    positions, old, new, counts = _diff(base, target)
    count = len(positions)
    if count == 0:
        return b"", 0, counts
    # Transforms are compared on a sample: enough to rank them, a fraction of the work.
    stride = max(1, count // _SAMPLE)
    value_hist = kernels.value_histograms(old, new, width, stride)
    value_costs = [sum(_stream_cost(value_hist[k, p] * stride, count) for p in range(width)) for k in range(3)]
    gaps = _SCRATCH.array("gaps", (kernels.GAP_PLANES, count), np.uint8)
    gap_hist = kernels.gap_planes(positions, gaps)
    sparse_kind = min(_TRANSFORMS, key=lambda k: value_costs[k])
    sparse_cost = sum(_stream_cost(gap_hist[p], count) for p in range(kernels.GAP_PLANES)) + value_costs[sparse_kind]
    if count * 4 > n:  # a good share changed: every element's value may code smaller than positions + values
        stride = max(1, n // _SAMPLE)
        dense_hist = np.zeros((3, width, 256), dtype=np.int64)
        for b, t in zip(base, target, strict=True):
            kernels.dense_histograms(b, t, width, stride, dense_hist)
        dense_costs = [sum(_stream_cost(dense_hist[k, p] * stride, n) for p in range(width)) for k in range(3)]
        dense_kind = min(_TRANSFORMS, key=lambda k: dense_costs[k])
        if dense_costs[dense_kind] < sparse_cost:
            planes = _SCRATCH.array("planes", (width, n), np.uint8)
            hist = np.zeros((width, 256), dtype=np.int64)
            at = 0
            for b, t in zip(base, target, strict=True):
                kernels.value_planes(b, t, dense_kind, width, planes, at, hist)
                at += len(t)
            streams = [_encode_stream(planes[p], hist[p], zstd) for p in range(width)]
            return _RECORD_HEAD.pack(DENSE, dense_kind) + b"".join(streams), count, counts
    values = _SCRATCH.array("planes", (width, count), np.uint8)
    hist = np.zeros((width, 256), dtype=np.int64)
    kernels.value_planes(old, new, sparse_kind, width, values, 0, hist)
    streams = [_encode_stream(gaps[p], gap_hist[p], None) for p in range(kernels.GAP_PLANES)]
    streams += [_encode_stream(values[p], hist[p], None) for p in range(width)]
    return _RECORD_HEAD.pack(SPARSE, sparse_kind) + b"".join(streams), count, counts


_SAMPLE = 1 << 13
_TRANSFORMS = (kernels.XOR, kernels.ULP, kernels.RAW)
"""The value transforms the encoder may pick from (tests narrow it to exercise each one)."""


def _diff(base: list[np.ndarray], target: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
    """Changed positions (in the chunk), old and new bits of a chunk's segments, in this thread's
    scratch (it starts at a sixteenth of the chunk and doubles when full), and the changed count of
    each segment."""
    n = sum(len(t) for t in target)
    dtype = target[0].dtype
    cap = max(4096, n // 16, _SCRATCH.capacity("positions", np.uint32))

    def buffers(cap: int, keep: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (
            _SCRATCH.array("positions", cap, np.uint32, keep=keep * 4),
            _SCRATCH.array("old", cap, dtype, keep=keep * dtype.itemsize),
            _SCRATCH.array("new", cap, dtype, keep=keep * dtype.itemsize),
        )

    positions, old, new = buffers(cap, 0)
    hits = _SCRATCH.array("hits", kernels.BATCH_WORDS, np.uint32)
    count, offset, counts = 0, 0, []
    for b, t in zip(base, target, strict=True):
        (bw, per), (tw, _) = _words(b), _words(t)
        word, before = 0, count
        while word >= 0:
            count, word = kernels.diff(b, t, bw, tw, per, word, offset, positions, old, new, count, hits)
            if word >= 0:
                cap *= 2
                positions, old, new = buffers(cap, count)
        counts.append(count - before)
        offset += len(t)
    return positions[:count], old[:count], new[:count], counts


def _apply_chunk(chunk: ChunkEntry, payload: np.ndarray, segments: list[np.ndarray], width: int) -> list[bool]:
    """Apply one chunk in place to its segments: flat arrays holding the base bits, which together
    span the chunk's `length` elements (one slice of a large tensor, or several small tensors).
    Returns which segments it wrote to."""
    if sum(len(s) for s in segments) != chunk.length:
        raise PatchFormatError(
            f"chunk at {chunk.start} covers {chunk.length} elements, its tensors hold {sum(len(s) for s in segments)}"
        )
    if chunk.changed == 0:
        if chunk.size != 0:
            raise PatchFormatError(f"chunk at {chunk.start} changes nothing but has a {chunk.size}-byte record")
        return [False] * len(segments)
    if not 0 < chunk.changed <= chunk.length or chunk.size < _RECORD_HEAD.size:
        raise PatchFormatError(f"chunk at {chunk.start}: {chunk.changed} changes in {chunk.length} elements")
    if chunk.offset < 0 or chunk.size > len(payload) - chunk.offset:
        raise PatchFormatError(f"chunk at {chunk.start}: record runs past the payload")
    record = payload[chunk.offset : chunk.offset + chunk.size]
    mode, kind = _RECORD_HEAD.unpack_from(record)
    if kind not in (kernels.XOR, kernels.ULP, kernels.RAW):
        raise PatchFormatError(f"chunk at {chunk.start}: unknown value transform {kind}")
    segments = [_plain(s) for s in segments]
    cursor = _RECORD_HEAD.size
    if mode == DENSE:
        values = _SCRATCH.array("planes", (width, chunk.length), np.uint8)
        for p in range(width):
            cursor = _decode_stream(record, cursor, values[p])
        if cursor != len(record):
            raise PatchFormatError(f"chunk at {chunk.start}: {len(record) - cursor} bytes after its streams")
        at = 0
        for segment in segments:
            kernels.apply_dense(segment, values, at, kind, width)
            at += len(segment)
        return [len(s) > 0 for s in segments]
    if mode != SPARSE:
        raise PatchFormatError(f"chunk at {chunk.start}: unknown mode {mode}")
    count = chunk.changed
    gaps = _SCRATCH.array("gaps", (kernels.GAP_PLANES, count), np.uint8)
    for p in range(kernels.GAP_PLANES):
        cursor = _decode_stream(record, cursor, gaps[p])
    values = _SCRATCH.array("planes", (width, count), np.uint8)
    for p in range(width):
        cursor = _decode_stream(record, cursor, values[p])
    if cursor != len(record):
        raise PatchFormatError(f"chunk at {chunk.start}: {len(record) - cursor} bytes after its streams")
    positions = _SCRATCH.array("positions", count, np.uint32)
    if kernels.positions_from_gaps(gaps, chunk.length, positions) != 0:
        raise PatchFormatError(f"chunk at {chunk.start}: positions run past its {chunk.length} elements")
    if len(segments) == 1:
        bounds, offsets = [0, count], [0]
    else:
        offsets = np.cumsum([0] + [len(s) for s in segments[:-1]]).tolist()
        # Searched as u32 like the positions (int64 bounds would convert the whole array first).
        bounds = np.searchsorted(positions, np.array([*offsets, chunk.length], dtype=np.uint32)).tolist()
    touched = []
    for segment, offset, lo, hi in zip(segments, offsets, bounds[:-1], bounds[1:], strict=True):
        touched.append(hi > lo)
        if hi > lo and kernels.scatter(segment, positions, lo, hi, offset, values, kind, width) != 0:
            raise PatchFormatError(f"chunk at {chunk.start}: a position falls outside its tensor")
    return touched


# ---------------------------------------------------------------- whole patches


def _plan_groups(
    base: dict[str, TensorBits] | None, target: dict[str, TensorBits], chunk_elements: int
) -> list[tuple[str, bool, list[str]]]:
    """(dtype, has_base, names): same-dtype tensors packed up to a chunk; larger tensors alone."""
    keyed = []
    for name, tgt in target.items():
        old = base.get(name) if base is not None else None
        # A changed dtype or shape is a new tensor: ship it whole.
        has_base = old is not None and old.dtype == tgt.dtype and tuple(old.shape) == tuple(tgt.shape)
        keyed.append((tgt.dtype, has_base, name))
    groups: list[tuple[str, bool, list[str]]] = []
    size = 0
    for dtype, has_base, name in sorted(keyed):
        n = len(target[name].bits)
        last = groups[-1] if groups else None
        if last is None or (last[0], last[1]) != (dtype, has_base) or size + n > chunk_elements or n > chunk_elements:
            groups.append((dtype, has_base, [name]))
            size = n
        else:
            last[2].append(name)
            size += n
    return groups


def encode(
    base: dict[str, TensorBits] | None,
    target: dict[str, TensorBits],
    *,
    view: str = "",
    base_version: int = -1,
    target_version: int = -1,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    level: int = ZSTD_LEVEL,
    pool: ThreadPoolExecutor | None = None,
    base_checksums: dict[str, str] | None = None,
    target_checksums: dict[str, str] | None = None,
) -> bytes:
    """Encode `target` as changes against `base` (None: every tensor is new).

    `base_checksums` / `target_checksums`: xxh3-128 by tensor name that the caller already computed
    (the chain hashed the base when it was the previous target); those are not hashed again.
    `level` is the zstd level for streams where zstd is tried (whole new tensors).
    """
    chunk_elements = max(1, min(chunk_elements, MAX_CHUNK_ELEMENTS))
    zstd = _Zstd(level)
    plan = _plan_groups(base, target, chunk_elements)
    jobs = []
    for g, (_, _, names) in enumerate(plan):
        if len(names) > 1:  # small tensors: one chunk of several segments
            jobs.append((g, 0, 0, names, None))
            continue
        size = len(target[names[0]].bits)
        for i, start in enumerate(range(0, max(size, 1), chunk_elements)):
            jobs.append((g, i, start, names, min(start + chunk_elements, size)))
    known_base, known_target = base_checksums or {}, target_checksums or {}
    # A large tensor's target hash is fed chunk by chunk, right after each chunk is diffed (its bytes
    # still in cache) and beside the other chunks; small tensors are hashed in their chunk's job.
    hashers = {
        g: OrderedHash(target[names[0]].bits, [(s, e) for jg, _, s, _, e in jobs if jg == g])
        for g, (_, _, names) in enumerate(plan)
        if len(names) == 1 and not known_target.get(names[0])
    }

    def run(job: tuple) -> tuple[bytes, int, list[int] | None, dict[str, str]]:
        g, i, start, names, end = job
        has_base = plan[g][1] and base is not None
        if end is None:
            tgt = [target[n].bits for n in names]
            old = [base[n].bits for n in names] if has_base else None
        else:
            tgt = [target[names[0]].bits[start:end]]
            old = [base[names[0]].bits[start:end]] if has_base else None
        record, changed, counts = _encode_chunk(zstd, old, tgt)
        if g in hashers:
            hashers[g].done(i)
        sums = {n: checksum(target[n].bits) for n in names if end is None and not known_target.get(n)}
        return record, changed, counts, sums

    own_pool = pool is None
    pool = pool or ThreadPoolExecutor(max_workers=_threads())
    try:
        with_base = [n for _, has_base, names in plan if has_base and base is not None for n in names]
        base_futures = {n: pool.submit(checksum, base[n].bits) for n in with_base if not known_base.get(n)}
        results = list(pool.map(run, jobs))
        base_sums = {n: known_base.get(n) or base_futures[n].result() for n in with_base}
    finally:
        if own_pool:
            pool.shutdown()
    target_sums = {n: s for n, s in known_target.items() if s}
    for _, _, _, sums in results:
        target_sums.update(sums)
    for g, hasher in hashers.items():
        target_sums[plan[g][2][0]] = hasher.hexdigest()
    payload: list[bytes] = []
    offset = 0
    chunks: list[list[ChunkEntry]] = [[] for _ in plan]
    per_tensor: dict[int, list[int]] = {}
    for (g, _, start, names, end), (record, changed, counts, _) in zip(jobs, results, strict=True):
        length = sum(len(target[n].bits) for n in names) if end is None else end - start
        chunks[g].append(ChunkEntry(start=start, length=length, changed=changed, offset=offset, size=len(record)))
        if counts is not None and end is None:
            per_tensor[g] = counts
        payload.append(record)
        offset += len(record)
    groups = []
    for g, (dtype, has_base, names) in enumerate(plan):
        tensors, at = [], 0
        for i, name in enumerate(names):
            tgt = target[name]
            if not has_base:
                changed = len(tgt.bits)
            elif len(names) == 1:
                changed = sum(c.changed for c in chunks[g])
            else:
                changed = per_tensor[g][i]
            base_sum, target_sum = base_sums.get(name, ""), target_sums[name]
            tensors.append(
                TensorEntry(
                    name=name,
                    shape=list(tgt.shape),
                    offset=at,
                    base_checksum=bytes.fromhex(base_sum),
                    target_checksum=bytes.fromhex(target_sum),
                    changed=changed,
                )
            )
            at += len(tgt.bits)
        groups.append(GroupEntry(dtype=dtype, elements=at, has_base=has_base, tensors=tensors, chunks=chunks[g]))
    # Names repeat their prefixes across hundreds of tensors: zstd shrinks the header several-fold.
    # Its content checksum (xxh64) catches damage the msgpack decoder would not (a version number).
    header = zstandard.ZstdCompressor(level=9, write_checksum=True).compress(
        msgspec.msgpack.encode(
            PatchHeader(
                format_version=FORMAT_VERSION,
                view=view,
                base_version=base_version,
                target_version=target_version,
                groups=groups,
                payload_bytes=offset,
            )
        )
    )
    return b"".join([_PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(header)), header, *payload])


def read_header(patch: bytes | memoryview) -> tuple[PatchHeader, memoryview]:
    """Parse and sanity-check a patch; returns its header and its payload."""
    view = memoryview(patch)
    if len(view) < _PREAMBLE.size:
        raise PatchFormatError(f"{len(view)} bytes is too short to be a patch")
    magic, version, header_len = _PREAMBLE.unpack_from(view)
    if magic != MAGIC:
        raise PatchFormatError(f"not a sprawl patch (magic {bytes(magic)!r})")
    if version != FORMAT_VERSION:
        raise PatchFormatError(f"patch format v{version}; this codec reads v{FORMAT_VERSION} only")
    start = _PREAMBLE.size
    if header_len > len(view) - start:
        raise PatchFormatError(f"patch header of {header_len} bytes runs past the patch's {len(view)} bytes")
    try:
        raw = _one_frame(zstandard.ZstdDecompressor(), view[start : start + header_len], 1 << 30)
        header = msgspec.msgpack.decode(raw, type=PatchHeader)
        # msgspec keeps the last of repeated keys and ignores array items past a struct's fields; the
        # encoder always writes the canonical form, so anything else is a forgery a lenient reader
        # might read differently (docs/FORMAT.md 8.3).
        if msgspec.msgpack.encode(header) != raw:
            raise PatchFormatError("patch header is not in canonical form (a repeated key, an extra item or field)")
    except (msgspec.DecodeError, msgspec.ValidationError, zstandard.ZstdError) as exc:
        raise PatchFormatError(f"corrupt patch header: {exc}") from exc
    if header.format_version != FORMAT_VERSION:
        raise PatchFormatError(f"patch header says format v{header.format_version}, its preamble v{version}")
    names = header.tensor_names()
    if len(set(names)) != len(names):
        # Two entries for one tensor would patch the same array twice, concurrently, in place.
        repeated = sorted({n for n in names if names.count(n) > 1})
        raise PatchFormatError(f"patch names tensors {repeated[:3]} more than once")
    payload = view[start + header_len :]
    if len(payload) != header.payload_bytes:
        raise PatchFormatError(f"patch payload is {len(payload)} bytes, header says {header.payload_bytes}")
    return header, payload


class ChecksumMismatch(PatchFormatError):
    def __init__(self, name: str, which: str, expected: str, actual: str):
        self.tensor, self.which = name, which
        super().__init__(f"tensor {name}: {which} checksum is {actual}, patch expects {expected}")


def _check_layout(group: GroupEntry) -> None:
    """Sizes and chunk bounds, before any kernel touches memory on their word."""
    if group.dtype not in _WIDTHS:
        raise PatchFormatError(f"group of unknown dtype {group.dtype!r}")
    offset = 0
    for t in group.tensors:
        if any(d < 0 for d in t.shape) or t.offset != offset:
            raise PatchFormatError(f"tensor {t.name}: shape {t.shape} at offset {t.offset} does not fit its group")
        offset += math.prod(t.shape)
    if offset != group.elements:
        raise PatchFormatError(
            f"group of {[t.name for t in group.tensors][:3]}: tensor sizes do not add up to {group.elements} elements"
        )
    if not group.tensors:
        raise PatchFormatError("a group without tensors")
    # A group of several tensors is one chunk; a single tensor's chunks tile it in order (its hash is
    # fed chunk by chunk as they complete, see OrderedHash).
    at = 0
    for chunk in group.chunks:
        if len(group.tensors) > 1:
            ok = chunk.start == 0 and chunk.length == group.elements <= MAX_CHUNK_ELEMENTS and len(group.chunks) == 1
        else:
            ok = chunk.start == at and 0 <= chunk.length <= MAX_CHUNK_ELEMENTS
        if not ok:
            raise PatchFormatError(f"chunk at {chunk.start} of {chunk.length} elements does not fit its group")
        at += chunk.length
    covered = len(group.chunks) == 1 if len(group.tensors) > 1 else at == group.elements
    if not covered:
        raise PatchFormatError(f"chunks of group {group.tensors[0].name}... do not cover its {group.elements} elements")


_WIDTHS = {
    name: bits_dtype(name).itemsize
    for name in ("BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E5M2", "I8", "U8", "I16", "I32", "I64", "BOOL")
}


def _prepare_group(
    group: GroupEntry, base: dict[str, np.ndarray] | None, *, verify: bool, verify_base: bool, inplace: bool
) -> list[np.ndarray]:
    """The arrays a group's chunks are applied to: the caller's (inplace) or copies, bases checked."""
    _check_layout(group)
    dtype = bits_dtype(group.dtype)
    entries = group.tensors
    if not group.has_base:
        return [np.zeros(math.prod(t.shape), dtype=dtype) for t in entries]
    if base is None or any(t.name not in base for t in entries):
        missing = [t.name for t in entries if base is None or t.name not in base]
        raise PatchFormatError(f"patch changes {missing[:3]} against a base, but no base bits were given")
    arrays = []
    for t in entries:
        b = base[t.name].reshape(-1)
        if len(b) != math.prod(t.shape) or b.dtype != dtype:
            raise PatchFormatError(
                f"tensor {t.name}: base is {len(b)} x {b.dtype}, patch expects {math.prod(t.shape)} x {dtype}"
            )
        if verify and verify_base and checksum(b) != t.base_checksum.hex():
            raise ChecksumMismatch(t.name, "base", t.base_checksum.hex(), checksum(b))
        own = inplace and b.flags.writeable and b.flags.c_contiguous
        arrays.append(b if own else b.copy())
    return arrays


def _apply_group_chunk(
    group: GroupEntry, chunk: ChunkEntry, payload: np.ndarray, arrays: list[np.ndarray]
) -> list[bool]:
    """Apply one chunk; which of the group's tensors it wrote to."""
    single = len(group.tensors) == 1
    segments = [arrays[0][chunk.start : chunk.start + chunk.length]] if single else arrays
    try:
        return _apply_chunk(chunk, payload, segments, _WIDTHS[group.dtype])
    except PatchFormatError:
        raise
    except (ValueError, IndexError, struct.error) as exc:
        # Whatever else a damaged record trips over means one thing: this patch is unusable.
        raise PatchFormatError(f"group {group.tensors[0].name}..., chunk at {chunk.start}: damaged ({exc})") from exc


def _needs_hash(group: GroupEntry, entry: TensorEntry, touched: bool) -> bool:
    """A tensor no chunk wrote to is its base: when that base is known good (the caller vouches or it
    was just hashed) and the patch says base and target bits are the same, hashing it again proves
    nothing. Only tensors that changed are hashed."""
    return not (group.has_base and not touched and entry.base_checksum == entry.target_checksum)


def _verify_tensor(entry: TensorEntry, bits: np.ndarray) -> None:
    actual = checksum(bits)
    if actual != entry.target_checksum.hex():
        raise ChecksumMismatch(entry.name, "target", entry.target_checksum.hex(), actual)


_THREAD_ZSTD = _Zstd(ZSTD_LEVEL)  # decompression contexts, one per thread
_SCRATCH = Scratch()


def _payload_array(payload: memoryview | bytes | np.ndarray) -> np.ndarray:
    return payload if isinstance(payload, np.ndarray) else np.frombuffer(payload, dtype=np.uint8)


class _GroupVerifier:
    """Target hashes of one group's tensors, as its chunks complete: a single tensor's is fed chunk by
    chunk in order (OrderedHash), small tensors sharing a chunk are hashed after it. Only tensors a
    chunk wrote to, or whose base and target checksums differ, are hashed (see _needs_hash)."""

    def __init__(self, group: GroupEntry, arrays: list[np.ndarray]):
        self.group, self.arrays = group, arrays
        self.hasher: OrderedHash | None = None
        if len(group.tensors) == 1 and _needs_hash(group, group.tensors[0], any(c.changed for c in group.chunks)):
            self.hasher = OrderedHash(arrays[0], [(c.start, c.start + c.length) for c in group.chunks])

    def chunk_done(self, index: int, touched: list[bool]) -> None:
        if self.hasher is not None:
            self.hasher.done(index)
        elif len(self.group.tensors) > 1:
            for entry, bits, wrote in zip(self.group.tensors, self.arrays, touched, strict=True):
                if _needs_hash(self.group, entry, wrote):
                    _verify_tensor(entry, bits)

    def finish(self) -> None:
        if self.hasher is not None:
            entry = self.group.tensors[0]
            actual = self.hasher.hexdigest()
            if actual != entry.target_checksum.hex():
                raise ChecksumMismatch(entry.name, "target", entry.target_checksum.hex(), actual)


def apply_group(
    group: GroupEntry,
    payload: memoryview,
    base: dict[str, np.ndarray] | None,
    *,
    verify: bool = True,
    verify_base: bool = True,
    inplace: bool = False,
) -> dict[str, np.ndarray]:
    """Reconstruct one group's tensors (flat arrays), serially.

    With `inplace`, the caller's base arrays (e.g. writable np.memmap views of the served files) are
    written in place, only where bits change, and returned; otherwise they are left untouched.
    `verify_base=False` skips hashing bases the caller knows to hash to the patch's base checksums
    (e.g. the previous patch's verified targets); tensors the patch leaves unchanged are then not
    hashed at all.
    """
    arrays = _prepare_group(group, base, verify=verify, verify_base=verify_base, inplace=inplace)
    data = _payload_array(payload)
    verifier = _GroupVerifier(group, arrays) if verify else None
    for i, chunk in enumerate(group.chunks):
        touched = _apply_group_chunk(group, chunk, data, arrays)
        if verifier is not None:
            verifier.chunk_done(i, touched)
    if verifier is not None:
        verifier.finish()
    return {t.name: bits for t, bits in zip(group.tensors, arrays, strict=True)}


def apply(
    patch: bytes,
    base: dict[str, TensorBits] | None,
    *,
    inplace: bool = False,
    verify_base: bool = True,
    pool: ThreadPoolExecutor | None = None,
) -> dict[str, TensorBits]:
    """Apply a whole patch; every changed tensor's target checksum (and, unless `verify_base` is
    False, every base checksum) is verified.

    Work is spread over the pool chunk by chunk (chunks touch disjoint elements); each tensor's hash
    is fed as its chunks complete. With `inplace`, base arrays are overwritten (the caller owns them).
    """
    header, payload = read_header(patch)
    data = _payload_array(payload)
    base_bits = {n: b.bits for n, b in base.items()} if base is not None else None
    own_pool = pool is None
    pool = pool or ThreadPoolExecutor(max_workers=_threads())
    try:
        arrays = list(
            pool.map(
                lambda g: _prepare_group(g, base_bits, verify=True, verify_base=verify_base, inplace=inplace),
                header.groups,
            )
        )
        verifiers = [_GroupVerifier(g, a) for g, a in zip(header.groups, arrays, strict=True)]

        def run(job: tuple[int, int, ChunkEntry]) -> None:
            g, i, chunk = job
            verifiers[g].chunk_done(i, _apply_group_chunk(header.groups[g], chunk, data, arrays[g]))

        jobs = [(g, i, c) for g, group in enumerate(header.groups) for i, c in enumerate(group.chunks)]
        _all_or_raise([pool.submit(run, job) for job in jobs])
        for verifier in verifiers:
            verifier.finish()
    finally:
        if own_pool:
            pool.shutdown()
    return {
        t.name: TensorBits(group.dtype, tuple(t.shape), a)
        for g, group in enumerate(header.groups)
        for t, a in zip(group.tensors, arrays[g], strict=True)
    }


def _all_or_raise(futures: list[Future]) -> None:
    """Wait for every job, then raise the first failure: a job still writing into the caller's
    arrays after apply() raised would race whatever the caller does next (rebuild from a keyframe)."""
    wait(futures)
    for future in futures:
        future.result()


def _threads() -> int:
    import os

    return max(1, min(8, os.cpu_count() or 1))
