"""Format v2 of the patch codec: which codings chunks pick, in-place writes, threads, hostile patches."""

import struct
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import msgspec
import numpy as np
import pytest
import zstandard

from pipeline import patch_codec
from pipeline.codec import kernels
from pipeline.patch_codec import ChecksumMismatch, PatchFormatError, TensorBits

SPECIAL_16 = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFFF, 0x0001, 0x8001, 0x7F7F, 0xFFC1]


def _bf16(rng: np.random.Generator, n: int) -> np.ndarray:
    """Plausible bf16 weights: N(0, 0.02), the high half of float32."""
    return (rng.normal(0, 0.02, size=n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _pair(base: np.ndarray, target: np.ndarray, dtype: str = "BF16") -> tuple[dict, dict]:
    shape = (len(base),)
    return {"w": TensorBits(dtype, shape, base)}, {"w": TensorBits(dtype, shape, target)}


def _records(patch: bytes) -> list[bytes]:
    header, payload = patch_codec.read_header(patch)
    return [bytes(payload[c.offset : c.offset + c.size]) for g in header.groups for c in g.chunks]


def _rebuild(patch: bytes, header: patch_codec.PatchHeader, payload: bytes | None = None) -> bytes:
    """A patch with another header (and payload): what a forger or a bit flip makes."""
    _, old_payload = patch_codec.read_header(patch)
    body = zstandard.ZstdCompressor().compress(msgspec.msgpack.encode(header))
    preamble = struct.pack("<8sHI", patch_codec.MAGIC, patch_codec.FORMAT_VERSION, len(body))
    return preamble + body + (bytes(old_payload) if payload is None else payload)


def _with_chunk(patch: bytes, **changes) -> bytes:
    header, _ = patch_codec.read_header(patch)
    group = header.groups[0]
    chunk = msgspec.structs.replace(group.chunks[0], **changes)
    group = msgspec.structs.replace(group, chunks=[chunk, *group.chunks[1:]])
    return _rebuild(patch, msgspec.structs.replace(header, groups=[group, *header.groups[1:]]))


def _with_header_frame(patch: bytes, frame: bytes) -> bytes:
    """`patch` with its header replaced by `frame` as it is (raw bytes a forger wrote, canonical or not)."""
    _, payload = patch_codec.read_header(patch)
    return struct.pack("<8sHI", patch_codec.MAGIC, patch_codec.FORMAT_VERSION, len(frame)) + frame + bytes(payload)


def _with_record(patch: bytes, record: bytes) -> bytes:
    """A one-chunk patch whose only chunk record is `record` (the whole payload)."""
    header, _ = patch_codec.read_header(patch)
    (group,) = header.groups
    chunk = msgspec.structs.replace(group.chunks[0], offset=0, size=len(record))
    group = msgspec.structs.replace(group, chunks=[chunk])
    return _rebuild(patch, msgspec.structs.replace(header, groups=[group], payload_bytes=len(record)), record)


def _round_trip(base: dict, target: dict, **kwargs) -> bytes:
    patch = patch_codec.encode(base, target, **kwargs)
    out = patch_codec.apply(patch, base)
    for name, tb in target.items():
        assert np.array_equal(out[name].bits, tb.bits), name
    return patch


# ---------------------------------------------------------------- what chunks pick


def test_each_value_transform_is_picked_where_it_codes_smallest():
    rng = np.random.default_rng(0)
    n = 200_000
    base = _bf16(rng, n)
    idx = np.sort(rng.choice(n, n // 100, replace=False))

    nudged = base.copy()  # ±1 ULP: the ULP distance is one bit, the XOR a carry chain
    up = rng.random(len(idx)) < 0.5
    magnitude = nudged[idx] & 0x7FFF
    nudged[idx] = np.where(up | (magnitude == 0), nudged[idx] + 1, nudged[idx] - 1)

    flipped = base.copy()  # one fixed bit flips: the XOR is constant, the ULP distance is ±128 at random
    flipped[idx] ^= 0x0080

    pruned = base.copy()  # set to zero: the new bits are constant, XOR and ULP are as random as the old
    pruned[idx] = 0
    pruned_idx = idx[base[idx] != 0]

    for target, kind, changed in (
        (nudged, kernels.ULP, len(idx)),
        (flipped, kernels.XOR, len(idx)),
        (pruned, kernels.RAW, len(pruned_idx)),
    ):
        patch = _round_trip(*_pair(base, target))
        (record,) = _records(patch)
        assert record[0] == patch_codec.SPARSE and record[1] == kind
        header, _ = patch_codec.read_header(patch)
        assert header.groups[0].tensors[0].changed == changed


def test_dense_chunks_for_changes_everywhere_and_new_tensors():
    rng = np.random.default_rng(1)
    base = _bf16(rng, 50_000)
    target = base + np.uint16(1)  # every element one ULP up (none is a negative zero or NaN here)
    (record,) = _records(_round_trip(*_pair(base, target)))
    assert record[0] == patch_codec.DENSE and record[1] == kernels.ULP
    (record,) = _records(_round_trip(None, _pair(base, target)[1]))
    assert record[0] == patch_codec.DENSE and record[1] == kernels.RAW
    (record,) = _records(_round_trip(*_pair(base, base.copy())))
    assert record == b""  # an unchanged chunk has an empty record


@pytest.mark.parametrize("kind", [kernels.XOR, kernels.ULP, kernels.RAW])
@pytest.mark.parametrize("dtype", ["BF16", "F8_E4M3", "F32", "F64"])
@pytest.mark.parametrize("density", [0.001, 0.3, 1.0])
def test_every_transform_round_trips_special_patterns(monkeypatch, kind, dtype, density):
    """Each transform forced in turn, sparse and dense chunks, several chunks per tensor."""
    monkeypatch.setattr(patch_codec, "_TRANSFORMS", (kind,))
    rng = np.random.default_rng(2)
    width = {"BF16": 2, "F8_E4M3": 1, "F32": 4, "F64": 8}[dtype]
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[width]
    n = 20_000
    info = np.iinfo(unsigned)
    base = rng.integers(0, int(info.max), size=n, dtype=unsigned, endpoint=True)
    target = base.copy()
    idx = rng.choice(n, max(1, int(n * density)), replace=False)
    top = np.array([0, 1, int(info.max), int(info.max) >> 1, (int(info.max) >> 1) + 1], dtype=unsigned)
    if width == 2:
        top = np.concatenate([top, np.array(SPECIAL_16, dtype=np.uint16)])
    target[idx] = rng.choice(top, size=len(idx))
    target[idx[::3]] = base[idx[::3]] + unsigned(1)  # wraps at the top: unsigned arithmetic
    base_d, target_d = _pair(base, target, dtype)
    patch = _round_trip(base_d, target_d, chunk_elements=4096)
    kinds = {record[1] for record in _records(patch) if record}
    assert kinds == {kind}


# ---------------------------------------------------------------- in place, only where bits change

_ONLY_CHANGED_PAGES = textwrap.dedent(
    """
    import ctypes, mmap, sys
    import numpy as np
    from pipeline import patch_codec
    from pipeline.patch_codec import TensorBits

    path, n, dtype_name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    rng = np.random.default_rng(0)
    unsigned = {"BF16": np.uint16, "F32": np.uint32}[dtype_name]
    base = rng.integers(0, np.iinfo(unsigned).max, size=n, dtype=unsigned)
    target = base.copy()
    page = mmap.PAGESIZE
    per_page = page // base.itemsize
    changed_pages = [3, 4, 40, n // per_page - 1]
    for p in changed_pages:
        at = p * per_page + rng.integers(0, per_page, size=5)
        target[at] += 1
    patch = patch_codec.encode({"w": TensorBits(dtype_name, (n,), base)}, {"w": TensorBits(dtype_name, (n,), target)},
                               chunk_elements=1 << 14)
    base.tofile(path)
    served = np.memmap(path, dtype=unsigned, mode="r+")
    # Every page without a change becomes read-only: a write there kills this process (SIGSEGV).
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    address = served.ctypes.data
    assert address % page == 0
    for p in range(n // per_page):
        if p not in changed_pages:
            assert libc.mprotect(address + p * page, page, mmap.PROT_READ) == 0, ctypes.get_errno()
    header, payload = patch_codec.read_header(patch)
    for group in header.groups:
        out = patch_codec.apply_group(group, payload, {"w": served}, inplace=True, verify_base=True)
        assert np.shares_memory(out["w"], served)
    assert np.array_equal(served, target)
    served.flush()
    print("ok")
    """
)


@pytest.mark.parametrize("dtype", ["BF16", "F32"])
def test_apply_on_a_memmap_writes_only_pages_that_change(tmp_path, dtype):
    """The served file is written where bits change and nowhere else: pages without a change are
    made read-only before the apply, so any other write would crash the process."""
    path = tmp_path / "served.bin"
    n = 1 << 18
    run = subprocess.run(
        [sys.executable, "-c", _ONLY_CHANGED_PAGES, str(path), str(n), dtype], capture_output=True, text=True
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
    dtype_np = np.uint16 if dtype == "BF16" else np.uint32
    assert np.fromfile(path, dtype=dtype_np).size == n


@pytest.mark.parametrize("chunk_elements", [1 << 22, 512])
def test_unchanged_tensors_are_not_hashed_again(monkeypatch, chunk_elements):
    """Small tensors sharing a chunk are hashed one by one, a large tensor chunk by chunk
    (OrderedHash): either way only the tensor that changed is hashed."""
    rng = np.random.default_rng(3)
    same, moved = _bf16(rng, 1000), _bf16(rng, 3000)
    target_moved = moved.copy()
    target_moved[::100] += 1
    base = {"same": TensorBits("BF16", (1000,), same), "moved": TensorBits("BF16", (3000,), moved)}
    target = {"same": TensorBits("BF16", (1000,), same.copy()), "moved": TensorBits("BF16", (3000,), target_moved)}
    patch = patch_codec.encode(base, target, chunk_elements=chunk_elements)
    hashed: list[int] = []
    real_checksum, real_ordered = patch_codec.checksum, patch_codec.OrderedHash

    class CountedHash(real_ordered):
        def __init__(self, bits, bounds):
            hashed.append(len(bits))
            super().__init__(bits, bounds)

    monkeypatch.setattr(patch_codec, "checksum", lambda bits: hashed.append(len(bits)) or real_checksum(bits))
    monkeypatch.setattr(patch_codec, "OrderedHash", CountedHash)
    out = patch_codec.apply(patch, base, verify_base=False)
    assert hashed == [3000]  # only the tensor that changed
    assert np.array_equal(out["moved"].bits, target_moved) and np.array_equal(out["same"].bits, same)
    hashed.clear()
    header, payload = patch_codec.read_header(patch)
    bits = {n: b.bits.copy() for n, b in base.items()}
    for group in header.groups:
        patch_codec.apply_group(group, payload, bits, inplace=True, verify_base=False)
    assert hashed == [3000]
    assert np.array_equal(bits["moved"], target_moved)
    hashed.clear()
    patch_codec.apply(patch, base, verify_base=True)
    assert sorted(hashed) == [1000, 3000, 3000]  # both bases, then the changed target


def test_a_tensor_the_header_calls_unchanged_is_hashed_when_the_record_changes_it():
    """Whether a tensor is hashed follows what the chunks wrote, not what the header claims."""
    rng = np.random.default_rng(4)
    a, b = _bf16(rng, 500), _bf16(rng, 700)
    target_a = a.copy()
    target_a[7] += 1
    base = {"a": TensorBits("BF16", (500,), a), "b": TensorBits("BF16", (700,), b)}
    target = {"a": TensorBits("BF16", (500,), target_a), "b": TensorBits("BF16", (700,), b.copy())}
    patch = patch_codec.encode(base, target)
    header, _ = patch_codec.read_header(patch)
    (group,) = header.groups  # both tensors share one chunk
    lying = [msgspec.structs.replace(t, target_checksum=t.base_checksum, changed=0) for t in group.tensors]
    forged = _rebuild(patch, msgspec.structs.replace(header, groups=[msgspec.structs.replace(group, tensors=lying)]))
    with pytest.raises(ChecksumMismatch) as caught:
        patch_codec.apply(forged, base, verify_base=False)
    assert caught.value.which == "target" and caught.value.tensor == "a"


# ---------------------------------------------------------------- threads


def test_encode_and_apply_are_identical_with_one_and_four_threads():
    rng = np.random.default_rng(5)
    base, target = {}, {}
    for i, n in enumerate([100_000, 3, 70_000, 0, 5000]):
        b = _bf16(rng, n)
        t = b.copy()
        if n:
            idx = rng.choice(n, max(1, n // 50), replace=False)
            t[idx] += 1
        base[f"t{i}"], target[f"t{i}"] = TensorBits("BF16", (n,), b), TensorBits("BF16", (n,), t)
    patches, outputs = [], []
    for threads in (1, 4):
        with ThreadPoolExecutor(max_workers=threads) as pool:
            patch = patch_codec.encode(base, target, chunk_elements=8192, pool=pool)
            copies = {n: TensorBits(b.dtype, b.shape, b.bits.copy()) for n, b in base.items()}
            outputs.append(patch_codec.apply(patch, copies, inplace=True, pool=pool))
        patches.append(patch)
    assert patches[0] == patches[1]
    for name, tb in target.items():
        assert np.array_equal(outputs[0][name].bits, tb.bits) and np.array_equal(outputs[1][name].bits, tb.bits)


# ---------------------------------------------------------------- hostile patches


@pytest.fixture(scope="module")
def sample():
    rng = np.random.default_rng(6)
    base = _bf16(rng, 40_000)
    target = base.copy()
    idx = rng.choice(40_000, 800, replace=False)
    target[idx] += 1
    target[idx[:50]] = rng.integers(0, 65535, size=50, dtype=np.uint16)
    base_d, target_d = _pair(base, target)
    return base_d, target_d, patch_codec.encode(base_d, target_d, chunk_elements=16_384)


def test_v1_patches_are_refused_clearly(sample):
    base, _, patch = sample
    v1 = struct.pack("<8sHI", patch_codec.MAGIC, 1, 0) + patch[14:]
    with pytest.raises(PatchFormatError, match="v1"):
        patch_codec.apply(v1, base)


@pytest.mark.parametrize("cut", [0, 5, 13, 20, -1, -7, -100])
def test_truncated_patches_are_refused(sample, cut):
    base, _, patch = sample
    with pytest.raises(PatchFormatError):
        patch_codec.apply(patch[:cut], base)


def test_flipped_header_bytes_are_refused(sample):
    base, _, patch = sample
    header_len = struct.unpack_from("<I", patch, 10)[0]
    for at in range(0, 14 + header_len, 3):
        damaged = bytearray(patch)
        damaged[at] ^= 0x5A
        with pytest.raises(PatchFormatError):
            patch_codec.apply(bytes(damaged), base)


def test_flipped_payload_bytes_never_give_wrong_bits(sample):
    base, target, patch = sample
    rng = np.random.default_rng(7)
    header_len = struct.unpack_from("<I", patch, 10)[0]
    start = 14 + header_len
    refused = 0
    for _ in range(300):
        damaged = bytearray(patch)
        at = int(rng.integers(start, len(patch)))
        damaged[at] ^= int(rng.integers(1, 256))
        try:
            out = patch_codec.apply(bytes(damaged), base)
        except PatchFormatError:
            refused += 1
            continue
        assert np.array_equal(out["w"].bits, target["w"].bits)
    assert refused > 250


@pytest.mark.parametrize(
    "changes",
    [
        {"changed": 10**9},
        {"changed": 0},
        {"length": 10**12},
        {"start": -5},
        {"start": 39_000},
        {"size": 10**9},
        {"offset": 10**9},
        {"offset": -1},
        {"size": 1},
    ],
)
def test_forged_chunk_entries_are_refused(sample, changes):
    base, _, patch = sample
    with pytest.raises(PatchFormatError):
        patch_codec.apply(_with_chunk(patch, **changes), base)


def _stream(codec: int, raw: int, body: bytes) -> bytes:
    return struct.pack("<BII", codec, raw, len(body)) + body


@pytest.mark.parametrize(
    "record",
    [
        # gaps of 0xFFFF: the second position is already past a 1000-element chunk
        bytes([1, 0])
        + _stream(1, 4, b"\xff") * 2
        + _stream(1, 4, b"\x00") * 2
        + _stream(0, 4, b"\x01\x02\x03\x04") * 2,
        # a stream that claims more symbols than the chunk has changes
        bytes([1, 0]) + _stream(0, 5, b"\x00" * 5) + _stream(1, 4, b"\x00") * 5,
        # a stream that runs past its record
        bytes([1, 0]) + struct.pack("<BII", 0, 4, 400) + b"\x00" * 4,
        # unknown mode, transform and codec
        bytes([9, 0]) + _stream(1, 4, b"\x00") * 6,
        bytes([1, 7]) + _stream(1, 4, b"\x00") * 6,
        bytes([1, 0]) + _stream(6, 4, b"\x00") * 6,
        # a constant stream of two bytes, a stored stream of the wrong size
        bytes([1, 0]) + _stream(1, 4, b"\x00\x00") + _stream(1, 4, b"\x00") * 5,
        bytes([1, 0]) + _stream(0, 4, b"\x00" * 3) + _stream(1, 4, b"\x00") * 5,
        # rANS and zstd streams that do not decode
        bytes([1, 0]) + _stream(2, 4, b"\x01" * 40) + _stream(1, 4, b"\x00") * 5,
        bytes([1, 0]) + _stream(3, 4, b"\x28\xb5\x2f\xfd\x00") + _stream(1, 4, b"\x00") * 5,
        # bytes after the streams
        bytes([1, 0]) + _stream(1, 4, b"\x00") * 6 + b"\x00",
        # too short to hold a mode and a transform
        bytes([1]),
    ],
)
def test_forged_chunk_records_are_refused(record):
    base = np.arange(1000, dtype=np.uint16)
    target = base.copy()
    target[[1, 5, 9, 13]] += 1
    base_d, target_d = _pair(base, target)
    forged = _with_record(patch_codec.encode(base_d, target_d), record)
    with pytest.raises(PatchFormatError):
        patch_codec.apply(forged, base_d)


def test_forged_group_layouts_are_refused(sample):
    base, _, patch = sample
    header, _ = patch_codec.read_header(patch)
    group = header.groups[0]
    for forged_group in (
        msgspec.structs.replace(group, dtype="Q7"),
        msgspec.structs.replace(group, elements=group.elements + 1),
        msgspec.structs.replace(group, tensors=[msgspec.structs.replace(group.tensors[0], shape=[-1, -40_000])]),
        msgspec.structs.replace(group, tensors=[msgspec.structs.replace(group.tensors[0], offset=3)]),
    ):
        with pytest.raises(PatchFormatError):
            patch_codec.apply(_rebuild(patch, msgspec.structs.replace(header, groups=[forged_group])), base)


def test_a_failing_chunk_leaves_no_job_running_after_apply_raises(sample, monkeypatch):
    """apply() returns (or raises) only when every chunk job has finished: the caller may rebuild
    the same arrays from a keyframe right after a refusal. The first chunk fails at once while the
    others are still at work (held up on purpose)."""
    import threading
    import time

    base, _, patch = sample
    header, _ = patch_codec.read_header(patch)
    (group,) = header.groups
    assert len(group.chunks) >= 3
    broken = msgspec.structs.replace(group.chunks[0], size=group.chunks[0].size - 1)
    group = msgspec.structs.replace(group, chunks=[broken, *group.chunks[1:]])
    forged = _rebuild(patch, msgspec.structs.replace(header, groups=[group]))
    running, lock = [0], threading.Lock()
    real = patch_codec._apply_group_chunk

    def counted(group, chunk, data, arrays):
        with lock:
            running[0] += 1
        try:
            if chunk.start != 0:
                time.sleep(0.2)  # still writing when the first chunk's failure is known
            return real(group, chunk, data, arrays)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(patch_codec, "_apply_group_chunk", counted)
    with ThreadPoolExecutor(max_workers=4) as pool:
        buffers = {n: TensorBits(b.dtype, b.shape, b.bits.copy()) for n, b in base.items()}
        with pytest.raises(PatchFormatError):
            patch_codec.apply(forged, buffers, inplace=True, pool=pool)
        assert running[0] == 0


def test_strided_inputs_round_trip():
    """Callers may pass views that are not contiguous; the kernels get contiguous copies."""
    rng = np.random.default_rng(8)
    wide = _bf16(rng, 40_000)
    changed = wide.copy()
    changed[::7] += 1
    base, target = _pair(wide[::2], changed[::2])
    _round_trip(base, target, chunk_elements=4096)


# ---------------------------------------------------------------- what a reader written from the doc refuses too


def test_bytes_after_a_zstd_frame_are_refused():
    """python-zstandard ignores what follows a frame; a reader built from docs/FORMAT.md refuses it, so
    the codec must as well, or two readers would disagree on one patch."""
    base = np.zeros(4096, dtype=np.uint16)
    target = (np.arange(4096) % 251).astype(np.uint16)  # every element changes: a dense chunk
    base_d, target_d = _pair(base, target)
    patch = patch_codec.encode(base_d, target_d)
    header, _ = patch_codec.read_header(patch)
    # the header frame with a byte after it
    forged = _with_header_frame(patch, zstandard.ZstdCompressor().compress(msgspec.msgpack.encode(header)) + b"\x00")
    with pytest.raises(PatchFormatError, match="followed by other bytes"):
        patch_codec.read_header(forged)
    # a dense zstd stream with a byte after its frame
    n = 4096
    planes = [np.frombuffer(target.astype("<u2").tobytes(), np.uint8)[p::2].tobytes() for p in range(2)]
    streams = b"".join(
        struct.pack("<BII", 3, n, len(frame)) + frame
        for frame in (zstandard.ZstdCompressor().compress(plane) + b"\x07" for plane in planes)
    )
    forged = _with_record(patch, bytes([2, 2]) + streams)  # dense, raw values
    with pytest.raises(PatchFormatError):
        patch_codec.apply(forged, base_d)
    # the same record without the stray bytes is a valid patch: what was refused was only the extra byte
    clean = b"".join(
        struct.pack("<BII", 3, n, len(f)) + f for f in (zstandard.ZstdCompressor().compress(p) for p in planes)
    )
    valid = _with_record(patch, bytes([2, 2]) + clean)
    assert np.array_equal(patch_codec.apply(valid, base_d)["w"].bits, target)


def test_a_tensor_named_twice_is_refused():
    rng = np.random.default_rng(3)
    base, target = _bf16(rng, 100), _bf16(rng, 100)
    patch = patch_codec.encode(
        {"a": TensorBits("BF16", (100,), base), "b": TensorBits("BF16", (100,), base.copy())},
        {"a": TensorBits("BF16", (100,), target), "b": TensorBits("BF16", (100,), target.copy())},
        chunk_elements=100,
    )
    header, _ = patch_codec.read_header(patch)
    renamed = [
        msgspec.structs.replace(g, tensors=[msgspec.structs.replace(t, name="a") for t in g.tensors])
        for g in header.groups
    ]
    with pytest.raises(PatchFormatError, match="more than once"):
        patch_codec.read_header(_rebuild(patch, msgspec.structs.replace(header, groups=renamed)))


def test_empty_new_tensors_round_trip():
    target = {
        "empty": TensorBits("BF16", (0,), np.zeros(0, np.uint16)),
        "flat": TensorBits("BF16", (2, 0, 3), np.zeros(0, np.uint16)),
    }
    for base in (None, {"other": TensorBits("F32", (3,), np.arange(3, dtype=np.uint32))}):
        out = patch_codec.apply(patch_codec.encode(base, target), base)
        assert {n: (t.shape, len(t.bits)) for n, t in out.items()} == {"empty": ((0,), 0), "flat": ((2, 0, 3), 0)}


@pytest.mark.parametrize(
    "edit",
    [
        # a repeated key: a lenient decoder keeps the last one, so two readers could disagree
        lambda raw: raw.replace(b"\x86\xaeformat_version\x02", b"\x87\xaeformat_version\x02\xaeformat_version\x02", 1),
        # an unknown key
        lambda raw: raw.replace(b"\x86\xaeformat_version\x02", b"\x87\xa5extra\x00\xaeformat_version\x02", 1),
    ],
)
def test_non_canonical_headers_are_refused(sample, edit):
    base, _, patch = sample
    header, _ = patch_codec.read_header(patch)
    raw = msgspec.msgpack.encode(header)
    forged_raw = edit(raw)
    assert forged_raw != raw
    forged = _with_header_frame(patch, zstandard.ZstdCompressor().compress(forged_raw))
    with pytest.raises(PatchFormatError):
        patch_codec.apply(forged, base)


def test_a_chunk_entry_with_an_extra_item_is_refused(sample):
    base, _, patch = sample
    header, _ = patch_codec.read_header(patch)
    raw = msgspec.msgpack.encode(header)
    chunk = header.groups[0].chunks[0]
    entry = msgspec.msgpack.encode([chunk.start, chunk.length, chunk.changed, chunk.offset, chunk.size])
    extended = b"\x96" + entry[1:] + b"\x00"
    assert raw.count(entry) == 1
    forged = _with_header_frame(patch, zstandard.ZstdCompressor().compress(raw.replace(entry, extended)))
    with pytest.raises(PatchFormatError, match="canonical"):
        patch_codec.apply(forged, base)
