"""Compile (or load from numba's cache) every kernel the codec uses, for each element width.

The first process on a machine compiles the kernels: measured on a shared 2-vCPU machine, about
10 s for all four widths when idle and 26 s under a load average of 6. Later processes load them
from numba's cache (next to the modules, or NUMBA_CACHE_DIR) in about a second. A worker that must
not pay the compile inside its first version's deadline calls warm() at start-up (a background
thread is fine: the kernels release the GIL); CI can call it once before the tests."""

from __future__ import annotations

import threading

import numpy as np


def warm() -> None:
    from pipeline.patch_codec import TensorBits, apply, encode

    rng = np.random.default_rng(0)
    for dtype, unsigned in (("U8", np.uint8), ("BF16", np.uint16), ("F32", np.uint32), ("I64", np.uint64)):
        base_bits = rng.integers(0, 100, size=5000).astype(unsigned)
        sparse = base_bits.copy()
        sparse[::97] += 1
        dense = base_bits + unsigned(1)
        base = {"a": TensorBits(dtype, (5000,), base_bits), "b": TensorBits(dtype, (7,), base_bits[:7].copy())}
        for changed in (sparse, dense):
            target = {"a": TensorBits(dtype, (5000,), changed), "b": TensorBits(dtype, (7,), changed[:7].copy())}
            for chunk_elements in (1 << 22, 1024):  # small tensors sharing a chunk, a tensor cut in chunks
                patch = encode(base, target, chunk_elements=chunk_elements)
                apply(patch, base)
        apply(encode(None, target), None)
    import torch

    from pipeline.bits import all_finite

    for float_dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        all_finite(torch.zeros(4, dtype=float_dtype))  # the engines' check of every version they load


def warm_in_background() -> threading.Thread:
    """Start `warm()` in a daemon thread: a worker starting on a fresh machine compiles the kernels
    while it connects and loads its keyframe, instead of inside its first patch (10-30 s). A failure
    here is not fatal: the first real encode or apply compiles (or fails) on its own, loudly."""

    def run() -> None:
        try:
            warm()
        except Exception as exc:
            from pipeline.logs import get_logger

            get_logger(__name__).warning("codec warm-up failed", error=repr(exc))

    thread = threading.Thread(target=run, name="codec-warm-up", daemon=True)
    thread.start()
    return thread
