"""`sprawl bench delta`: patch size and speed against the anchors, on real Adam steps and synthetic changes.

Workloads
- adam: a Qwen3-MoE built from a transformers config (57.7M parameters; `--quick`: ~7M), trained a
  few steps on next-token loss with torch.optim.Adam at RL-like learning rates (1e-6, 1e-5); each
  transition between consecutive steps is diffed in the bf16 and fp8_e4m3 served views.
- synthetic: bf16 weights (N(0, 0.02), RNE cast) with ±1-ULP changes at 0.1%, 1%, 3%, 10% density.

Anchors, measured in the same run on the same tensors and thread pool
- xor_zstd1: dense XOR with the base, zstd level 1 (what Modal's Stitch and slime ship);
- idx_raw_zstd: int32 indices + raw replacement values, zstd level 3 (TRL / NeMo-RL style);
- entropy: positions at the observed density (n·H(k/n) bits) + order-0 entropy of the XOR words;
- ulp_entropy: the same positions + order-0 entropy of the signed ULP distances (new - old bit
  patterns in float order), the tighter of the two bounds for small updates of floats; neither is
  a true lower bound (a coder with context could beat both), both are per tensor;
- memcpy: a numpy copy of the same tensor bytes (one thread), the hardware's yardstick.

Speeds are tensor bytes per second (best of 3). Our encode hashes every target tensor (xxh3-128,
carried in the patch) but not the base, whose checksums the chain computed when it published it.
Our apply is in place with every changed tensor's target checksum verified (the chain verifies bases
once, when they are loaded; a tensor the patch leaves unchanged is its verified base). The anchors
hash and verify nothing. `scaling` times our encode and apply with 1 thread and with the pool's.
"""

from __future__ import annotations

import math
import resource
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from pipeline import patch_codec
from pipeline.bits import checksum, dtype_name, to_bits
from pipeline.config import ChainSettings
from pipeline.patch_codec import TensorBits
from pipeline.tiny_models import tiny_moe_config
from pipeline.views import get_view

REPEATS = 3
CHAIN = ChainSettings()
"""The chain's default codec settings: the bench measures what a trainer publishes with."""
CHUNK = CHAIN.chunk_elements


def _bits(tensors: dict[str, torch.Tensor]) -> dict[str, TensorBits]:
    return {n: TensorBits(dtype_name(t.dtype), tuple(t.shape), to_bits(t).copy()) for n, t in tensors.items()}


def _best(fn) -> float:
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _bound_bytes(base: dict[str, TensorBits], target: dict[str, TensorBits], symbols) -> float:
    """An entropy bound on a patch: per tensor, the changed positions at the observed density
    (n·H2(k/n)) plus the order-0 entropy of `symbols(old, new)`, the changed values as some code sees
    them."""
    bits = 0.0
    for name, tgt in target.items():
        b, t = base[name].bits, tgt.bits
        n = len(t)
        changed = np.flatnonzero(b != t)
        k = len(changed)
        if n == 0 or k == 0:
            continue
        p = k / n
        if 0 < p < 1:
            bits += n * -(p * math.log2(p) + (1 - p) * math.log2(1 - p))
        _, counts = np.unique(symbols(b[changed], t[changed]), return_counts=True)
        probs = counts / counts.sum()
        bits += k * float(-(probs * np.log2(probs)).sum())
    return bits / 8


def _ordered(bits: np.ndarray) -> np.ndarray:
    """Bit patterns in float order as w-bit integers (pipeline.codec.kernels' ord), in uint64."""
    width = bits.dtype.itemsize * 8
    wide = bits.astype(np.uint64)
    magnitude = np.uint64((1 << (width - 1)) - 1)
    return wide ^ ((np.uint64(0) - (wide >> np.uint64(width - 1))) & magnitude)


def _ulp_distance(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """The signed ULP distance, as a w-bit pattern (a bijection of it)."""
    width = new.dtype.itemsize * 8
    distance = _ordered(new) - _ordered(old)  # modulo 2**64 ...
    if width < 64:
        distance &= np.uint64((1 << width) - 1)  # ... and modulo 2**width
    return distance


def _entropy_bytes(base: dict[str, TensorBits], target: dict[str, TensorBits]) -> float:
    """The XOR bound: order-0 entropy of the changed values' XOR with the base."""
    return _bound_bytes(base, target, np.bitwise_xor)


def _ulp_entropy_bytes(base: dict[str, TensorBits], target: dict[str, TensorBits]) -> float:
    """The ULP bound: order-0 entropy of the signed ULP distances (10-13% below the XOR bound on Adam data)."""
    return _bound_bytes(base, target, _ulp_distance)


def _memcpy_seconds(target: dict[str, TensorBits]) -> float:
    """A numpy copy of every tensor's bytes into buffers already touched (no page faults timed)."""
    names = sorted(target)
    out = {n: np.empty_like(target[n].bits) for n in names}

    def copy() -> None:
        for n in names:
            np.copyto(out[n], target[n].bits)

    copy()
    return _best(copy)


def compare(base: dict[str, TensorBits], target: dict[str, TensorBits], pool: ThreadPoolExecutor) -> dict:
    names = sorted(target)
    raw_bytes = sum(target[n].bits.nbytes for n in names)
    total = sum(len(target[n].bits) for n in names)
    changed = sum(int(np.count_nonzero(base[n].bits != target[n].bits)) for n in names)

    # ours; the base's checksums are known, as in the chain (computed when the base was published)
    base_sums = {n: checksum(b.bits) for n, b in base.items()}
    tracemalloc.start()
    patch = patch_codec.encode(
        base, target, pool=pool, base_checksums=base_sums, chunk_elements=CHUNK, level=CHAIN.zstd_level
    )
    _, encode_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    encode_s = _best(
        lambda: patch_codec.encode(
            base, target, pool=pool, base_checksums=base_sums, chunk_elements=CHUNK, level=CHAIN.zstd_level
        )
    )
    buffers = [{n: TensorBits(b.dtype, b.shape, b.bits.copy()) for n, b in base.items()} for _ in range(REPEATS)]
    out = patch_codec.apply(
        patch,
        {n: TensorBits(b.dtype, b.shape, b.bits.copy()) for n, b in base.items()},
        inplace=True,
        verify_base=False,
        pool=pool,
    )
    bitexact = all(np.array_equal(out[n].bits, target[n].bits) for n in names)
    it = iter(buffers)
    apply_s = _best(lambda: patch_codec.apply(patch, next(it), inplace=True, verify_base=False, pool=pool))

    # anchor: dense XOR + zstd-1
    # zstd contexts are not thread-safe: one per pool thread.
    z1 = patch_codec._Zstd(1)

    # Anchors get the same parallelism as ours: large tensors are cut into the codec's chunk size.
    pieces = [(n, s, min(s + CHUNK, len(target[n].bits))) for n in names for s in range(0, len(target[n].bits), CHUNK)]

    def xor_encode() -> list[bytes]:
        return list(
            pool.map(
                lambda p: z1.compress((base[p[0]].bits[p[1] : p[2]] ^ target[p[0]].bits[p[1] : p[2]]).tobytes()), pieces
            )
        )

    xor_blobs = xor_encode()
    xor_encode_s = _best(xor_encode)
    xor_buffers = [{n: base[n].bits.copy() for n in names} for _ in range(REPEATS)]
    xit = iter(xor_buffers)

    def xor_apply() -> None:
        bufs = next(xit)

        def one(item: tuple[tuple[str, int, int], bytes]) -> None:
            (name, start, end), blob = item
            view = bufs[name][start:end]
            view ^= np.frombuffer(z1.decompress(blob, view.nbytes), dtype=view.dtype)

        list(pool.map(one, zip(pieces, xor_blobs, strict=True)))

    xor_apply_s = _best(xor_apply)

    # anchor: int32 indices + raw values + zstd-3
    z3 = patch_codec._Zstd(3)

    def idx_encode() -> list[bytes]:
        def one(p: tuple[str, int, int]) -> bytes:
            b, t = base[p[0]].bits[p[1] : p[2]], target[p[0]].bits[p[1] : p[2]]
            idx = np.flatnonzero(b != t).astype(np.int32)
            return z3.compress(idx.tobytes() + t[idx].tobytes())

        return list(pool.map(one, pieces))

    idx_blobs = idx_encode()
    idx_encode_s = _best(idx_encode)

    memcpy_s = _memcpy_seconds(target)

    xor_bytes = sum(len(b) for b in xor_blobs)
    idx_bytes = sum(len(b) for b in idx_blobs)
    entropy = _entropy_bytes(base, target)
    ulp_entropy = _ulp_entropy_bytes(base, target)
    mb = raw_bytes / 2**20
    return {
        "bitexact": bitexact,
        "tensor_mib": round(mb, 2),
        "changed_fraction": changed / max(total, 1),
        "patch_bytes": len(patch),
        "xor_zstd1_bytes": xor_bytes,
        "idx_raw_zstd_bytes": idx_bytes,
        "entropy_bytes": round(entropy),
        "ulp_entropy_bytes": round(ulp_entropy),
        "keyframe_bytes": raw_bytes,
        "size_vs_xor_zstd": len(patch) / xor_bytes,
        "size_vs_idx_raw_zstd": len(patch) / idx_bytes,
        "size_vs_entropy": len(patch) / entropy if entropy else None,
        "size_vs_ulp_entropy": len(patch) / ulp_entropy if ulp_entropy else None,
        "size_vs_keyframe": len(patch) / raw_bytes,
        "encode_mib_s": mb / encode_s,
        "apply_mib_s": mb / apply_s,
        "xor_zstd1_encode_mib_s": mb / xor_encode_s,
        "xor_zstd1_apply_mib_s": mb / xor_apply_s,
        "idx_raw_zstd_encode_mib_s": mb / idx_encode_s,
        "encode_speed_vs_xor_zstd": xor_encode_s / encode_s,
        "apply_speed_vs_xor_zstd": xor_apply_s / apply_s,
        "memcpy_mib_s": mb / memcpy_s,
        "encode_vs_memcpy": memcpy_s / encode_s,
        "apply_vs_memcpy": memcpy_s / apply_s,
        "encode_peak_mib": round(encode_peak / 2**20, 1),
    }


# ---------------------------------------------------------------- workloads


def synthetic(density: float, elements: int, seed: int = 0) -> tuple[dict, dict]:
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    base_bits = to_bits((torch.randn(elements, generator=gen) * 0.02).to(torch.bfloat16)).copy()
    target_bits = base_bits.copy()
    idx = rng.choice(elements, size=int(elements * density), replace=False)
    one = np.ones(len(idx), dtype=np.uint16)
    # ±1 ULP on the magnitude (bf16 bits are sign-magnitude): +1 or -1 on the bit pattern, never below 0.
    up = (rng.random(len(idx)) < 0.5) | (target_bits[idx] & 0x7FFF == 0)
    target_bits[idx] = np.where(up, target_bits[idx] + one, target_bits[idx] - one)
    shape = (elements,)
    return {"w": TensorBits("BF16", shape, base_bits)}, {"w": TensorBits("BF16", shape, target_bits)}


def moe_config(quick: bool):
    """The architecture of the tiny models, at sizes where bit-change statistics settle (57.7M
    parameters; 4.9M with --quick)."""
    if quick:
        return tiny_moe_config(
            vocab_size=4096,
            hidden_size=256,
            intermediate_size=512,
            moe_intermediate_size=192,
            head_dim=64,
            num_experts=8,
            max_position_embeddings=256,
        )
    return tiny_moe_config(
        vocab_size=16384,
        hidden_size=512,
        intermediate_size=1024,
        moe_intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=16,
        max_position_embeddings=256,
    )


def adam_transitions(lr: float, quick: bool, steps: int = 4, seed: int = 0) -> tuple[int, list[dict]]:
    """Real Adam steps; returns the parameter count and the served views after each step."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = moe_config(quick)
    model = Qwen3MoeForCausalLM(config).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.999))
    gen = torch.Generator().manual_seed(seed + 1)
    snapshots = []
    for _ in range(steps + 1):
        with torch.no_grad():
            state = model.state_dict()
            snapshots.append(
                {name: get_view(name).compute(state, model_type=config.model_type) for name in ("bf16", "fp8_e4m3")}
            )
        batch = torch.randint(0, config.vocab_size, (4, 64), generator=gen)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    params = sum(p.numel() for p in model.parameters())
    return params, snapshots


def _average(rows: list[dict]) -> dict:
    out = {}
    for key in rows[0]:
        values = [r[key] for r in rows]
        if isinstance(values[0], bool):
            out[key] = all(values)
        elif values[0] is None:
            out[key] = None
        else:
            out[key] = sum(values) / len(values)
    return out


def _time_ours(
    base: dict[str, TensorBits], target: dict[str, TensorBits], pool: ThreadPoolExecutor
) -> tuple[float, float]:
    """Best encode and in-place apply seconds of our codec on `pool` (as in `compare`)."""
    base_sums = {n: checksum(b.bits) for n, b in base.items()}

    def encode() -> bytes:
        return patch_codec.encode(
            base, target, pool=pool, base_checksums=base_sums, chunk_elements=CHUNK, level=CHAIN.zstd_level
        )

    patch = encode()
    encode_s = _best(encode)
    buffers = iter([{n: TensorBits(b.dtype, b.shape, b.bits.copy()) for n, b in base.items()} for _ in range(REPEATS)])
    apply_s = _best(lambda: patch_codec.apply(patch, next(buffers), inplace=True, verify_base=False, pool=pool))
    return encode_s, apply_s


def thread_scaling(base: dict[str, TensorBits], target: dict[str, TensorBits], threads: int) -> dict:
    """Our encode and apply with one thread and with `threads`: the kernels release the GIL, so
    chunks (and checksums) should run side by side."""
    mb = sum(t.bits.nbytes for t in target.values()) / 2**20
    out: dict = {"threads": threads}
    for label, count in (("1t", 1), ("nt", threads)):
        with ThreadPoolExecutor(max_workers=count) as pool:
            encode_s, apply_s = _time_ours(base, target, pool)
        out[f"encode_{label}_mib_s"] = mb / encode_s
        out[f"apply_{label}_mib_s"] = mb / apply_s
    out["encode_scaling"] = out["encode_nt_mib_s"] / out["encode_1t_mib_s"]
    out["apply_scaling"] = out["apply_nt_mib_s"] / out["apply_1t_mib_s"]
    return out


HEADLINE = (
    "encode_speed_vs_xor_zstd",
    "apply_speed_vs_xor_zstd",
    "encode_vs_memcpy",
    "apply_vs_memcpy",
    "size_vs_ulp_entropy",
    "size_vs_entropy",
    "size_vs_xor_zstd",
)
"""Surfaced at the top level for the 1% synthetic workload (bare names) and for Adam lr 1e-5 bf16
(prefixed adam_lr1e-5_bf16_): the issue's targets."""


def bench_delta(quick: bool) -> tuple[list[dict], dict]:
    threads = patch_codec._threads()
    pool = ThreadPoolExecutor(max_workers=threads)
    rows: list[dict] = []
    summary: dict = {"quick": quick, "threads": threads}
    scaling: dict = {}
    elements = (8 if quick else 64) * 1024 * 1024
    for density, label in [(0.001, "0.1pct"), (0.01, "1pct"), (0.03, "3pct"), (0.10, "10pct")]:
        pair = synthetic(density, elements)
        result = compare(*pair, pool)
        summary[f"synthetic_{label}"] = result
        rows.append({"workload": f"synthetic bf16 {label}", **result})
        if label == "1pct":
            scaling["synthetic_1pct"] = thread_scaling(*pair, threads)
    for lr in (1e-6, 1e-5):
        params, snaps = adam_transitions(lr, quick)
        summary["adam_parameters"] = params
        for view, key in (("bf16", "bf16"), ("fp8_e4m3", "fp8")):
            # Skip the first transition: Adam's first step is sign(g)*lr for every weight.
            per_step = [compare(_bits(snaps[i - 1][view]), _bits(snaps[i][view]), pool) for i in range(2, len(snaps))]
            result = _average(per_step)
            summary[f"adam_{key}_lr{lr:g}"] = result
            rows.append({"workload": f"adam {view} lr={lr:g}", **result})
            if key == "bf16" and lr == 1e-5:
                scaling["adam_bf16_lr1e-05"] = thread_scaling(_bits(snaps[1][view]), _bits(snaps[2][view]), threads)
    summary["adam_bf16"] = summary["adam_bf16_lr1e-06"]
    summary["adam_fp8"] = summary["adam_fp8_lr1e-06"]
    for key in HEADLINE:
        summary[key] = summary["synthetic_1pct"][key]
        summary[f"adam_lr1e-5_bf16_{key}"] = summary["adam_bf16_lr1e-05"][key]
    adam = [summary[f"adam_{v}_lr{lr:g}"] for v in ("bf16", "fp8") for lr in (1e-6, 1e-5)]
    summary["adam_size_vs_ulp_entropy_max"] = max(r["size_vs_ulp_entropy"] for r in adam)
    summary["scaling"] = scaling
    summary["bitexact"] = all(r["bitexact"] for r in rows)
    summary["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    pool.shutdown()
    table = [
        {
            "workload": r["workload"],
            "changed": f"{r['changed_fraction']:.4%}",
            "patch KiB": f"{r['patch_bytes'] / 1024:.1f}",
            "vs xor+zstd1": f"{r['size_vs_xor_zstd']:.3f}",
            "vs idx+raw+zstd": f"{r['size_vs_idx_raw_zstd']:.3f}",
            "vs entropy": "-" if r["size_vs_entropy"] is None else f"{r['size_vs_entropy']:.3f}",
            "vs ulp H": "-" if r["size_vs_ulp_entropy"] is None else f"{r['size_vs_ulp_entropy']:.3f}",
            "vs keyframe": f"{r['size_vs_keyframe']:.4f}",
            "enc MiB/s": f"{r['encode_mib_s']:.0f} ({r['encode_speed_vs_xor_zstd']:.2f}x)",
            "apply MiB/s": f"{r['apply_mib_s']:.0f} ({r['apply_speed_vs_xor_zstd']:.2f}x)",
            "enc/apply vs memcpy": f"{r['encode_vs_memcpy']:.2f} / {r['apply_vs_memcpy']:.2f}",
            "exact": str(r["bitexact"]),
        }
        for r in rows
    ]
    return table, _rounded(summary)


def _rounded(value):
    if isinstance(value, float):
        return round(value, 5)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value
