"""Patches decoded by a reader written only from docs/FORMAT.md (tests/format_reader/patch_reader.py).

The codec encodes, through its public entry point only; the independent reader decodes and must give
the target's bits exactly, for every dtype width, density, transform and stream codec, and must refuse
truncated, corrupted and forged patches (each refusal names the rule of the page it enforces). The
page's own worked examples (8.10, 8.11) are decoded from the page's bytes.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
import xxhash
import zstandard

from pipeline.bits import to_bits
from pipeline.patch_codec import TensorBits, encode
from tests.format_reader.patch_reader import (
    Edge,
    PatchRefused,
    Tensor,
    apply_patch,
    decode_rans,
    read_patch,
    read_stream,
)

FORMAT_MD = Path(__file__).resolve().parents[1] / "docs" / "FORMAT.md"
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
WIDTH = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "U8": 1, "I32": 4, "I64": 8, "BOOL": 1}
EDGE = Edge("bf16", 41, 42)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def tb(dtype: str, bits: np.ndarray, shape: tuple[int, ...] | None = None) -> TensorBits:
    bits = np.ascontiguousarray(bits, dtype=UINT[WIDTH[dtype]]).reshape(-1)
    return TensorBits(dtype, shape if shape is not None else (bits.size,), bits)


def digests(tensors: dict[str, TensorBits]) -> dict[str, tuple[str, tuple[int, ...], str]]:
    return {
        name: (t.dtype, tuple(t.shape), xxhash.xxh3_128_hexdigest(np.ascontiguousarray(t.bits).view(np.uint8)))
        for name, t in tensors.items()
    }


def as_shard(tensors: dict[str, TensorBits] | None) -> dict[str, Tensor]:
    """The reader's view of a base: its own Tensor type, over a copy of the bits."""
    return {n: Tensor(t.dtype, tuple(t.shape), np.array(t.bits, copy=True)) for n, t in (tensors or {}).items()}


def encode_patch(base, target, chunk_elements: int = 1 << 22) -> bytes:
    return encode(
        base,
        target,
        view=EDGE.view,
        base_version=EDGE.base_version,
        target_version=EDGE.target_version,
        chunk_elements=chunk_elements,
    )


def decode_and_compare(base, target, chunk_elements: int = 1 << 22, tally: Counter | None = None) -> dict[str, Tensor]:
    blob = encode_patch(base, target, chunk_elements)
    shard = as_shard(base)
    patched = apply_patch(blob, shard, edge=EDGE, target_digests=digests(target), tally=tally)
    for name, want in target.items():
        got = patched[name]
        assert (got.dtype, tuple(got.shape)) == (want.dtype, tuple(want.shape)), name
        assert got.bits.dtype == want.bits.dtype and np.array_equal(got.bits, want.bits), name
        if base and name in base and (base[name].dtype, tuple(base[name].shape)) == (want.dtype, tuple(want.shape)):
            assert got is shard[name], f"{name} with a base is patched in place"
    return patched


def change(rng: np.random.Generator, base: np.ndarray, fraction: float, how: str) -> np.ndarray:
    """`base` with `fraction` of its elements changed: by one ULP up or down (in float order, so
    negative values move the other way), or to arbitrary bits."""
    target = base.copy()
    count = max(1, round(fraction * base.size))
    where = rng.choice(base.size, size=count, replace=False)
    if how == "ulp":
        step = rng.choice(np.array([1, -1], dtype=np.int64), size=count)
        bits = target[where].astype(np.int64)
        target[where] = (bits + step).astype(base.dtype)  # wraps at the ends, still a valid pattern
    else:
        info = np.iinfo(base.dtype)
        target[where] = rng.integers(0, int(info.max), size=count, dtype=base.dtype, endpoint=True)
    return target


def random_bits(rng: np.random.Generator, dtype: str, n: int) -> np.ndarray:
    """Plausible values: normal floats for float dtypes, small integers for integer ones."""
    values = rng.standard_normal(n).astype(np.float32) * 0.05
    if dtype == "BF16":
        return to_bits(torch.from_numpy(values).to(torch.bfloat16)).copy()
    if dtype == "F16":
        return values.astype(np.float16).view(np.uint16).copy()
    if dtype == "F32":
        return values.view(np.uint32).copy()
    if dtype == "F8_E4M3":
        return to_bits(torch.from_numpy(values * 100).to(torch.float8_e4m3fn)).copy()
    if dtype == "I64":
        return rng.integers(-1000, 1000, size=n, dtype=np.int64).view(np.uint64)
    if dtype == "U8":
        return rng.integers(0, 256, size=n, dtype=np.uint8)
    raise AssertionError(dtype)


def doc_block(tag: str) -> str:
    match = re.search(rf"<!-- format-doc:{re.escape(tag)} -->\n```text\n(.*?)```", FORMAT_MD.read_text(), re.S)
    assert match, f"FORMAT.md has no block {tag}"
    return match.group(1)


def hex_of_annotated(block: str) -> bytes:
    """The bytes of an annotated block: hex before each `#` comment."""
    return bytes.fromhex("".join(line.split("#", 1)[0] for line in block.splitlines()).replace(" ", ""))


# ---------------------------------------------------------------------------------------------
# round trips: the codec encodes, the independent reader decodes
# ---------------------------------------------------------------------------------------------

WIDTH_CASES = [
    ("BF16", 0.001),
    ("BF16", 0.01),
    ("BF16", 0.1),
    ("F8_E4M3", 0.01),
    ("U8", 0.1),
    ("F32", 0.01),
    ("F32", 0.1),
    ("I64", 0.01),
    ("I64", 0.1),
    ("F16", 0.01),
]


@pytest.mark.parametrize("how", ["ulp", "arbitrary"])
@pytest.mark.parametrize(("dtype", "fraction"), WIDTH_CASES)
def test_sparse_changes_every_width(dtype: str, fraction: float, how: str) -> None:
    rng = np.random.default_rng(hash((dtype, fraction, how)) & 0xFFFF)
    n = 60_000
    base_bits = random_bits(rng, dtype, n)
    base = {"w": tb(dtype, base_bits, (200, 300))}
    target = {"w": tb(dtype, change(rng, base_bits, fraction, how), (200, 300))}
    decode_and_compare(base, target)


@pytest.mark.parametrize("dtype", ["BF16", "F8_E4M3", "F32", "I64"])
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_dense_changes(dtype: str, fraction: float) -> None:
    rng = np.random.default_rng(int(fraction * 10) + WIDTH[dtype])
    base_bits = random_bits(rng, dtype, 20_000)
    tally: Counter = Counter()
    for how in ("ulp", "arbitrary"):
        target_bits = change(rng, base_bits, fraction, how)
        decode_and_compare({"w": tb(dtype, base_bits)}, {"w": tb(dtype, target_bits)}, tally=tally)
    assert tally[("mode", "dense")] >= 1


def special_patterns(dtype: str) -> np.ndarray:
    if dtype == "F32":
        return np.array(
            [
                0x7FC00000,
                0x7FC00001,
                0xFFFFFFFF,
                0x7F800001,
                0x7F800000,
                0xFF800000,
                0x00000000,
                0x80000000,
                0x00000001,
                0x80000001,
                0x3F800000,
                0xBF800000,
                0x7F7FFFFF,
                0xFF7FFFFF,
            ],
            dtype=np.uint32,
        )
    if dtype == "BF16":
        return np.array(
            [
                0x7FC0,
                0x7FC1,
                0xFFFF,
                0x7F81,
                0x7F80,
                0xFF80,
                0x0000,
                0x8000,
                0x0001,
                0x8001,
                0x3F80,
                0xBF80,
                0x7F7F,
                0xFF7F,
            ],
            dtype=np.uint16,
        )
    return np.array([0x7F, 0xFF, 0x00, 0x80, 0x01, 0x81, 0x7E, 0xFE, 0x38, 0xB8], dtype=np.uint8)  # F8_E4M3


@pytest.mark.parametrize("dtype", ["BF16", "F32", "F8_E4M3"])
def test_special_bit_patterns(dtype: str) -> None:
    """NaN payloads, ±Inf, ±0, subnormals and sign flips, in and out of each other: bits, never values."""
    rng = np.random.default_rng(7)
    special = special_patterns(dtype)
    pairs = np.array([(a, b) for a in special for b in special if a != b], dtype=special.dtype)
    filler = random_bits(rng, dtype, 4000)
    base_bits = np.concatenate([pairs[:, 0], filler, filler[:500]])
    sign = special.dtype.type(1 << (8 * special.itemsize - 1))
    target_bits = np.concatenate(
        [pairs[:, 1], filler ^ np.where(rng.random(4000) < 0.02, sign, 0).astype(filler.dtype), filler[:500]]
    )
    tally: Counter = Counter()
    decode_and_compare({"s": tb(dtype, base_bits)}, {"s": tb(dtype, target_bits)}, tally=tally)
    # then ±1-ULP nudges and arbitrary rewrites of the special patterns themselves (the ULP
    # transform must cross ±0, NaN and Inf boundaries by bits, wrapping mod 2^n)
    for how in ("ulp", "arbitrary"):
        decode_and_compare(
            {"s": tb(dtype, base_bits)}, {"s": tb(dtype, change(rng, base_bits, 0.05, how))}, tally=tally
        )


def test_many_small_tensors_share_one_chunk() -> None:
    rng = np.random.default_rng(3)
    base, target = {}, {}
    for i in range(60):
        dtype = ["BF16", "F32", "F8_E4M3"][i % 3]
        shape = [(int(rng.integers(1, 40)),), (3, int(rng.integers(1, 9))), ()][i % 3] if i != 7 else (0,)
        n = int(np.prod(shape))
        bits = random_bits(rng, dtype, n)
        base[f"layer.{i:02d}.norm"] = tb(dtype, bits, shape)
        new = change(rng, bits, 0.2, "ulp") if n and i % 4 else bits.copy()
        target[f"layer.{i:02d}.norm"] = tb(dtype, new, shape)
    tally: Counter = Counter()
    decode_and_compare(base, target, tally=tally)


def test_large_tensor_cut_into_chunks() -> None:
    rng = np.random.default_rng(11)
    n = 50_000
    base_bits = random_bits(rng, "BF16", n)
    target_bits = base_bits.copy()
    target_bits[:5000] = change(rng, base_bits[:5000], 0.5, "ulp")  # a dense-ish chunk
    target_bits[20000:30000] = change(rng, base_bits[20000:30000], 0.01, "ulp")  # sparse chunks
    target_bits[-1] ^= 0x8000  # the last, short chunk
    base = {"big": tb("BF16", base_bits, (250, 200)), "small": tb("F32", random_bits(rng, "F32", 10))}
    target = {"big": tb("BF16", target_bits, (250, 200)), "small": tb("F32", base["small"].bits.copy())}
    blob = encode_patch(base, target, chunk_elements=4096)
    header, _ = read_patch(blob)
    big = next(g for g in header.groups if g.tensors[0].name == "big")
    assert len(big.chunks) == -(-n // 4096) and sum(c.changed == 0 for c in big.chunks) >= 3
    decode_and_compare(base, target, chunk_elements=4096)


def test_new_tensors_without_base() -> None:
    rng = np.random.default_rng(5)
    kept = random_bits(rng, "BF16", 3000)
    old_shape = random_bits(rng, "F32", 100)
    target = {
        "kept": tb("BF16", change(rng, kept, 0.01, "ulp")),
        "reshaped": tb("F32", np.concatenate([old_shape, old_shape]), (2, 100)),
        "retyped": tb("BF16", kept[:100].copy()),
        "fresh": tb("I64", random_bits(rng, "I64", 777)),
        "fresh.scalar": tb("F32", np.array([0x3F800000], dtype=np.uint32), ()),
        "fresh.empty": tb("BF16", np.zeros(0, dtype=np.uint16), (0, 4)),
        "fresh.zeros": tb("F8_E4M3", np.zeros(300, dtype=np.uint8)),  # no bit differs from "no base"
    }
    base = {"kept": tb("BF16", kept), "reshaped": tb("F32", old_shape), "retyped": tb("F32", old_shape)}
    patched = decode_and_compare(base, target)
    assert patched["reshaped"].shape == (2, 100) and patched["retyped"].dtype == "BF16"
    # no base at all: the first version of a chain, every group against zero bits
    decode_and_compare(None, target, chunk_elements=500)


def adam_like_versions(steps: int) -> list[dict[str, TensorBits]]:
    """bf16 views of fp32 masters moved by Adam-sized steps: ±lr with lr = 1e-5 on weights of scale
    0.02, and ±1e-6 relative nudges on norms near 1 (most of which do not move a bf16 bit)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(384, 512, generator=gen) * 0.02
    norm = 1 + torch.randn(512, generator=gen) * 0.01
    versions = []
    for _ in range(steps):
        versions.append(
            {
                name: tb("BF16", to_bits(t.to(torch.bfloat16)).copy(), tuple(t.shape))
                for name, t in (("proj.weight", weight), ("norm.weight", norm))
            }
        )
        weight -= 1e-5 * torch.sign(torch.randn(weight.shape, generator=gen))
        norm *= 1 + 1e-6 * torch.sign(torch.randn(norm.shape, generator=gen))
    return versions


def test_adam_like_chain_applied_version_after_version() -> None:
    versions = adam_like_versions(4)
    shard = as_shard(versions[0])
    for n in range(1, len(versions)):
        edge = Edge("bf16", n - 1, n)
        blob = encode(versions[n - 1], versions[n], view="bf16", base_version=n - 1, target_version=n)
        shard = apply_patch(blob, shard, edge=edge, target_digests=digests(versions[n]))
        for name, want in versions[n].items():
            assert np.array_equal(shard[name].bits, want.bits), (n, name)
    changed = np.count_nonzero(versions[0]["proj.weight"].bits != versions[1]["proj.weight"].bits)
    assert 0 < changed < versions[0]["proj.weight"].bits.size // 2


def test_every_mode_transform_and_codec_is_exercised() -> None:
    """The round trips above are only evidence if they reach every branch of the reader."""
    rng = np.random.default_rng(99)
    tally: Counter = Counter()
    base_bits = random_bits(rng, "BF16", 40_000)
    target_bits = base_bits.copy()
    target_bits[:8000] = change(rng, base_bits[:8000], 0.6, "arbitrary")  # dense, zstd-worthy
    target_bits[8000:16000] = change(rng, base_bits[8000:16000], 0.05, "ulp")  # sparse, ulp, rANS
    target_bits[16000:24000] ^= np.where(rng.random(8000) < 0.03, 0x8000, 0).astype(np.uint16)  # xor
    target_bits[24000:32000] = change(rng, base_bits[24000:32000], 0.02, "arbitrary")  # raw
    decode_and_compare({"w": tb("BF16", base_bits)}, {"w": tb("BF16", target_bits)}, chunk_elements=8000, tally=tally)
    # a new tensor of repeated rows: LZ matches are where zstd beats order-0 rANS
    repeated = np.tile(random_bits(rng, "BF16", 500), 40)
    decode_and_compare(None, {"w": tb("BF16", target_bits), "repeated": tb("BF16", repeated)}, tally=tally)
    for key in [
        ("mode", "sparse"),
        ("mode", "dense"),
        ("transform", "xor"),
        ("transform", "ulp"),
        ("transform", "raw"),
        ("codec", "stored"),
        ("codec", "constant"),
        ("codec", "rans"),
        ("codec", "zstd"),
    ]:
        assert tally[key] > 0, f"no {key} in {dict(tally)}"


# ---------------------------------------------------------------------------------------------
# the page's own examples
# ---------------------------------------------------------------------------------------------


def page_example() -> tuple[bytes, dict[str, Tensor], dict[str, np.ndarray]]:
    """The blob, base and target of FORMAT.md 8.10, all read from the page."""
    blob = bytes.fromhex("".join(line[10:58] for line in doc_block("patch-example-hex").splitlines()))
    base, target, current = {}, {}, None
    for line in doc_block("patch-example-inputs").splitlines()[1:]:
        words = line.split()
        if not line.startswith(" "):
            current = words[0]
            shape = tuple(int(d) for d in re.search(r"\[(.*)\]", line).group(1).split(","))
            base[current], target[current] = (words[1], shape, []), []
            mode = None
            continue
        if words[0] in ("base", "target"):
            mode, words = words[0], words[1:]
        (base[current][2] if mode == "base" else target[current]).extend(int(w, 16) for w in words)
    shard = {n: Tensor(d, s, np.array(bits, dtype=np.uint16)) for n, (d, s, bits) in base.items()}
    return blob, shard, {n: np.array(bits, dtype=np.uint16) for n, bits in target.items()}


def test_page_worked_example_decodes_to_its_target() -> None:
    blob, shard, target = page_example()
    assert len(blob) == 549
    tally: Counter = Counter()
    patched = apply_patch(blob, shard, edge=Edge("bf16", 6, 7), tally=tally)
    for name, bits in target.items():
        assert np.array_equal(patched[name].bits, bits), name
    assert tally[("mode", "sparse")] == 2 and tally[("mode", "dense")] == 1
    assert {k for k in tally if k[0] == "transform"} == {("transform", t) for t in ("xor", "ulp", "raw")}


def test_page_rans_stream_decodes_as_annotated() -> None:
    stream = hex_of_annotated(doc_block("rans-example-stream"))
    symbols, end = read_stream(memoryview(stream), 0, 256)
    assert end == len(stream) and len(stream) == 9 + 105
    assert list(symbols) == [2, 2, 1, 2, 4, 2, 1, 2, 2, 3] * 25 + [2, 2, 1, 2, 4, 2]


def test_page_rans_stream_forgeries_are_refused() -> None:
    body = bytearray(hex_of_annotated(doc_block("rans-example-stream"))[9:])
    assert decode_rans(memoryview(bytes(body)), 256)

    def forged(edit: Callable[[bytearray], None]) -> bytes:
        copy = bytearray(body)
        edit(copy)
        return bytes(copy)

    cases = {
        "sum to": lambda b: b.__setitem__(33, 0x1A),  # freq[1] 3264 -> 3328: the table sums past M
        "initial state": lambda b: b.__setitem__(slice(40, 44), (1).to_bytes(4, "little")),  # x0 < L
        "longer than 3": lambda b: b.__setitem__(slice(32, 34), b"\xc0\x99"),  # a 4th LEB128 byte follows
        "left unread": lambda b: b.append(0),
        "ran out|final state": lambda b: b.pop(),
        "final state|ran out|left unread": lambda b: b.__setitem__(60, b[60] ^ 0x40),
        "frequency 0 of symbol 1": lambda b: b.__setitem__(slice(32, 34), b"\x80\x00"),
    }
    for rule, edit in cases.items():
        with pytest.raises(PatchRefused, match=rule):
            decode_rans(memoryview(forged(edit)), 256)
    with pytest.raises(PatchRefused, match="bitmap"):
        decode_rans(memoryview(bytes(body[:31])), 256)


# ---------------------------------------------------------------------------------------------
# hostile patches
# ---------------------------------------------------------------------------------------------


def split(blob: bytes) -> tuple[dict, bytes]:
    """The header as a generic msgpack value, and the payload."""
    h = int.from_bytes(blob[10:14], "little")
    return msgspec.msgpack.decode(zstandard.ZstdDecompressor().decompress(blob[14 : 14 + h])), blob[14 + h :]


def join(header: object, payload: bytes, *, version: int = 2, frame_tail: bytes = b"") -> bytes:
    frame = (
        zstandard.ZstdCompressor(level=9, write_checksum=True, write_content_size=True).compress(
            msgspec.msgpack.encode(header)
        )
        + frame_tail
    )
    return b"SPRWLPCH" + version.to_bytes(2, "little") + len(frame).to_bytes(4, "little") + frame + payload


def test_reassembled_example_is_accepted() -> None:
    """The forging helpers themselves produce an acceptable patch when they change nothing."""
    blob, shard, target = page_example()
    header, payload = split(blob)
    patched = apply_patch(join(header, payload), shard, edge=Edge("bf16", 6, 7))
    assert all(np.array_equal(patched[n].bits, b) for n, b in target.items())


def refused(blob: bytes, rule: str, **kwargs) -> None:
    """The example's base refuses `blob` for `rule` and is left exactly as it was."""
    _, shard, _ = page_example()
    before = {n: t.bits.copy() for n, t in shard.items()}
    with pytest.raises(PatchRefused, match=rule):
        apply_patch(blob, shard, edge=kwargs.pop("edge", Edge("bf16", 6, 7)), **kwargs)
    assert all(np.array_equal(shard[n].bits, b) for n, b in before.items()), "a refused patch wrote bits"


def test_truncated_patches_are_refused() -> None:
    blob, _, _ = page_example()
    for cut in [0, 5, 8, 13, 14, 40, 14 + 372 - 1, 14 + 372, 14 + 372 + 1, 450, len(blob) - 1]:
        refused(blob[:cut], r"8\.[2-9]")
    refused(blob + b"\x00", "payload_bytes")


def test_every_flipped_byte_is_refused_or_harmless() -> None:
    """A corrupted byte anywhere ends in a refusal; never in wrong bits."""
    blob, _, target = page_example()
    outcomes = Counter()
    for i in range(len(blob)):
        for flip in (0x01, 0x80):
            bad = bytearray(blob)
            bad[i] ^= flip
            _, shard, _ = page_example()
            before = {n: t.bits.copy() for n, t in shard.items()}
            try:
                patched = apply_patch(bytes(bad), shard, edge=Edge("bf16", 6, 7))
            except PatchRefused:
                outcomes["refused"] += 1
                assert all(np.array_equal(shard[n].bits, b) for n, b in before.items()), i
                continue
            outcomes["accepted"] += 1
            assert all(np.array_equal(patched[n].bits, b) for n, b in target.items()), f"byte {i} ^ {flip}"
    assert outcomes["refused"] >= 2 * len(blob) - 4, outcomes  # only the zstd frame's unused bits may be free


def test_wrong_versions_and_edges_are_refused() -> None:
    blob, _, _ = page_example()
    header, payload = split(blob)
    refused(blob[:8] + b"\x03\x00" + blob[10:], "format version 3")
    refused(b"SPRWLPCX" + blob[8:], "magic")
    refused(join({**header, "format_version": 3}, payload), "format_version is not 2")
    refused(blob, "the edge is", edge=Edge("bf16", 5, 7))
    refused(blob, "the edge is", edge=Edge("fp8_e4m3", 6, 7))
    refused(blob, "SHA-256", sha256="0" * 64)


def test_a_base_that_is_not_the_patch_base_is_refused() -> None:
    blob, shard, _ = page_example()
    shard["proj.weight"].bits[0] ^= 1  # an element the patch does not even touch
    before = shard["norm.bias"].bits.copy()
    with pytest.raises(PatchRefused, match="base_checksum"):
        apply_patch(blob, shard, edge=Edge("bf16", 6, 7))
    assert np.array_equal(shard["norm.bias"].bits, before)
    _, shard, _ = page_example()
    del shard["norm.weight"]
    with pytest.raises(PatchRefused, match="not in the shard"):
        apply_patch(blob, shard)
    _, shard, _ = page_example()
    shard["norm.weight"] = Tensor("F16", (12,), shard["norm.weight"].bits)
    with pytest.raises(PatchRefused, match=re.escape("the base 'norm.weight' is not BF16")):
        apply_patch(blob, shard)


def test_target_digests_from_the_event_must_agree() -> None:
    blob, _, target = page_example()
    good = {
        n: ("BF16", s, xxhash.xxh3_128_hexdigest(target[n].tobytes()))
        for n, s in (("norm.bias", (4,)), ("norm.weight", (12,)), ("proj.weight", (5, 8)))
    }
    _, shard, _ = page_example()
    apply_patch(blob, shard, target_digests=good)
    refused(
        blob, "not a tensor of the target shard", target_digests={k: v for k, v in good.items() if k != "norm.bias"}
    )
    refused(blob, "not BF16", target_digests={**good, "norm.bias": ("F16", (4,), good["norm.bias"][2])})
    refused(blob, "not the target's digest", target_digests={**good, "norm.bias": ("BF16", (4,), "0" * 32)})


def forge_header(edit: Callable[[dict], None]) -> bytes:
    blob, _, _ = page_example()
    header, payload = split(blob)
    edit(header)
    return join(header, payload)


def g(i: int) -> Callable[[dict], dict]:
    return lambda h: h["groups"][i]


HEADER_FORGERIES: dict[str, tuple[str, Callable[[dict], None]]] = {
    "missing key": ("lacks", lambda h: h.pop("view")),
    "missing tensor key": ("lacks", lambda h: h["groups"][0]["tensors"][0].pop("changed")),
    "float for int": ("must be a msgpack int", lambda h: h.__setitem__("target_version", 7.0)),
    "bool for int": ("must be a msgpack int", lambda h: h["groups"][0].__setitem__("elements", True)),
    "nil for int": ("must be a msgpack int", lambda h: h["groups"][1]["tensors"][0].__setitem__("offset", None)),
    "str for bin": (
        "must be msgpack bin",
        lambda h: h["groups"][0]["tensors"][1].__setitem__("target_checksum", "x" * 16),
    ),
    "int for bool": ("must be a msgpack bool", lambda h: h["groups"][0].__setitem__("has_base", 1)),
    "short ChunkEntry": ("has 4 items", lambda h: h["groups"][1]["chunks"][0].pop()),
    "map for array": ("not a msgpack map", lambda h: h["groups"].__setitem__(0, [1, 2])),
    "unknown key": ("unknown keys", lambda h: h.__setitem__("extra", 1)),
    "unknown dtype": ("unknown dtype", lambda h: h["groups"][0].__setitem__("dtype", "BF17")),
    "group without tensors": ("has no tensors", lambda h: h["groups"][0].__setitem__("tensors", [])),
    "negative dimension": ("negative dimension", lambda h: h["groups"][1]["tensors"][0].__setitem__("shape", [-5, -8])),
    "gap between tensors": ("starts at 5", lambda h: h["groups"][0]["tensors"][1].__setitem__("offset", 5)),
    "elements off": ("add up to 16 elements, not 17", lambda h: h["groups"][0].__setitem__("elements", 17)),
    "two chunks for two tensors": (
        "not exactly one whole chunk",
        lambda h: h["groups"][0].__setitem__("chunks", [[0, 8, 1, 0, 64], [8, 8, 0, 64, 0]]),
    ),
    "chunks overlap": ("do not tile", lambda h: h["groups"][1]["chunks"][1].__setitem__(0, 15)),
    "chunk past 2^30": ("do not tile", lambda h: h["groups"][1]["chunks"][2].__setitem__(1, (1 << 30) + 1)),
    "changed 0 with a record": ("changed 0 and size", lambda h: h["groups"][1]["chunks"][1].__setitem__(2, 0)),
    "changed past length": ("changed 17 of 16", lambda h: h["groups"][1]["chunks"][1].__setitem__(2, 17)),
    "record of 1 byte": ("record of 1 bytes", lambda h: h["groups"][1]["chunks"][2].__setitem__(4, 1)),
    "record outside payload": ("outside the payload", lambda h: h["groups"][1]["chunks"][2].__setitem__(4, 63)),
    "records overlap": ("not where the previous one ended", lambda h: h["groups"][1]["chunks"][1].__setitem__(3, 60)),
    "payload_bytes off": ("payload_bytes 164", lambda h: h.__setitem__("payload_bytes", 164)),
    "duplicate tensor": ("appears twice", lambda h: h["groups"][1]["tensors"][0].__setitem__("name", "norm.bias")),
    "short checksum": ("wrong length", lambda h: h["groups"][0]["tensors"][0].__setitem__("base_checksum", b"\0" * 8)),
    "changed 0 but checksums differ": (
        "changes nothing",
        lambda h: h["groups"][0]["tensors"][0].__setitem__("changed", 0),
    ),
    "checksum forged": (
        "target_checksum after the patch",
        lambda h: h["groups"][0]["tensors"][0].__setitem__("target_checksum", b"\1" * 16),
    ),
}


@pytest.mark.parametrize("case", sorted(HEADER_FORGERIES))
def test_forged_headers_are_refused(case: str) -> None:
    rule, edit = HEADER_FORGERIES[case]
    refused(forge_header(edit), re.escape(rule))


def test_header_frame_must_be_exactly_one_frame() -> None:
    blob, _, _ = page_example()
    header, payload = split(blob)
    refused(join(header, payload, frame_tail=b"\x00"), "not exactly one zstd frame")
    refused(join(header, payload, frame_tail=zstandard.ZstdCompressor().compress(b"x")), "not exactly one zstd frame")
    h = int.from_bytes(blob[10:14], "little")
    refused(blob[: 14 + h - 4] + bytes([blob[14 + h - 4] ^ 1]) + blob[14 + h - 3 :], "does not decompress")  # XXH64
    refused(blob[:14] + b"\x00" + blob[15:], "not a zstd frame")
    not_msgpack = zstandard.ZstdCompressor().compress(b"\x86\xc1")
    refused(
        b"SPRWLPCH\x02\x00" + len(not_msgpack).to_bytes(4, "little") + not_msgpack + payload, "not one msgpack value"
    )


# Payload bytes of the example's records (FORMAT.md 8.10): record 0 at 0..63, 1 at 64..100, 2 at 101..162
PAYLOAD_FORGERIES: dict[str, tuple[str, int, int]] = {
    "unknown mode": ("unknown mode 3", 0, 3),
    "unknown transform": ("unknown transform 3", 1, 3),
    "unknown codec": ("unknown stream codec 7", 2, 7),
    "raw_len not the count": ("holds 4 symbols, the record needs 3", 3, 4),
    "stored coded_len off": ("stored stream whose coded_len", 7, 2),
    "constant coded_len off": ("constant stream whose coded_len", 19, 2),
    "body past the record": ("runs past the record", 64 + 7, 0x7F),
    "position past the chunk": ("a change at position 24 of a chunk of 16", 13, 0x10),
    "gap that would wrap in 32 bits": ("a change at position", 13 + 3 * 10, 0xFF),
    "dense stream count off": ("holds 17 symbols, the record needs 16", 64 + 3, 17),
}


@pytest.mark.parametrize("case", sorted(PAYLOAD_FORGERIES))
def test_forged_records_are_refused(case: str) -> None:
    rule, at, value = PAYLOAD_FORGERIES[case]
    blob, _, _ = page_example()
    bad = bytearray(blob)
    bad[len(blob) - 163 + at] = value
    refused(bytes(bad), re.escape(rule) if "|" not in rule else rule)


def test_bytes_after_a_record_are_refused() -> None:
    blob, _, _ = page_example()
    header, payload = split(blob)
    header["payload_bytes"] += 1
    chunk0 = header["groups"][0]["chunks"][0]
    chunk0[4] += 1
    for chunk in header["groups"][1]["chunks"]:
        chunk[3] += 1
    refused(join(header, payload[:64] + b"\x00" + payload[64:]), "bytes left after the record's last stream")


def test_a_wrong_value_is_caught_by_the_checksum_and_undone() -> None:
    """A well-formed record with one wrong value: written, hashed, refused, and put back."""
    blob, _, _ = page_example()
    bad = bytearray(blob)
    bad[len(blob) - 163 + 53] = 0x04  # record 0's value plane 0 constant 02 -> 04: two ULPs
    refused(bytes(bad), "target_checksum after the patch")


def test_codec_stream_forgeries_in_an_encoded_patch() -> None:
    """rANS and zstd streams inside a real patch: a flipped byte in either is refused."""
    rng = np.random.default_rng(1)
    base_bits = random_bits(rng, "BF16", 16_000)
    target_bits = base_bits.copy()
    target_bits[8000:] = change(rng, base_bits[8000:], 0.05, "ulp")
    base = {"w": tb("BF16", base_bits)}
    target = {"w": tb("BF16", target_bits), "repeated": tb("BF16", np.tile(random_bits(rng, "BF16", 300), 20))}
    blob = encode_patch(base, target, chunk_elements=4000)
    header, payload = read_patch(blob)
    offset = len(blob) - len(payload)
    streams = []  # (codec, absolute offset of the body, coded_len)
    for chunk in (c for group in header.groups for c in group.chunks):
        if chunk.changed:
            record = bytes(payload[chunk.offset : chunk.offset + chunk.size])
            pos = 2
            while pos < len(record):
                codec, coded = record[pos], int.from_bytes(record[pos + 5 : pos + 9], "little")
                streams.append((codec, offset + chunk.offset + pos + 9, coded))
                pos += 9 + coded
    assert {2, 3} <= {c for c, _, _ in streams}, streams
    for codec in (2, 3):
        for _, at, coded in [s for s in streams if s[0] == codec][:3]:
            for i in sorted(i for i in {0, 20, 33, 40, coded // 2, coded - 1} if i < coded):
                bad = bytearray(blob)
                bad[at + i] ^= 0x10
                shard = as_shard(base)
                with pytest.raises(PatchRefused):
                    apply_patch(bytes(bad), shard, target_digests=digests(target))
                assert np.array_equal(shard["w"].bits, base_bits)
