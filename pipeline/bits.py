"""Tensors as raw bits: every dtype viewed as an unsigned integer array of its width.

The patch codec and the checksums work on bits, never on values, so NaN
payloads, -0.0, Inf and subnormals survive untouched and nothing is ever
computed in floating point.
"""

from __future__ import annotations

import numpy as np
import torch
import xxhash

from pipeline.errors import SprawlError

# dtype name (as in safetensors / patch headers) -> (torch dtype, unsigned view, signed torch view)
_DTYPES: dict[str, tuple[torch.dtype, np.dtype, torch.dtype]] = {
    "BF16": (torch.bfloat16, np.dtype(np.uint16), torch.int16),
    "F16": (torch.float16, np.dtype(np.uint16), torch.int16),
    "F32": (torch.float32, np.dtype(np.uint32), torch.int32),
    "F64": (torch.float64, np.dtype(np.uint64), torch.int64),
    "F8_E4M3": (torch.float8_e4m3fn, np.dtype(np.uint8), torch.uint8),
    "F8_E5M2": (torch.float8_e5m2, np.dtype(np.uint8), torch.uint8),
    "I8": (torch.int8, np.dtype(np.uint8), torch.uint8),
    "U8": (torch.uint8, np.dtype(np.uint8), torch.uint8),
    "I16": (torch.int16, np.dtype(np.uint16), torch.int16),
    "I32": (torch.int32, np.dtype(np.uint32), torch.int32),
    "I64": (torch.int64, np.dtype(np.uint64), torch.int64),
    "BOOL": (torch.bool, np.dtype(np.uint8), torch.uint8),
}
_BY_TORCH = {spec[0]: name for name, spec in _DTYPES.items()}


class UnsupportedDtype(SprawlError, ValueError):
    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        super().__init__(
            f"dtype {dtype} has no bit-level representation in sprawl (known: {', '.join(_DTYPES)})",
            hint="cast the tensor to one of those in its view, or add the dtype to pipeline/bits.py",
        )


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        raise UnsupportedDtype(dtype) from None


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name][0]


def bits_dtype(name: str) -> np.dtype:
    return _DTYPES[name][1]


def to_bits(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bits as a flat unsigned numpy array (a view when the tensor is contiguous on CPU)."""
    name = dtype_name(tensor.dtype)
    _, unsigned, signed_view = _DTYPES[name]
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if tensor.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return flat.view(signed_view).numpy().view(unsigned)


def from_bits(bits: np.ndarray, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A torch tensor of dtype `name` sharing memory with `bits` (no copy)."""
    dtype, _, signed_view = _DTYPES[name]
    signed = torch.from_numpy(np.ascontiguousarray(bits).view(_numpy_signed(signed_view)))
    if dtype == torch.bool:
        return signed.view(torch.uint8).to(torch.bool).reshape(shape)
    return signed.view(dtype).reshape(shape)


def _numpy_signed(dtype: torch.dtype) -> np.dtype:
    return {
        torch.int16: np.dtype(np.int16),
        torch.int32: np.dtype(np.int32),
        torch.int64: np.dtype(np.int64),
        torch.uint8: np.dtype(np.uint8),
    }[dtype]


_EXPONENT_BITS = {"BF16": 0x7F80, "F16": 0x7C00, "F32": 0x7F800000, "F64": 0x7FF0000000000000}
"""The exponent field of each IEEE dtype: all ones is an inf or a NaN."""


def all_finite(tensor: torch.Tensor) -> bool:
    """No inf and no NaN in `tensor` (True for a tensor that is not floating point). IEEE dtypes on the
    CPU are scanned by a compiled kernel over their bits (a served version is checked every commit);
    others by torch."""
    if not tensor.is_floating_point():
        return True
    name = _BY_TORCH.get(tensor.dtype)
    if name not in _EXPONENT_BITS or tensor.device.type != "cpu":
        return bool(torch.isfinite(tensor).all())
    from pipeline.codec.kernels import any_exponent_all_ones

    return not any_exponent_all_ones(to_bits(tensor), np.uint64(_EXPONENT_BITS[name]))


def checksum(bits: np.ndarray) -> str:
    """xxh3-128 of the raw bytes, hex."""
    return xxhash.xxh3_128_hexdigest(memoryview(np.ascontiguousarray(bits)).cast("B"))


def root_hash(entries: list[tuple[str, str, tuple[int, ...], str]]) -> str:
    """One hash over (name, dtype, shape, checksum) of every tensor, in name order."""
    h = xxhash.xxh3_128()
    for name, dtype, shape, digest in sorted(entries):
        h.update(f"{name}\0{dtype}\0{','.join(map(str, shape))}\0{digest}\n".encode())
    return h.hexdigest()
