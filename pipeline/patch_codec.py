"""The lossless patch codec: bits of a target tensor as changes against a base tensor.

Format (self-describing):

    b"SPRWLPCH" | u16 format version | u32 header length | zstd(msgpack PatchHeader) | chunk payloads

Each tensor is cut into chunks (default 4 Mi elements) so work spreads over a
thread pool and memory stays at chunk buffers. Per chunk the encoder picks the
smallest of:

- `same`: nothing changed;
- `sparse`: changed positions + values. Positions as Rice-coded gaps (a
  unary-quotient bitstream and a fixed-width remainder bitstream kept apart,
  so both decode with vectorized numpy) or as a bitmap when changes are dense
  enough that one bit per element is cheaper. Values are XOR with the base or
  raw replacement bits, split into byte planes (high bytes of small XORs are
  mostly zero and vanish under zstd), whichever compresses smaller;
- `dense`: the whole chunk's XOR (or raw target) in byte planes, for chunks
  where most elements changed.

Nothing is computed in floating point: XOR and replacement only, on unsigned
integer views (pipeline.bits), so every bit pattern round-trips.
"""

from __future__ import annotations

import math
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import msgspec
import numpy as np
import zstandard

from pipeline.bits import bits_dtype, checksum
from pipeline.errors import SprawlError

MAGIC = b"SPRWLPCH"
FORMAT_VERSION = 1
_PREAMBLE = struct.Struct("<8sHI")
DEFAULT_CHUNK_ELEMENTS = 1 << 22  # measured with bench delta: fewer, larger numpy ops beat finer thread balance
ZSTD_LEVEL = 3  # measured: level 3 is within ~1% of level 9 on value planes at a fraction of the time


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
    length: int
    encoding: Literal["same", "sparse", "dense"]
    positions: Literal["none", "rice", "bitmap"]
    values: Literal["none", "xor", "raw"]
    changed: int
    rice_k: int
    unary_bits: int
    stream_sizes: list[int]
    """Compressed byte length of each stream: [positions_a, positions_b, values]."""
    compressed: list[bool]
    offset: int
    """Where this chunk's streams start in the payload."""


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
    """Tensors of one dtype coded as one flat array: small tensors share chunks, a large one is chunked."""

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


# ---------------------------------------------------------------- position coding


def _rice_parameter(gaps: np.ndarray, n: int, count: int) -> tuple[int, int]:
    """Best Rice k near the geometric optimum, by exact total bit count."""
    mean = max(float(n - count) / max(count, 1), 1e-9)
    guess = max(0, round(math.log2(max(mean * math.log(2), 1.0))))
    best_k, best_bits = 0, None
    for k in range(max(0, guess - 1), guess + 2):
        bits = int((gaps >> k).sum()) + count * (k + 1)
        if best_bits is None or bits < best_bits:
            best_k, best_bits = k, bits
    assert best_bits is not None
    return best_k, best_bits


def _rice_encode(gaps: np.ndarray, k: int) -> tuple[bytes, bytes, int]:
    quotients = gaps >> k
    unary_bits = int(quotients.sum()) + len(gaps)
    unary = np.ones(unary_bits, dtype=bool)
    unary[np.cumsum(quotients + 1) - 1] = False  # each quotient: q ones, then a zero
    if k:
        remainders = gaps & ((1 << k) - 1)
        width = 8 if k <= 8 else (16 if k <= 16 else 64)
        as_bytes = remainders.astype(f">u{width // 8}").view(np.uint8).reshape(-1, width // 8)
        rem_bits = np.unpackbits(as_bytes, axis=1)[:, width - k :]  # the k low bits, most significant first
        rem = np.packbits(rem_bits.ravel()).tobytes()
    else:
        rem = b""
    return np.packbits(unary).tobytes(), rem, unary_bits


def _rice_decode(unary: bytes, rem: bytes, k: int, count: int, unary_bits: int) -> np.ndarray:
    bits = np.unpackbits(np.frombuffer(unary, dtype=np.uint8), count=unary_bits)
    ends = np.flatnonzero(bits == 0)
    if len(ends) != count:
        raise PatchFormatError(f"rice stream holds {len(ends)} gaps, header says {count}")
    if count == 0:
        return ends
    # gap_i = quotient_i << k | remainder_i, quotient_i = ends_i - ends_{i-1} - 1; positions = cumsum(gap + 1) - 1.
    # Written with in-place ops: this runs once per changed element on every sampler.
    gaps = np.empty(count, dtype=np.int64)
    gaps[0] = ends[0]
    np.subtract(ends[1:], ends[:-1], out=gaps[1:])
    gaps[1:] -= 1
    if k:
        np.left_shift(gaps, k, out=gaps)
        rem_bits = np.unpackbits(np.frombuffer(rem, dtype=np.uint8), count=count * k).reshape(count, k)
        weights = (1 << np.arange(k - 1, -1, -1)).astype(np.uint32 if k > 16 else np.uint16)
        np.bitwise_or(gaps, rem_bits @ weights, out=gaps, casting="unsafe")
    gaps += 1
    np.cumsum(gaps, out=gaps)
    gaps -= 1
    return gaps


# ---------------------------------------------------------------- value coding


def _planes(values: np.ndarray) -> bytes:
    """Byte planes, most significant first: [all high bytes][...][all low bytes]."""
    width = values.dtype.itemsize
    if width == 1:
        return values.tobytes()
    as_bytes = values.astype(values.dtype.newbyteorder("<"), copy=False).view(np.uint8).reshape(-1, width)
    return np.ascontiguousarray(as_bytes[:, ::-1].T).tobytes()


def _from_planes(data: bytes, dtype: np.dtype, count: int) -> np.ndarray:
    width = dtype.itemsize
    raw = np.frombuffer(data, dtype=np.uint8)
    if len(raw) != count * width:
        raise PatchFormatError(f"value planes hold {len(raw)} bytes, expected {count * width}")
    if width == 1:
        return raw.view(dtype)
    rows = np.ascontiguousarray(raw.reshape(width, count).T[:, ::-1])
    return rows.view(dtype.newbyteorder("<")).reshape(count).astype(dtype, copy=False)


class _Zstd:
    """Per-thread zstd contexts (they are not thread-safe)."""

    def __init__(self, level: int):
        import threading

        self.level = level
        self._local = threading.local()

    def compress(self, data: bytes) -> bytes:
        ctx = getattr(self._local, "c", None)
        if ctx is None:
            ctx = self._local.c = zstandard.ZstdCompressor(level=self.level)
        return ctx.compress(data)

    def decompress(self, data: bytes, size: int) -> bytes:
        ctx = getattr(self._local, "d", None)
        if ctx is None:
            ctx = self._local.d = zstandard.ZstdDecompressor()
        return ctx.decompress(data, max_output_size=size)


def _maybe_compress(zstd: _Zstd, data: bytes) -> tuple[bytes, bool]:
    if len(data) < 64:
        return data, False
    packed = zstd.compress(data)
    return (packed, True) if len(packed) < len(data) else (data, False)


# ---------------------------------------------------------------- one chunk


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _encode_chunk(
    zstd: _Zstd, start: int, base: list[np.ndarray] | None, target: list[np.ndarray]
) -> tuple[dict, list[bytes], list[int] | None]:
    """Encode one chunk made of one or more segments (consecutive tensors of a group).

    Segments are diffed where they lie, never concatenated: only the changed positions and values
    (about 1% of the data) are gathered. Returns the entry, its streams and the changed count per
    segment (None when there is no base).
    """
    n = sum(len(t) for t in target)
    if base is None:  # no base: the chunk is all new
        data, packed = _maybe_compress(zstd, _planes(_cat(target)))
        return _entry(start, n, "dense", "none", "raw", n, [0, 0, len(data)], [False, False, packed]), [data], None
    local = [np.flatnonzero(b != t) for b, t in zip(base, target, strict=True)]
    counts = [len(p) for p in local]
    count = sum(counts)
    if count == 0:
        return _entry(start, n, "same", "none", "none", 0, [0, 0, 0], [False, False, False]), [], counts
    offsets = np.cumsum([0] + [len(t) for t in target[:-1]])
    positions = _cat([p + off for p, off in zip(local, offsets, strict=True)])

    candidates: list[tuple[int, dict, list[bytes]]] = []
    if count * 4 < n * 3:  # sparse only makes sense when not nearly everything changed
        gaps = np.diff(positions, prepend=-1) - 1
        k, rice_bits = _rice_parameter(gaps, n, count)
        if rice_bits < n:
            unary, rem, unary_bits = _rice_encode(gaps, k)
            pos_streams, pos_kind, pos_packed = [unary, rem], "rice", [False, False]
        else:
            mask = np.zeros(n, dtype=bool)
            mask[positions] = True
            bitmap, packed = _maybe_compress(zstd, np.packbits(mask).tobytes())
            pos_streams, pos_kind, pos_packed, k, unary_bits = [bitmap, b""], "bitmap", [packed, False], 0, 0
        old_vals = _cat([b[p] for b, p in zip(base, local, strict=True)])
        new_vals = _cat([t[p] for t, p in zip(target, local, strict=True)])
        xor_vals = _maybe_compress(zstd, _planes(old_vals ^ new_vals))
        (vals, vals_packed), kind = xor_vals, "xor"
        if len(xor_vals[0]) > new_vals.nbytes // 2:  # XOR did not help much: try replacement bits
            raw_vals = _maybe_compress(zstd, _planes(new_vals))
            if len(raw_vals[0]) < len(xor_vals[0]):
                (vals, vals_packed), kind = raw_vals, "raw"
        streams = [*pos_streams, vals]
        entry = _entry(
            start,
            n,
            "sparse",
            pos_kind,
            kind,
            count,
            [len(s) for s in streams],
            [*pos_packed, vals_packed],
            rice_k=k,
            unary_bits=unary_bits,
        )
        candidates.append((sum(len(s) for s in streams), entry, streams))
    if count * 5 > n:  # dense only makes sense when a good share changed
        xor_all = _maybe_compress(zstd, _planes(_cat([b ^ t for b, t in zip(base, target, strict=True)])))
        raw_all = _maybe_compress(zstd, _planes(_cat(target)))
        (vals, packed), kind = (xor_all, "xor") if len(xor_all[0]) <= len(raw_all[0]) else (raw_all, "raw")
        entry = _entry(start, n, "dense", "none", kind, count, [0, 0, len(vals)], [False, False, packed])
        candidates.append((len(vals), entry, [vals]))
    _, entry, streams = min(candidates, key=lambda c: c[0])
    return entry, streams, counts


def _entry(start, length, encoding, positions, values, changed, sizes, compressed, rice_k=0, unary_bits=0) -> dict:
    return {
        "start": start,
        "length": length,
        "encoding": encoding,
        "positions": positions,
        "values": values,
        "changed": changed,
        "rice_k": rice_k,
        "unary_bits": unary_bits,
        "stream_sizes": sizes,
        "compressed": compressed,
    }


def _apply_chunk(
    zstd: _Zstd, chunk: ChunkEntry, payload: memoryview, segments: list[np.ndarray], dtype: np.dtype
) -> None:
    """Apply one chunk in place to its segments: flat arrays holding the base bits, which together
    span the chunk's `length` elements (one slice of a large tensor, or several small tensors)."""
    if chunk.encoding == "same":
        return
    if sum(len(s) for s in segments) != chunk.length:
        raise PatchFormatError(
            f"chunk at {chunk.start} covers {chunk.length} elements, its tensors hold {sum(len(s) for s in segments)}"
        )
    streams, cursor = [], chunk.offset
    for size in chunk.stream_sizes:
        streams.append(payload[cursor : cursor + size])
        cursor += size

    def stream(i: int, raw_size: int) -> bytes:
        return zstd.decompress(streams[i], raw_size) if chunk.compressed[i] else bytes(streams[i])

    width = dtype.itemsize
    xor = chunk.values == "xor"
    if chunk.encoding == "dense":
        values = _from_planes(stream(2, chunk.length * width), dtype, chunk.length)
        at = 0
        for segment in segments:
            part = values[at : at + len(segment)]
            if xor:
                segment ^= part
            else:
                segment[:] = part
            at += len(segment)
        return
    if chunk.positions == "rice":
        positions = _rice_decode(bytes(streams[0]), bytes(streams[1]), chunk.rice_k, chunk.changed, chunk.unary_bits)
    else:
        mask_bytes = stream(0, (chunk.length + 7) // 8)
        positions = np.flatnonzero(np.unpackbits(np.frombuffer(mask_bytes, np.uint8), count=chunk.length))
    if len(positions) != chunk.changed or (len(positions) and positions[-1] >= chunk.length):
        raise PatchFormatError(f"chunk at {chunk.start}: positions do not fit a chunk of {chunk.length}")
    values = _from_planes(stream(2, chunk.changed * width), dtype, chunk.changed)
    if len(segments) == 1:
        bounds = [0, len(positions)]
        offsets = [0]
    else:
        offsets = np.cumsum([0] + [len(s) for s in segments[:-1]])
        bounds = np.searchsorted(positions, np.append(offsets, chunk.length)).tolist()
    for segment, offset, lo, hi in zip(segments, offsets, bounds[:-1], bounds[1:], strict=True):
        if lo == hi:
            continue
        local = positions[lo:hi] - offset if offset else positions[lo:hi]
        if xor:
            segment[local] ^= values[lo:hi]
        else:
            segment[local] = values[lo:hi]


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
    """
    zstd = _Zstd(level)
    plan = _plan_groups(base, target, chunk_elements)
    jobs = []
    for g, (_, _, names) in enumerate(plan):
        if len(names) > 1:  # small tensors: one chunk of several segments
            jobs.append((g, 0, names, None))
            continue
        size = len(target[names[0]].bits)
        for start in range(0, max(size, 1), chunk_elements):
            jobs.append((g, start, names, min(start + chunk_elements, size)))

    def run(job: tuple) -> tuple[dict, list[bytes], list[int] | None]:
        g, start, names, end = job
        has_base = plan[g][1] and base is not None
        if end is None:
            tgt = [target[n].bits for n in names]
            old = [base[n].bits for n in names] if has_base else None
        else:
            tgt = [target[names[0]].bits[start:end]]
            old = [base[names[0]].bits[start:end]] if has_base else None
        return _encode_chunk(zstd, start, old, tgt)

    known_base, known_target = base_checksums or {}, target_checksums or {}

    def sums(name: str, has_base: bool) -> tuple[str, str]:
        base_sum = ""
        if has_base and base is not None:
            base_sum = known_base.get(name) or checksum(base[name].bits)
        return base_sum, known_target.get(name) or checksum(target[name].bits)

    own_pool = pool is None
    pool = pool or ThreadPoolExecutor(max_workers=_threads())
    try:
        results = list(pool.map(run, jobs))
        checksums = dict(
            zip(
                [n for _, _, names in plan for n in names],
                pool.map(lambda item: sums(*item), [(n, hb) for _, hb, names in plan for n in names]),
                strict=True,
            )
        )
    finally:
        if own_pool:
            pool.shutdown()
    payload: list[bytes] = []
    offset = 0
    chunks: list[list[ChunkEntry]] = [[] for _ in plan]
    per_tensor: dict[int, np.ndarray] = {}
    for (g, _, _, end), (entry, streams, counts) in zip(jobs, results, strict=True):
        chunks[g].append(ChunkEntry(offset=offset, **entry))
        if counts is not None and end is None:
            per_tensor[g] = np.asarray(counts)
        for stream in streams:
            payload.append(stream)
            offset += len(stream)
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
                changed = int(per_tensor[g][i]) if g in per_tensor else 0
            base_sum, target_sum = checksums[name]
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
    header = zstandard.ZstdCompressor(level=9).compress(
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
        raise PatchFormatError(f"patch format v{version}; this codec reads v{FORMAT_VERSION}")
    start = _PREAMBLE.size
    try:
        raw = zstandard.ZstdDecompressor().decompress(view[start : start + header_len], max_output_size=1 << 30)
        header = msgspec.msgpack.decode(raw, type=PatchHeader)
    except (msgspec.DecodeError, msgspec.ValidationError, zstandard.ZstdError) as exc:
        raise PatchFormatError(f"corrupt patch header: {exc}") from exc
    payload = view[start + header_len :]
    if len(payload) != header.payload_bytes:
        raise PatchFormatError(f"patch payload is {len(payload)} bytes, header says {header.payload_bytes}")
    return header, payload


class ChecksumMismatch(PatchFormatError):
    def __init__(self, name: str, which: str, expected: str, actual: str):
        self.tensor, self.which = name, which
        super().__init__(f"tensor {name}: {which} checksum is {actual}, patch expects {expected}")


def _prepare_group(
    group: GroupEntry, base: dict[str, np.ndarray] | None, *, verify: bool, verify_base: bool, inplace: bool
) -> list[np.ndarray]:
    """The arrays a group's chunks are applied to: the caller's (inplace) or copies, bases checked."""
    dtype = bits_dtype(group.dtype)
    entries = group.tensors
    if sum(math.prod(t.shape) for t in entries) != group.elements:
        raise PatchFormatError(
            f"group of {[t.name for t in entries][:3]}: tensor sizes do not add up to {group.elements} elements"
        )
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


def _apply_group_chunk(group: GroupEntry, chunk: ChunkEntry, payload: memoryview, arrays: list[np.ndarray]) -> None:
    segments = [arrays[0][chunk.start : chunk.start + chunk.length]] if len(group.tensors) == 1 else arrays
    try:
        _apply_chunk(_THREAD_ZSTD, chunk, payload, segments, bits_dtype(group.dtype))
    except PatchFormatError:
        raise
    except (zstandard.ZstdError, ValueError, IndexError) as exc:
        # Damaged streams surface as decoder errors; they mean one thing: this patch is unusable.
        raise PatchFormatError(
            f"group {group.tensors[0].name}..., chunk at {chunk.start}: damaged stream ({exc})"
        ) from exc


def _verify_tensor(entry: TensorEntry, bits: np.ndarray) -> None:
    actual = checksum(bits)
    if actual != entry.target_checksum.hex():
        raise ChecksumMismatch(entry.name, "target", entry.target_checksum.hex(), actual)


_THREAD_ZSTD = _Zstd(ZSTD_LEVEL)  # decompression contexts, one per thread


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

    With `inplace`, the caller's base arrays are overwritten and returned; otherwise they are left
    untouched. `verify_base=False` skips hashing bases whose checksums the caller already knows
    (e.g. the previous patch's verified targets).
    """
    arrays = _prepare_group(group, base, verify=verify, verify_base=verify_base, inplace=inplace)
    for chunk in group.chunks:
        _apply_group_chunk(group, chunk, payload, arrays)
    if verify:
        for entry, bits in zip(group.tensors, arrays, strict=True):
            _verify_tensor(entry, bits)
    return {t.name: bits for t, bits in zip(group.tensors, arrays, strict=True)}


def apply(
    patch: bytes,
    base: dict[str, TensorBits] | None,
    *,
    inplace: bool = False,
    verify_base: bool = True,
    pool: ThreadPoolExecutor | None = None,
) -> dict[str, TensorBits]:
    """Apply a whole patch; every tensor's target checksum (and base checksum) is verified.

    Work is spread over the pool chunk by chunk (chunks touch disjoint elements), then tensor by
    tensor for the checksums. With `inplace`, base arrays are overwritten (the caller owns them).
    """
    header, payload = read_header(patch)
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
        jobs = [(g, c) for g in range(len(header.groups)) for c in header.groups[g].chunks]
        list(pool.map(lambda job: _apply_group_chunk(header.groups[job[0]], job[1], payload, arrays[job[0]]), jobs))
        pairs = [(t, a) for g, group in enumerate(header.groups) for t, a in zip(group.tensors, arrays[g], strict=True)]
        list(pool.map(lambda pair: _verify_tensor(*pair), pairs))
    finally:
        if own_pool:
            pool.shutdown()
    return {
        t.name: TensorBits(group.dtype, tuple(t.shape), a)
        for g, group in enumerate(header.groups)
        for t, a in zip(group.tensors, arrays[g], strict=True)
    }


def _threads() -> int:
    import os

    return max(1, min(8, os.cpu_count() or 1))
