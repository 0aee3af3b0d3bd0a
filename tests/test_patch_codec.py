"""The codec round-trips bits exactly, whatever the dtype, shape, density or bit pattern."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import patch_codec
from pipeline.bits import bits_dtype, dtype_name, from_bits, to_bits
from pipeline.patch_codec import ChecksumMismatch, PatchFormatError, TensorBits

DTYPES = ["BF16", "F16", "F32", "F8_E4M3", "F8_E5M2", "I64", "U8"]
SHAPES = [(0,), (1,), (7,), (1000,), (3, 5, 7), (64, 33), (2, 0, 3)]
DENSITIES = [0.0, 1e-4, 0.01, 0.5, 1.0]
SPECIAL_16 = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFFF, 0x0001, 0x8001, 0x7F7F]


def _random_bits(rng: np.random.Generator, dtype: str, n: int) -> np.ndarray:
    info = np.iinfo(bits_dtype(dtype))
    return rng.integers(0, int(info.max), size=n, dtype=bits_dtype(dtype), endpoint=True)


def _mutate(rng: np.random.Generator, bits: np.ndarray, density: float, special: bool) -> np.ndarray:
    out = bits.copy()
    n = len(out)
    k = round(n * density) if density < 1 else n
    if n == 0 or k == 0:
        return out
    idx = rng.choice(n, size=k, replace=False)
    if special and bits.dtype == np.uint16:
        out[idx] = rng.choice(np.array(SPECIAL_16, dtype=np.uint16), size=k)
    else:
        # mostly ±1 ULP-like nudges, some arbitrary rewrites
        one = np.ones(k, dtype=out.dtype)
        up = rng.random(k) < 0.5
        out[idx] = np.where(up, out[idx] + one, out[idx] - one)  # unsigned arithmetic wraps, like carries
        wild = idx[rng.random(k) < 0.1]
        out[wild] = _random_bits(rng, _name_of(out.dtype), len(wild))
    return out


def _name_of(dtype: np.dtype) -> str:
    return {1: "U8", 2: "BF16", 4: "F32", 8: "I64"}[dtype.itemsize]


def _round_trip(base: dict, target: dict, chunk_elements: int = 1 << 22) -> dict:
    patch = patch_codec.encode(base, target, view="t", base_version=1, target_version=2, chunk_elements=chunk_elements)
    header, _ = patch_codec.read_header(patch)
    assert (header.view, header.base_version, header.target_version) == ("t", 1, 2)
    out = patch_codec.apply(patch, base)
    assert set(out) == set(target)
    for name, tb in target.items():
        assert out[name].dtype == tb.dtype and tuple(out[name].shape) == tuple(tb.shape)
        assert np.array_equal(out[name].bits, tb.bits), name
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.sampled_from(SHAPES),
    density=st.sampled_from(DENSITIES),
    special=st.booleans(),
    chunk=st.sampled_from([7, 64, 1 << 22]),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip_is_bit_exact(dtype, shape, density, special, chunk, seed):
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    base_bits = _random_bits(rng, dtype, n)
    target_bits = _mutate(rng, base_bits, density, special)
    base = {"w": TensorBits(dtype, shape, base_bits)}
    target = {"w": TensorBits(dtype, shape, target_bits)}
    _round_trip(base, target, chunk_elements=chunk)


def test_special_float_values_survive_through_torch():
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-40, 3.0])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        base = torch.zeros(8, dtype=dtype)
        target = specials.to(dtype)
        raw = target.view(torch.int16 if dtype != torch.float32 else torch.int32)
        raw[4] = raw[4] | 0x3  # a NaN with a non-canonical payload
        name = dtype_name(dtype)
        out = patch_codec.apply(
            patch_codec.encode(
                {"x": TensorBits(name, (8,), to_bits(base))}, {"x": TensorBits(name, (8,), to_bits(target))}
            ),
            {"x": TensorBits(name, (8,), to_bits(base))},
        )
        back = from_bits(out["x"].bits, name, (8,))
        assert torch.equal(back.view(raw.dtype), target.view(raw.dtype))


def test_multiple_tensors_new_tensors_and_changed_shapes():
    rng = np.random.default_rng(1)
    a = _random_bits(rng, "BF16", 5000)
    base = {
        "a": TensorBits("BF16", (5000,), a),
        "gone": TensorBits("F32", (3,), _random_bits(rng, "F32", 3)),
        "reshaped": TensorBits("BF16", (10,), _random_bits(rng, "BF16", 10)),
    }
    target = {
        "a": TensorBits("BF16", (5000,), _mutate(rng, a, 0.01, False)),
        "new": TensorBits("F8_E4M3", (4, 4), _random_bits(rng, "U8", 16)),
        "reshaped": TensorBits("BF16", (2, 6), _random_bits(rng, "BF16", 12)),
    }
    _round_trip(base, target)
    _round_trip(None, target)


def test_sparse_patch_is_much_smaller_than_the_tensor():
    rng = np.random.default_rng(2)
    base = torch.randn(1_000_000).to(torch.bfloat16)
    bits = to_bits(base)
    target = _mutate(rng, bits, 0.01, False)
    patch = patch_codec.encode(
        {"w": TensorBits("BF16", (len(bits),), bits)}, {"w": TensorBits("BF16", (len(bits),), target)}
    )
    assert len(patch) < 0.05 * bits.nbytes


def test_wrong_base_is_refused():
    rng = np.random.default_rng(3)
    a = _random_bits(rng, "BF16", 100)
    b = _mutate(rng, a, 0.1, False)
    patch = patch_codec.encode({"w": TensorBits("BF16", (100,), a)}, {"w": TensorBits("BF16", (100,), b)})
    other = a.copy()
    other[0] ^= 1
    with pytest.raises(ChecksumMismatch, match="base checksum"):
        patch_codec.apply(patch, {"w": TensorBits("BF16", (100,), other)})


@pytest.mark.parametrize("damage", ["magic", "version", "truncate", "flip_payload", "header"])
def test_damaged_patches_are_refused(damage):
    rng = np.random.default_rng(4)
    a = _random_bits(rng, "BF16", 10_000)
    b = _mutate(rng, a, 0.05, False)
    base = {"w": TensorBits("BF16", (10_000,), a)}
    patch = bytearray(patch_codec.encode(base, {"w": TensorBits("BF16", (10_000,), b)}))
    if damage == "magic":
        patch[0] ^= 0xFF
    elif damage == "version":
        patch[8] = 99
    elif damage == "truncate":
        patch = patch[:-10]
    elif damage == "flip_payload":
        patch[-1] ^= 0x55
    else:
        patch[20] ^= 0xFF
    with pytest.raises(PatchFormatError):
        patch_codec.apply(bytes(patch), base)


def test_inplace_apply_overwrites_the_callers_buffer():
    rng = np.random.default_rng(5)
    a = _random_bits(rng, "F32", 4096)
    b = _mutate(rng, a, 0.02, False)
    patch = patch_codec.encode({"w": TensorBits("F32", (4096,), a)}, {"w": TensorBits("F32", (4096,), b)})
    buffer = a.copy()
    out = patch_codec.apply(patch, {"w": TensorBits("F32", (4096,), buffer)}, inplace=True)
    assert out["w"].bits is not None and np.shares_memory(out["w"].bits, buffer)
    assert np.array_equal(buffer, b)


def test_encoding_is_deterministic():
    rng = np.random.default_rng(6)
    a = _random_bits(rng, "BF16", 300_000)
    b = _mutate(rng, a, 0.01, False)
    args = ({"w": TensorBits("BF16", (300_000,), a)}, {"w": TensorBits("BF16", (300_000,), b)})
    assert patch_codec.encode(*args, chunk_elements=1 << 16) == patch_codec.encode(*args, chunk_elements=1 << 16)
