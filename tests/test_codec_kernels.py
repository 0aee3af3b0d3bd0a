"""The codec's compiled pieces on their own: ULP transforms and the rANS coder, including hostile streams."""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.codec import kernels, rans

WIDTHS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _edge_patterns(width: int) -> np.ndarray:
    """Bit patterns where float order is easy to get wrong: both zeros, the smallest and largest
    magnitudes of each sign, infinities and NaNs (with payloads) of the IEEE-style layouts of this
    width, all ones, and their neighbours."""
    bits = 8 * width
    sign = 1 << (bits - 1)
    top = (1 << bits) - 1
    exponent_bits = {1: 4, 2: 8, 4: 8, 8: 11}[width]  # e4m3, bf16, f32, f64
    mantissa = bits - 1 - exponent_bits
    inf = ((1 << exponent_bits) - 1) << mantissa
    base = [0, 1, 2, sign, sign | 1, sign | 2, sign - 1, sign - 2, top, top - 1, inf, inf - 1, inf | 1, inf | 3]
    base += [inf | sign, (inf | sign) - 1, inf | (1 << (mantissa - 1)), inf | sign | (1 << (mantissa - 1)) | 5]
    values = {v & top for v in base} | {(v + d) & top for v in base for d in (-1, 1)}
    return np.array(sorted(values), dtype=WIDTHS[width])


def _round_trip(old: np.ndarray, new: np.ndarray, kind: int) -> np.ndarray:
    width = old.dtype.itemsize
    planes = np.empty((width, len(old)), dtype=np.uint8)
    hist = np.zeros((width, 256), dtype=np.int64)
    kernels.value_planes(old, new, kind, width, planes, 0, hist)
    segment = old.copy()
    positions = np.arange(len(old), dtype=np.uint32)
    assert kernels.scatter(segment, positions, 0, len(old), 0, planes, kind, width) == 0
    return segment


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", [kernels.XOR, kernels.ULP, kernels.RAW])
def test_every_pair_of_edge_patterns_round_trips(width, kind):
    patterns = _edge_patterns(width)
    pairs = np.array(list(itertools.product(patterns, repeat=2)), dtype=patterns.dtype)
    old, new = np.ascontiguousarray(pairs[:, 0]), np.ascontiguousarray(pairs[:, 1])
    assert np.array_equal(_round_trip(old, new, kind), new)


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_ulp_distance_is_small_for_neighbouring_floats(width):
    """Adjacent floats are adjacent integers: across zero (+0 and -0 are neighbours), within each
    sign, and the whole range wraps around (the largest NaN pattern of each sign and the zeros)."""
    bits = 8 * width
    sign, top = 1 << (bits - 1), (1 << bits) - 1
    dtype = WIDTHS[width]
    neighbours = [(0, sign), (sign, 0), (1, 2), (sign | 1, sign | 2), (sign | 1, sign), (sign - 1, top)]
    old = np.array([a for a, _ in neighbours], dtype=dtype)
    new = np.array([b for _, b in neighbours], dtype=dtype)
    planes = np.empty((width, len(old)), dtype=np.uint8)
    kernels.value_planes(old, new, kernels.ULP, width, planes, 0, np.zeros((width, 256), dtype=np.int64))
    values = sum(planes[p].astype(np.uint64) << np.uint64(8 * p) for p in range(width))
    # ord(+0) = 0 and ord(-0) = -1; a larger magnitude with the sign set is a smaller integer; the
    # largest positive pattern is followed, modulo 2**w, by the most negative. zigzag(+1) = 2, zigzag(-1) = 1.
    assert values.tolist() == [1, 2, 2, 1, 2, 2]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(width=st.sampled_from([1, 2, 4, 8]), seed=st.integers(0, 2**31 - 1), n=st.integers(1, 300))
def test_ulp_round_trips_arbitrary_patterns(width, seed, n):
    rng = np.random.default_rng(seed)
    dtype = WIDTHS[width]
    info = np.iinfo(dtype)
    old = rng.integers(0, int(info.max), size=n, dtype=dtype, endpoint=True)
    new = rng.integers(0, int(info.max), size=n, dtype=dtype, endpoint=True)
    assert np.array_equal(_round_trip(old, new, kernels.ULP), new)


def _rans_round_trip(symbols: np.ndarray) -> bytes:
    hist = rans.histogram(symbols)
    freqs = rans.normalize(hist)
    assert freqs.sum() == rans.M and ((freqs > 0) == (hist > 0)).all()
    out = np.empty(len(symbols) + 4096, dtype=np.uint8)
    size = rans.encode(symbols, freqs, out)
    assert size > 0
    decoded = np.empty(len(symbols), dtype=np.uint8)
    assert rans.decode(out, 0, size, decoded, np.empty(rans.M, dtype=np.uint64)) == 0
    assert np.array_equal(decoded, symbols)
    return out[:size].tobytes()


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 9, 1000, 100_003])
@pytest.mark.parametrize("alphabet", ["one", "two", "skewed", "all"])
def test_rans_round_trips(n, alphabet):
    rng = np.random.default_rng(n)
    if alphabet == "one":
        symbols = np.full(n, 7, dtype=np.uint8)
    elif alphabet == "two":
        symbols = rng.integers(0, 2, size=n).astype(np.uint8)
    elif alphabet == "skewed":
        symbols = np.minimum(rng.geometric(0.6, size=n) - 1, 255).astype(np.uint8)
    else:
        symbols = rng.integers(0, 256, size=n).astype(np.uint8)
    _rans_round_trip(symbols)


def test_rans_comes_close_to_the_order0_entropy():
    rng = np.random.default_rng(0)
    symbols = np.minimum(rng.geometric(0.3, size=200_000) - 1, 255).astype(np.uint8)
    hist = np.bincount(symbols, minlength=256)
    p = hist[hist > 0] / len(symbols)
    entropy_bytes = -(hist[hist > 0] * np.log2(p)).sum() / 8
    assert len(_rans_round_trip(symbols)) < entropy_bytes * 1.01 + 100


def _decode(stream: bytes, n: int) -> int:
    return rans.decode(
        np.frombuffer(stream, dtype=np.uint8),
        0,
        len(stream),
        np.empty(n, dtype=np.uint8),
        np.empty(rans.M, dtype=np.uint64),
    )


def test_hostile_rans_streams_are_refused_not_read_past():
    rng = np.random.default_rng(1)
    symbols = np.minimum(rng.geometric(0.2, size=5000) - 1, 255).astype(np.uint8)
    good = _rans_round_trip(symbols)
    assert _decode(good, len(symbols)) == 0
    for cut in (1, 2, 5, 17, len(good) - 1, len(good) - 40):
        assert _decode(good[:cut], len(symbols)) < 0, cut
    assert _decode(good + b"\x00", len(symbols)) < 0  # bytes left over
    assert _decode(good, len(symbols) + 1) < 0  # more symbols than were coded
    assert _decode(good, len(symbols) - 1) < 0  # fewer
    table_end = rans.table_bytes(rans.normalize(rans.histogram(symbols)))
    forged = bytearray(good)
    forged[table_end - 1] ^= 0x01  # a frequency off by one: they no longer sum to M
    assert _decode(bytes(forged), len(symbols)) < 0
    zero_state = bytearray(good)
    zero_state[table_end : table_end + 4] = b"\x00\x00\x00\x00"  # a state below L would never renormalise
    assert _decode(bytes(zero_state), len(symbols)) < 0
    # Random bodies after a valid table and states: decoding ends (checked or wrong), never reads past.
    head = good[: table_end + rans.STATES_BYTES]
    for seed in range(200):
        body = np.random.default_rng(seed).integers(0, 256, size=seed % 50, dtype=np.uint8).tobytes()
        _decode(head + body, len(symbols))


def test_every_kernel_releases_the_gil_and_is_cached():
    """Chunks run in parallel on a thread pool only if no kernel holds the GIL; cache=True keeps a
    fresh process from compiling them again."""
    from numba.core.registry import CPUDispatcher

    dispatchers = [fn for module in (kernels, rans) for fn in vars(module).values() if isinstance(fn, CPUDispatcher)]
    assert len(dispatchers) >= 15
    for fn in dispatchers:
        assert fn.targetoptions.get("nogil") is True, fn.__name__
        assert fn._cache.__class__.__name__ == "FunctionCache", fn.__name__


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [0, 5, 1001, 70_003])
@pytest.mark.parametrize("capacity", [8, 100, 10**6])
def test_diff_resumes_when_its_outputs_are_full(width, n, capacity):
    """Outputs smaller than the changes: the kernel stops where they are full and resumes there."""
    rng = np.random.default_rng(n + width)
    dtype = WIDTHS[width]
    base = rng.integers(0, 255, size=n).astype(dtype)
    target = base.copy()
    changed = np.sort(rng.choice(n, n // 3, replace=False)) if n else np.array([], dtype=np.int64)
    target[changed] ^= dtype(1 << (8 * width - 1))  # top bit: a change in every byte width
    per = 8 // width
    usable = n - n % per
    words = base[:usable].view(np.uint64), target[:usable].view(np.uint64)
    hits = np.empty(kernels.BATCH_WORDS, dtype=np.uint32)
    found_positions, found_old, found_new = [], [], []
    word, resumed = 0, 0
    while word >= 0:
        # Every element a word holds may be appended: outputs have room for at least one word.
        positions = np.empty(max(capacity, per), dtype=np.uint32)
        old, new = np.empty(len(positions), dtype=dtype), np.empty(len(positions), dtype=dtype)
        count, word = kernels.diff(base, target, *words, per, word, 7, positions, old, new, 0, hits)
        found_positions.append(positions[:count].copy())
        found_old.append(old[:count].copy())
        found_new.append(new[:count].copy())
        resumed += word >= 0
    assert np.array_equal(np.concatenate(found_positions), changed + 7)
    assert np.array_equal(np.concatenate(found_old), base[changed])
    assert np.array_equal(np.concatenate(found_new), target[changed])
    if capacity == 8 and len(changed) > 8:
        assert resumed > 0


def test_warm_compiles_every_width_without_error():
    from pipeline.codec.warm import warm

    warm()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_all_finite_agrees_with_torch_on_every_16_bit_pattern(dtype):
    """The engines refuse a version holding an inf or a NaN (any payload, either sign) with this check,
    which reads bits instead of converting: every one of the 65536 patterns, alone in a tensor of finite
    values, is judged as torch.isfinite judges it."""
    from pipeline.bits import all_finite

    patterns = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    finite = torch.isfinite(patterns)
    filler = torch.ones(64, dtype=dtype)
    for i in torch.nonzero(~finite).flatten().tolist() + torch.nonzero(finite).flatten()[::97].tolist():
        tensor = filler.clone()
        tensor[17] = patterns[i]
        assert all_finite(tensor) == bool(finite[i]), hex(i)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_all_finite_finds_an_inf_or_nan_anywhere_in_wide_and_strided_tensors(dtype):
    from pipeline.bits import all_finite

    values = torch.randn(300, 7, dtype=dtype)
    assert all_finite(values) and all_finite(values.t())
    info = torch.finfo(dtype)
    assert all_finite(torch.tensor([info.max, -info.max, info.tiny, info.tiny / 4, -0.0], dtype=dtype))
    for bad in (float("inf"), float("-inf"), float("nan")):
        for at in (0, 1049, 2099):
            broken = values.clone()
            broken.view(-1)[at] = bad
            assert not all_finite(broken) and not all_finite(broken.t()), (bad, at)
    assert all_finite(torch.arange(5))  # not floating point: nothing to check
