"""A reader of sprawl patches (format v2), written only from docs/FORMAT.md section 8.

It exists to prove that the page is enough to read a patch without the codec's source, and to be
read by whoever ports a reader to another language (an engine's loader in C++ or Rust). So it is
plain and sequential on purpose: no speed tricks, every check the page asks for, in the page's
order, each refusal naming the rule it enforces ("8.4: ..." is the section it comes from). It must
never import anything from `pipeline/`.

Use:

    shard = {name: Tensor(dtype, shape, bits)}          # the base version's bits of one shard
    patched = apply_patch(blob, shard, edge=Edge("bf16", 6, 7), target_digests=...)

`bits` is a flat little-endian unsigned numpy array of the dtype's width (an element's *bits*,
section 4). Tensors with a base are patched in place; new tensors are built from zero bits. Every
structural check happens before a single element is written, and if the bits after the patch do
not hash to the header's target checksums, the elements written are put back before the refusal,
so a refused patch leaves the caller's arrays as they were.

Library equivalents for a port: `zstandard` is libzstd (ZSTD_findFrameCompressedSize +
ZSTD_decompressDCtx with a destination of exactly the expected size), `xxhash.xxh3_128_digest` is
XXH3_128bits + XXH128_canonicalFromHash, and `msgspec.msgpack.decode` is any msgpack decoder that
yields generic maps, arrays, ints, strings, bools and byte strings.
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter
from dataclasses import dataclass

import msgspec
import numpy as np
import xxhash
import zstandard

MAGIC = b"SPRWLPCH"
FORMAT_VERSION = 2
PREAMBLE = struct.Struct("<8sHI")  # magic, u16 format version, u32 header length (8.2)
STREAM_HEAD = struct.Struct("<BII")  # u8 codec, u32 raw_len, u32 coded_len (8.6)
MAX_CHUNK_ELEMENTS = 1 << 30  # 8.4
# The page sets no limit on the decompressed header; a reader must pick one so that a forged frame
# cannot make it allocate without bound. A shard's header is kilobytes to a few megabytes.
MAX_HEADER_BYTES = 256 << 20

WIDTHS = {  # dtype name -> element width in bytes (section 4)
    "BF16": 2,
    "F16": 2,
    "F32": 4,
    "F64": 8,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I8": 1,
    "U8": 1,
    "I16": 2,
    "I32": 4,
    "I64": 8,
    "BOOL": 1,
}
UNSIGNED = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}

MODES = {1: "sparse", 2: "dense"}  # 8.5
TRANSFORMS = {0: "xor", 1: "ulp", 2: "raw"}  # 8.5 / 8.8
CODECS = {0: "stored", 1: "constant", 2: "rans", 3: "zstd"}  # 8.6
GAP_PLANES = 4  # sparse gaps are u32

# rANS constants (8.7)
SCALE_BITS = 14
M = 1 << SCALE_BITS
L = 1 << 23
STATE_LIMIT = 1 << 31


class PatchRefused(Exception):
    """The patch breaks a rule of docs/FORMAT.md section 8: serve nothing built from it."""


def refuse(rule: str) -> PatchRefused:
    return PatchRefused(rule)


@dataclass
class Tensor:
    """One tensor as bits: `bits` is flat, little-endian, unsigned, of the dtype's width."""

    dtype: str
    shape: tuple[int, ...]
    bits: np.ndarray


@dataclass(frozen=True)
class Edge:
    """What the reader is following (8.9 step 3): the header must say the same."""

    view: str
    base_version: int
    target_version: int


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    offset: int
    base_checksum: bytes
    target_checksum: bytes
    changed: int

    @property
    def elements(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count


@dataclass(frozen=True)
class ChunkEntry:
    start: int
    length: int
    changed: int
    offset: int
    size: int


@dataclass(frozen=True)
class GroupEntry:
    dtype: str
    elements: int
    has_base: bool
    tensors: tuple[TensorEntry, ...]
    chunks: tuple[ChunkEntry, ...]

    @property
    def width(self) -> int:
        return WIDTHS[self.dtype]


@dataclass(frozen=True)
class PatchHeader:
    format_version: int
    view: str
    base_version: int
    target_version: int
    groups: tuple[GroupEntry, ...]
    payload_bytes: int


# --------------------------------------------------------------------------------------------
# 8.2 the blob and 8.3 the header
# --------------------------------------------------------------------------------------------


def read_patch(blob: bytes, *, sha256: str | None = None) -> tuple[PatchHeader, memoryview]:
    """Preamble, header and payload of a patch, with every check that needs no base (8.2-8.4)."""
    blob = memoryview(blob).cast("B")
    if sha256 is not None and hashlib.sha256(blob).hexdigest() != sha256:
        raise refuse("8.9: the blob's SHA-256 differs from its pointer")
    if len(blob) < PREAMBLE.size:
        raise refuse("8.2: shorter than the 14-byte preamble")
    magic, version, header_len = PREAMBLE.unpack_from(blob, 0)
    if magic != MAGIC:
        raise refuse("8.2: wrong magic")
    if version != FORMAT_VERSION:
        raise refuse(f"8.2: format version {version}, this reader reads {FORMAT_VERSION}")
    if header_len > len(blob) - PREAMBLE.size:
        raise refuse("8.2: the header length H runs past the end of the blob")
    frame = blob[PREAMBLE.size : PREAMBLE.size + header_len]
    packed = zstd_exact(frame, expected_len=None, limit=MAX_HEADER_BYTES, what="header")
    try:
        raw = msgspec.msgpack.decode(packed)
    except msgspec.DecodeError as exc:
        raise refuse(f"8.3: the header is not one msgpack value ({exc})") from None
    header = parse_header(raw)
    payload = blob[PREAMBLE.size + header_len :]
    if header.payload_bytes != len(payload):
        raise refuse(f"8.9: payload_bytes {header.payload_bytes} but {len(payload)} bytes follow")
    check_layout(header)
    return header, payload


def parse_header(raw: object) -> PatchHeader:
    fields = _map(
        raw, "PatchHeader", ("format_version", "view", "base_version", "target_version", "groups", "payload_bytes")
    )
    if _int(fields["format_version"], "format_version") != FORMAT_VERSION:
        raise refuse("8.3: the header's format_version is not 2")
    return PatchHeader(
        format_version=FORMAT_VERSION,
        view=_str(fields["view"], "view"),
        base_version=_int(fields["base_version"], "base_version"),
        target_version=_int(fields["target_version"], "target_version"),
        groups=tuple(_group(g) for g in _array(fields["groups"], "groups")),
        payload_bytes=_int(fields["payload_bytes"], "payload_bytes"),
    )


def _group(raw: object) -> GroupEntry:
    fields = _map(raw, "GroupEntry", ("dtype", "elements", "has_base", "tensors", "chunks"))
    dtype = _str(fields["dtype"], "dtype")
    if dtype not in WIDTHS:
        raise refuse(f"8.9: unknown dtype {dtype!r}")
    return GroupEntry(
        dtype=dtype,
        elements=_int(fields["elements"], "elements"),
        has_base=_bool(fields["has_base"], "has_base"),
        tensors=tuple(_tensor(t) for t in _array(fields["tensors"], "tensors")),
        chunks=tuple(_chunk(c) for c in _array(fields["chunks"], "chunks")),
    )


def _tensor(raw: object) -> TensorEntry:
    fields = _map(raw, "TensorEntry", ("name", "shape", "offset", "base_checksum", "target_checksum", "changed"))
    return TensorEntry(
        name=_str(fields["name"], "name"),
        shape=tuple(_int(d, "shape") for d in _array(fields["shape"], "shape")),
        offset=_int(fields["offset"], "offset"),
        base_checksum=_bin(fields["base_checksum"], "base_checksum"),
        target_checksum=_bin(fields["target_checksum"], "target_checksum"),
        changed=_int(fields["changed"], "changed"),
    )


def _chunk(raw: object) -> ChunkEntry:
    items = _array(raw, "ChunkEntry")
    # The page lets a reader ignore items after the fifth or refuse them; the writer never adds any,
    # so extra items can only come from a forger or a future format, and both are refused.
    if len(items) != 5:
        raise refuse(f"8.3: a ChunkEntry has {len(items)} items, not 5")
    start, length, changed, offset, size = (_int(v, "ChunkEntry") for v in items)
    return ChunkEntry(start, length, changed, offset, size)


def _map(raw: object, what: str, keys: tuple[str, ...]) -> dict:
    if not isinstance(raw, dict):
        raise refuse(f"8.3: {what} is not a msgpack map")
    missing = [k for k in keys if k not in raw]
    if missing:
        raise refuse(f"8.3: {what} lacks {missing}")
    extra = [k for k in raw if k not in keys]
    if extra:  # allowed to ignore; refused here because the writer never adds keys
        raise refuse(f"8.3: {what} has unknown keys {extra!r}")
    return raw


def _int(value: object, what: str) -> int:
    # bool is an int in Python; msgpack's true/false are not ints and are refused where ints belong
    if isinstance(value, bool) or not isinstance(value, int):
        raise refuse(f"8.3: {what} must be a msgpack int, got {type(value).__name__}")
    return value


def _str(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise refuse(f"8.3: {what} must be a msgpack str, got {type(value).__name__}")
    return value


def _bool(value: object, what: str) -> bool:
    if not isinstance(value, bool):
        raise refuse(f"8.3: {what} must be a msgpack bool, got {type(value).__name__}")
    return value


def _bin(value: object, what: str) -> bytes:
    if not isinstance(value, bytes):
        raise refuse(f"8.3: {what} must be msgpack bin, got {type(value).__name__}")
    return value


def _array(value: object, what: str) -> list:
    if not isinstance(value, list):
        raise refuse(f"8.3: {what} must be a msgpack array, got {type(value).__name__}")
    return value


# --------------------------------------------------------------------------------------------
# 8.4 layout rules
# --------------------------------------------------------------------------------------------


def check_layout(header: PatchHeader) -> None:
    names: set[str] = set()
    cursor = 0  # records are written back to back in header order (8.4); this reader insists
    for gi, group in enumerate(header.groups):
        where = f"group {gi}"
        if not group.tensors:
            raise refuse(f"8.4: {where} has no tensors")
        flat = 0
        for tensor in group.tensors:
            if tensor.name in names:
                raise refuse(f"8.9: tensor {tensor.name!r} appears twice in the header")
            names.add(tensor.name)
            if any(dim < 0 for dim in tensor.shape):
                raise refuse(f"8.4: {tensor.name!r} has a negative dimension")
            if tensor.offset != flat:
                raise refuse(f"8.4: {tensor.name!r} starts at {tensor.offset}, not {flat}")
            flat += tensor.elements
            want_base = 16 if group.has_base else 0
            if len(tensor.base_checksum) != want_base or len(tensor.target_checksum) != 16:
                raise refuse(f"8.3: {tensor.name!r} has checksums of the wrong length")
        if flat != group.elements:
            raise refuse(f"8.4: {where}'s tensors add up to {flat} elements, not {group.elements}")

        if not group.chunks:
            raise refuse(f"8.4: {where} has no chunks")
        if len(group.tensors) > 1 and (
            len(group.chunks) != 1 or group.chunks[0].start != 0 or group.chunks[0].length != group.elements
        ):
            raise refuse(f"8.4: {where} holds several tensors but not exactly one whole chunk")
        next_start = 0
        for chunk in group.chunks:
            if chunk.start != next_start or not 0 <= chunk.length <= MAX_CHUNK_ELEMENTS:
                raise refuse(f"8.4: {where}'s chunks do not tile it in chunks of at most 2^30")
            next_start = chunk.start + chunk.length
            if chunk.changed == 0:
                if chunk.size != 0:
                    raise refuse(f"8.4: {where} has a chunk with changed 0 and size {chunk.size}")
            else:
                if not 1 <= chunk.changed <= chunk.length:
                    raise refuse(f"8.4: {where} has a chunk with changed {chunk.changed} of {chunk.length}")
                if chunk.size < 2:
                    raise refuse(f"8.4: {where} has a record of {chunk.size} bytes")
                if chunk.offset < 0 or chunk.offset + chunk.size > header.payload_bytes:
                    raise refuse(f"8.4: {where} has a record outside the payload")
            if chunk.offset != cursor:
                raise refuse(f"8.4: {where}'s record at {chunk.offset} is not where the previous one ended ({cursor})")
            cursor += chunk.size
        if next_start != group.elements:
            raise refuse(f"8.4: {where}'s chunks end at {next_start}, not {group.elements}")
    if cursor != header.payload_bytes:
        raise refuse(f"8.4: the records cover {cursor} of {header.payload_bytes} payload bytes")


# --------------------------------------------------------------------------------------------
# 8.5 chunk records and 8.6 streams
# --------------------------------------------------------------------------------------------


@dataclass
class DecodedChunk:
    positions: np.ndarray  # int64, relative to the chunk's start, strictly increasing
    values: np.ndarray  # the coded values v_i, unsigned of the group's width
    transform: int
    dense: bool


def decode_record(record: memoryview, chunk: ChunkEntry, width: int, tally: Counter | None = None) -> DecodedChunk:
    mode, transform = record[0], record[1]
    if mode not in MODES:
        raise refuse(f"8.5: unknown mode {mode}")
    if transform not in TRANSFORMS:
        raise refuse(f"8.5: unknown transform {transform}")
    dense = MODES[mode] == "dense"
    count = chunk.length if dense else chunk.changed
    if tally is not None:
        tally[("mode", MODES[mode])] += 1
        tally[("transform", TRANSFORMS[transform])] += 1

    pos = 2
    gap_planes = []
    if not dense:
        for _ in range(GAP_PLANES):
            plane, pos = read_stream(record, pos, count, tally)
            gap_planes.append(plane)
    value_planes = []
    for _ in range(width):
        plane, pos = read_stream(record, pos, count, tally)
        value_planes.append(plane)
    if pos != len(record):
        raise refuse(f"8.5: {len(record) - pos} bytes left after the record's last stream")

    values = join_planes(value_planes, UNSIGNED[width], count)
    if dense:
        positions = np.arange(chunk.length, dtype=np.int64)
    else:
        # 64-bit: 2^30 gaps of up to 2^32 - 1 cannot wrap, so a forged gap cannot land in range
        gaps = join_planes(gap_planes, np.dtype("<u8"), count)
        positions = (np.cumsum(gaps + np.uint64(1)) - np.uint64(1)).astype(np.int64)
        if int(positions[-1]) >= chunk.length:  # strictly increasing, so the last is the largest
            raise refuse(f"8.5: a change at position {int(positions[-1])} of a chunk of {chunk.length}")
    return DecodedChunk(positions, values, transform, dense)


def join_planes(planes: list[bytes], dtype: np.dtype, count: int) -> np.ndarray:
    """Plane p holds byte p (least significant first) of each integer (8.5)."""
    out = np.zeros(count, dtype=dtype)
    for p, plane in enumerate(planes):
        out |= np.frombuffer(plane, dtype=np.uint8).astype(dtype) << dtype.type(8 * p)
    return out


def read_stream(record: memoryview, pos: int, expected: int, tally: Counter | None = None) -> tuple[bytes, int]:
    """One stream starting at `pos`: its `expected` symbols and where the next stream starts."""
    if pos + STREAM_HEAD.size > len(record):
        raise refuse("8.5: a stream runs past the record's end")
    codec, raw_len, coded_len = STREAM_HEAD.unpack_from(record, pos)
    pos += STREAM_HEAD.size
    if raw_len != expected:
        raise refuse(f"8.6: a stream holds {raw_len} symbols, the record needs {expected}")
    if coded_len > len(record) - pos:
        raise refuse("8.6: a stream's body runs past the record's end")
    body = record[pos : pos + coded_len]
    if codec not in CODECS:
        raise refuse(f"8.6: unknown stream codec {codec}")
    name = CODECS[codec]
    if tally is not None:
        tally[("codec", name)] += 1
    if name == "stored":
        if coded_len != raw_len:
            raise refuse("8.6: a stored stream whose coded_len is not raw_len")
        symbols = bytes(body)
    elif name == "constant":
        if coded_len != 1:
            raise refuse("8.6: a constant stream whose coded_len is not 1")
        symbols = bytes(body) * raw_len
    elif name == "rans":
        symbols = decode_rans(body, raw_len)
    else:
        symbols = zstd_exact(body, expected_len=raw_len, limit=raw_len, what="stream")
    return symbols, pos + coded_len


# --------------------------------------------------------------------------------------------
# zstd: exactly one frame, output bounded (8.2 header, 8.6 codec 3)
# --------------------------------------------------------------------------------------------


def zstd_exact(frame: memoryview, *, expected_len: int | None, limit: int, what: str) -> bytes:
    """The content of `frame`, which must be exactly one zstd frame holding at most `limit` bytes
    (exactly `expected_len` when given)."""
    frame = bytes(frame)
    if zstd_frame_length(frame) != len(frame):
        raise refuse(f"8.2/8.6: the {what} is not exactly one zstd frame")
    declared = zstandard.get_frame_parameters(frame).content_size
    if declared != zstandard.CONTENTSIZE_UNKNOWN and (
        declared > limit or (expected_len is not None and declared != expected_len)
    ):
        raise refuse(f"8.6: the {what}'s zstd frame declares {declared} bytes")
    try:
        # with a declared size libzstd holds the frame to it; without one the output is capped
        content = zstandard.ZstdDecompressor().decompress(frame, max_output_size=limit)
    except zstandard.ZstdError as exc:
        raise refuse(f"8.2/8.6: the {what}'s zstd frame does not decompress ({exc})") from None
    if expected_len is not None and len(content) != expected_len:
        raise refuse(f"8.6: the {what}'s zstd frame holds {len(content)} bytes, not {expected_len}")
    return content


def zstd_frame_length(data: bytes) -> int:
    """The length of the zstd frame at the start of `data` (RFC 8878 3.1.1; what libzstd's
    ZSTD_findFrameCompressedSize returns): frame header, blocks up to the last, optional checksum."""
    try:
        if data[:4] != b"\x28\xb5\x2f\xfd":  # a skippable frame or anything else is not "a zstd frame"
            raise refuse("8.2/8.6: not a zstd frame (magic)")
        pos = zstandard.frame_header_size(data)
        has_checksum = zstandard.get_frame_parameters(data).has_checksum
    except zstandard.ZstdError as exc:
        raise refuse(f"8.2/8.6: a bad zstd frame header ({exc})") from None
    while True:
        if pos + 3 > len(data):
            raise refuse("8.2/8.6: a zstd frame cut short")
        block = int.from_bytes(data[pos : pos + 3], "little")
        last, kind, size = block & 1, (block >> 1) & 3, block >> 3
        if kind == 3:
            raise refuse("8.2/8.6: a zstd block of the reserved type")
        pos += 3 + (1 if kind == 1 else size)  # an RLE block stores its one byte
        if last:
            break
    pos += 4 if has_checksum else 0
    if pos > len(data):
        raise refuse("8.2/8.6: a zstd frame cut short")
    return pos


# --------------------------------------------------------------------------------------------
# 8.7 rANS
# --------------------------------------------------------------------------------------------


def decode_rans(body: memoryview, count: int) -> bytes:
    body = bytes(body)
    if len(body) < 32:
        raise refuse("8.7: the rANS presence bitmap runs past the body")
    present = [s for s in range(256) if body[s >> 3] >> (s & 7) & 1]
    pos = 32
    freq = [0] * 256
    for s in present:
        value, shift, used = 0, 0, 0
        while True:
            if pos >= len(body):
                raise refuse("8.7: the rANS frequencies run past the body")
            if used == 3:
                raise refuse("8.7: a rANS frequency longer than 3 bytes")
            byte = body[pos]
            pos += 1
            used += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        if not 1 <= value <= M:
            raise refuse(f"8.7: rANS frequency {value} of symbol {s}")
        freq[s] = value
    if sum(freq) != M:
        raise refuse(f"8.7: rANS frequencies sum to {sum(freq)}, not {M}")
    if pos + 16 > len(body):
        raise refuse("8.7: the rANS states run past the body")
    states = list(struct.unpack_from("<4I", body, pos))
    pos += 16
    if not all(L <= x < STATE_LIMIT for x in states):
        raise refuse("8.7: a rANS initial state outside [L, 2^31)")

    cum = [0] * 256
    slot_symbol = bytearray(M)  # slot -> the symbol owning it
    total = 0
    for s in present:
        cum[s] = total
        slot_symbol[total : total + freq[s]] = bytes([s]) * freq[s]
        total += freq[s]

    out = bytearray(count)
    for i in range(count):
        x = states[i & 3]
        slot = x & (M - 1)
        s = slot_symbol[slot]
        out[i] = s
        x = freq[s] * (x >> SCALE_BITS) + slot - cum[s]
        while x < L:
            if pos >= len(body):
                raise refuse("8.7: the rANS stream ran out of renormalisation bytes")
            x = (x << 8) | body[pos]
            pos += 1
        states[i & 3] = x
    if any(x != L for x in states):
        raise refuse("8.7: a rANS final state is not L")
    if pos != len(body):
        raise refuse(f"8.7: {len(body) - pos} rANS body bytes left unread")
    return bytes(out)


# --------------------------------------------------------------------------------------------
# 8.8 value transforms
# --------------------------------------------------------------------------------------------


def inverse_transform(transform: int, old: np.ndarray, v: np.ndarray) -> np.ndarray:
    """The new bits from the old bits and the coded value, on n-bit unsigned integers (mod 2^n)."""
    if TRANSFORMS[transform] == "xor":
        return old ^ v
    if TRANSFORMS[transform] == "raw":
        return v.copy()
    uint = old.dtype.type
    n = 8 * old.dtype.itemsize
    top = uint(1 << (n - 1))
    ones = uint((1 << n) - 1)

    def ord_(b: np.ndarray) -> np.ndarray:  # flips the magnitude bits of a negative float
        return np.where(b & top, b ^ (top - uint(1)), b).astype(old.dtype)

    unzigzag = (v >> uint(1)) ^ ((v & uint(1)) * ones)
    return ord_(ord_(old) + unzigzag)  # numpy's unsigned arithmetic wraps mod 2^n, as 8.8 needs


# --------------------------------------------------------------------------------------------
# 8.9 applying a patch
# --------------------------------------------------------------------------------------------


def xxh3(bits: np.ndarray) -> bytes:
    """The 16-byte canonical (big-endian) XXH3-128 of a tensor's raw bytes."""
    return xxhash.xxh3_128_digest(np.ascontiguousarray(bits).view(np.uint8))


def apply_patch(
    blob: bytes,
    shard: dict[str, Tensor],
    *,
    edge: Edge | None = None,
    target_digests: dict[str, tuple[str, tuple[int, ...], str]] | None = None,
    sha256: str | None = None,
    tally: Counter | None = None,
) -> dict[str, Tensor]:
    """The shard at the patch's target version.

    `shard` holds the base version's tensors; those the patch names with a base are patched in
    place (the returned Tensor is the same object), new ones are built from zero bits, those it
    does not name are returned as they are. `edge`, `target_digests` (name -> dtype, shape, xxh3
    hex, from the verified version event) and `sha256` (the signed blob digest) are what the
    caller knows; each check is skipped only when its knowledge is not given.
    """
    header, payload = read_patch(blob, sha256=sha256)
    check_edge(header, edge)
    targets = build_targets(header, shard, target_digests)

    # Decode every record before writing anything: a malformed record refuses the whole patch
    decoded: list[tuple[GroupEntry, ChunkEntry, DecodedChunk]] = []
    for group in header.groups:
        for chunk in group.chunks:
            if chunk.changed:
                record = payload[chunk.offset : chunk.offset + chunk.size]
                decoded.append((group, chunk, decode_record(record, chunk, group.width, tally)))

    undo: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (array, indices, old bits)
    touched: set[str] = set()
    for group, chunk, record in decoded:
        flat = record.positions + chunk.start
        owners = tensor_of(group, flat)
        for t in np.unique(owners):
            tensor = group.tensors[int(t)]
            mine = owners == t
            index = flat[mine] - tensor.offset
            bits = targets[tensor.name].bits
            old = bits[index]
            new = inverse_transform(record.transform, old, record.values[mine])
            if record.dense:  # only the elements whose bits change are written
                moved = new != old
                index, old, new = index[moved], old[moved], new[moved]
            if not record.dense or index.size:
                touched.add(tensor.name)
            undo.append((bits, index, old))
            bits[index] = new

    for group in header.groups:
        for tensor in group.tensors:
            unchanged_base = group.has_base and tensor.name not in touched
            if unchanged_base and tensor.base_checksum == tensor.target_checksum:
                continue  # its verified base is its target (8.9 step 5)
            if xxh3(targets[tensor.name].bits) != tensor.target_checksum:
                for bits, index, old in reversed(undo):
                    bits[index] = old
                raise refuse(f"8.9: {tensor.name!r} does not hash to its target_checksum after the patch")

    result = dict(shard)
    result.update(targets)
    return result


def check_edge(header: PatchHeader, edge: Edge | None) -> None:
    if edge is None:
        return
    if (header.view, header.base_version, header.target_version) != (edge.view, edge.base_version, edge.target_version):
        raise refuse(
            f"8.9: the patch is {header.view} v{header.base_version} -> v{header.target_version}, "
            f"the edge is {edge.view} v{edge.base_version} -> v{edge.target_version}"
        )


def build_targets(
    header: PatchHeader,
    shard: dict[str, Tensor],
    target_digests: dict[str, tuple[str, tuple[int, ...], str]] | None,
) -> dict[str, Tensor]:
    """Check every named tensor against the base and the target (8.9 step 3) and return the
    tensors to write: the base's arrays where the group has a base, zero bits where not."""
    targets: dict[str, Tensor] = {}
    for group in header.groups:
        layout = UNSIGNED[group.width]
        for tensor in group.tensors:
            if target_digests is not None:
                if tensor.name not in target_digests:
                    raise refuse(f"8.9: {tensor.name!r} is not a tensor of the target shard")
                dtype, shape, digest = target_digests[tensor.name]
                if (dtype, tuple(shape)) != (group.dtype, tensor.shape):
                    raise refuse(f"8.9: {tensor.name!r} is not {group.dtype} {tensor.shape} in the target")
                if tensor.target_checksum.hex() != digest:
                    raise refuse(f"8.9: {tensor.name!r}'s target_checksum is not the target's digest")
            if not group.has_base:
                targets[tensor.name] = Tensor(group.dtype, tensor.shape, np.zeros(tensor.elements, layout))
                continue
            base = shard.get(tensor.name)
            if base is None:
                raise refuse(f"8.9: {tensor.name!r} has a base in the patch but not in the shard")
            if (base.dtype, tuple(base.shape)) != (group.dtype, tensor.shape):
                raise refuse(f"8.9: the base {tensor.name!r} is not {group.dtype} {tensor.shape}")
            bits = base.bits
            if bits.dtype != layout or bits.ndim != 1 or bits.size != tensor.elements or not bits.flags.writeable:
                raise ValueError(f"{tensor.name!r}: bits must be a writable flat {layout} array of {tensor.elements}")
            if xxh3(bits) != tensor.base_checksum:
                raise refuse(f"8.9: the base {tensor.name!r} does not hash to the patch's base_checksum")
            if tensor.changed == 0 and tensor.base_checksum != tensor.target_checksum:
                raise refuse(f"8.9: {tensor.name!r} changes nothing but its checksums differ")
            targets[tensor.name] = base
    return targets


def tensor_of(group: GroupEntry, flat: np.ndarray) -> np.ndarray:
    """For each flat index of the group, the index of the tensor holding it (8.5)."""
    ends = np.array([t.offset + t.elements for t in group.tensors], dtype=np.int64)
    return np.searchsorted(ends, flat, side="right")
