"""Static order-0 rANS over bytes: four interleaved 32-bit states, byte-wise renormalisation.

Chosen over zstd's Huffman for the codec's small, skewed alphabets (gap bytes, ULP distances): a
Huffman code spends at least one bit per symbol, rANS spends the symbol's information (the high byte
of a ±1-ULP change, almost always 0, costs ~0.001 bit). Four states interleaved so the decoder has
independent dependency chains to overlap.

Layout of a coded stream (the caller knows how many symbols it holds):

    table: 32-byte presence bitmap (symbol s present iff byte s>>3 has bit s&7, LSB first),
           then each present symbol's frequency, ascending symbol order, as unsigned LEB128;
           frequencies are >= 1 and sum to 2**SCALE_BITS
    states: four u32 little-endian, the decoder's initial states x0..x3
    body: renormalisation bytes, read forward

Decoding symbol i (i = 0..count-1) uses state x = x[i % 4]:

    slot = x & (M - 1); s = the symbol with cum[s] <= slot < cum[s] + freq[s]
    x = freq[s] * (x >> SCALE_BITS) + slot - cum[s]
    while x < L: x = (x << 8) | next body byte

with SCALE_BITS = 14, M = 2**14, L = 2**23 and cum[s] the sum of the frequencies of smaller symbols. Every
initial state lies in [L, 2**31) (a reader refuses others; from there no state leaves that range and
each renormalises with at most two bytes per symbol). After the last symbol every state equals L
again and the body is used up exactly: a reader checks both.

The encoder (reference, not part of the format): states start at L; symbols are coded last to
first, symbol i with state x[i % 4]: while x >= ((L >> SCALE_BITS) << 8) * freq[s], emit x & 0xFF
and x >>= 8; then x = ((x // freq[s]) << SCALE_BITS) + (x % freq[s]) + cum[s]. The emitted bytes,
reversed, are the body; the final states are written as x0..x3.
"""

from __future__ import annotations

import numpy as np
from numba import njit

SCALE_BITS = 14
M = 1 << SCALE_BITS
L = 1 << 23
TABLE_BITMAP = 32
STATES_BYTES = 16

_U64 = np.uint64
_SCALE = np.uint64(SCALE_BITS)
_SLOT_MASK = np.uint64(M - 1)
_L = np.uint64(L)
_BYTE = np.uint64(0xFF)
_EIGHT = np.uint64(8)
_X_MAX_UNIT = np.uint64((L >> SCALE_BITS) << 8)
_FREQ_MASK = np.uint64(0xFFFFFF)


class RansError(ValueError):
    """A coded stream that does not decode (truncated, forged table, wrong length)."""


@njit(nogil=True, cache=True)
def histogram(symbols: np.ndarray) -> np.ndarray:
    hist = np.zeros(256, dtype=np.int64)
    for i in range(symbols.shape[0]):
        hist[symbols[i]] += 1
    return hist


@njit(nogil=True, cache=True)
def normalize(hist: np.ndarray) -> np.ndarray:
    """Frequencies summing to M, >= 1 for every present symbol, near count * M / total."""
    total = 0
    for s in range(256):
        total += hist[s]
    freqs = np.zeros(256, dtype=np.int64)
    if total == 0:
        return freqs
    acc = 0
    for s in range(256):
        if hist[s] > 0:
            f = (hist[s] * M + total // 2) // total
            freqs[s] = f if f > 0 else 1
            acc += freqs[s]
    # Give or take the rounding error from the largest frequencies (they lose the least per unit).
    while acc != M:
        best = -1
        for s in range(256):
            adjustable = freqs[s] > 1 or (acc < M and freqs[s] > 0)
            if adjustable and (best < 0 or freqs[s] > freqs[best]):
                best = s
        if acc > M:
            step = min(acc - M, freqs[best] - 1)
            freqs[best] -= step
            acc -= step
        else:
            freqs[best] += M - acc
            acc = M
    return freqs


@njit(nogil=True, cache=True)
def cost_bits(hist: np.ndarray, freqs: np.ndarray) -> float:
    """Bits the body will take, near enough to choose between codings without coding."""
    bits = 0.0
    for s in range(256):
        if hist[s] > 0:
            bits += hist[s] * (SCALE_BITS - np.log2(freqs[s]))
    return bits


@njit(nogil=True, cache=True)
def table_bytes(freqs: np.ndarray) -> int:
    size = TABLE_BITMAP
    for s in range(256):
        f = freqs[s]
        while f > 0:
            size += 1
            f >>= 7
    return size


@njit(nogil=True, cache=True)
def _write_table(freqs: np.ndarray, out: np.ndarray) -> int:
    for i in range(TABLE_BITMAP):
        out[i] = 0
    at = TABLE_BITMAP
    for s in range(256):
        f = freqs[s]
        if f > 0:
            out[s >> 3] |= np.uint8(1 << (s & 7))
            while True:
                byte = f & 0x7F
                f >>= 7
                if f > 0:
                    out[at] = byte | 0x80
                    at += 1
                else:
                    out[at] = byte
                    at += 1
                    break
    return at


@njit(nogil=True, cache=True)
def encode(symbols: np.ndarray, freqs: np.ndarray, out: np.ndarray) -> int:
    """Code `symbols` into `out` (table, states, body); returns the coded length, or -1 when `out`
    is too small (the caller then stores the symbols plainly: coding did not pay)."""
    cum = np.zeros(257, dtype=np.int64)
    for s in range(256):
        cum[s + 1] = cum[s] + freqs[s]
    head = _write_table(freqs, out)
    # The body is produced backwards (rANS codes in reverse): into the tail of `out`, then moved.
    ptr = out.shape[0]
    floor = head + STATES_BYTES
    x = np.empty(4, dtype=np.uint64)
    x[:] = _L
    n = symbols.shape[0]
    for i in range(n - 1, -1, -1):
        s = symbols[i]
        f = _U64(freqs[s])
        lane = i & 3
        xs = x[lane]
        x_max = _X_MAX_UNIT * f
        while xs >= x_max:
            ptr -= 1
            if ptr < floor:
                return -1
            out[ptr] = np.uint8(xs & _BYTE)
            xs >>= _EIGHT
        # x < 2**31 here: 32-bit division is several times faster than 64-bit
        x32 = np.uint32(xs)
        f32 = np.uint32(f)
        q = x32 // f32
        x[lane] = (_U64(q) << _SCALE) + _U64(x32 - q * f32) + _U64(cum[s])
    body = out.shape[0] - ptr
    for lane in range(4):
        v = x[lane]
        for b in range(4):
            out[head + 4 * lane + b] = np.uint8((v >> _U64(8 * b)) & _BYTE)
    start = head + STATES_BYTES
    for i in range(body):
        out[start + i] = out[ptr + i]
    return start + body


@njit(nogil=True, cache=True)
def read_table(data: np.ndarray, start: int, end: int, freqs: np.ndarray) -> int:
    """Parse a table at data[start:end] into `freqs`; returns where it ends, or -1 if malformed."""
    if end - start < TABLE_BITMAP:
        return -1
    at = start + TABLE_BITMAP
    total = 0
    for s in range(256):
        freqs[s] = 0
        if (data[start + (s >> 3)] >> (s & 7)) & 1:
            f = 0
            shift = 0
            while True:
                if at >= end or shift > 14:
                    return -1
                byte = np.int64(data[at])
                at += 1
                f |= (byte & 0x7F) << shift
                shift += 7
                if byte < 0x80:
                    break
            if f < 1 or f > M:
                return -1
            freqs[s] = f
            total += f
    if total != M:
        return -1
    return at


@njit(nogil=True, cache=True)
def decode(data: np.ndarray, start: int, end: int, out: np.ndarray, slots: np.ndarray) -> int:
    """Decode len(out) symbols from data[start:end]; 0 on success, < 0 if the stream is malformed.
    `slots` is scratch of M u64 (the caller reuses it across streams)."""
    freqs = np.zeros(256, dtype=np.int64)
    at = read_table(data, start, end, freqs)
    if at < 0:
        return -1
    if end - at < STATES_BYTES:
        return -2
    # One lookup per symbol: slot -> symbol | frequency << 8 | (slot - cum[symbol]) << 32 ... stored
    # as cum[symbol] so the update is freq * (x >> SCALE) + slot - cum.
    c = 0
    for s in range(256):
        f = freqs[s]
        packed = _U64(s) | (_U64(f) << _EIGHT) | (_U64(c) << _U64(32))
        for j in range(f):
            slots[c + j] = packed
        c += f
    x0 = _U64(0)
    x1 = _U64(0)
    x2 = _U64(0)
    x3 = _U64(0)
    for b in range(4):
        sh = _U64(8 * b)
        x0 |= _U64(data[at + b]) << sh
        x1 |= _U64(data[at + 4 + b]) << sh
        x2 |= _U64(data[at + 8 + b]) << sh
        x3 |= _U64(data[at + 12 + b]) << sh
    # States in [L, 2**31) stay there whatever the body holds (table checked above), and then each
    # renormalises with at most 2 bytes per symbol: the bound the unchecked fast path relies on.
    top = _U64(1 << 31)
    if not (_L <= x0 < top and _L <= x1 < top and _L <= x2 < top and _L <= x3 < top):
        return -5
    ptr = at + STATES_BYTES
    n = out.shape[0]
    i = 0
    # Four symbols per round, one per state: independent chains the CPU can overlap.
    while i + 4 <= n:
        e0 = slots[x0 & _SLOT_MASK]
        e1 = slots[x1 & _SLOT_MASK]
        e2 = slots[x2 & _SLOT_MASK]
        e3 = slots[x3 & _SLOT_MASK]
        out[i] = np.uint8(e0 & _BYTE)
        out[i + 1] = np.uint8(e1 & _BYTE)
        out[i + 2] = np.uint8(e2 & _BYTE)
        out[i + 3] = np.uint8(e3 & _BYTE)
        x0 = ((e0 >> _EIGHT) & _FREQ_MASK) * (x0 >> _SCALE) + (x0 & _SLOT_MASK) - (e0 >> _U64(32))
        x1 = ((e1 >> _EIGHT) & _FREQ_MASK) * (x1 >> _SCALE) + (x1 & _SLOT_MASK) - (e1 >> _U64(32))
        x2 = ((e2 >> _EIGHT) & _FREQ_MASK) * (x2 >> _SCALE) + (x2 & _SLOT_MASK) - (e2 >> _U64(32))
        x3 = ((e3 >> _EIGHT) & _FREQ_MASK) * (x3 >> _SCALE) + (x3 & _SLOT_MASK) - (e3 >> _U64(32))
        if ptr + 8 <= end:  # enough bytes left for any renormalisation of this round: no checks
            while x0 < _L:
                x0 = (x0 << _EIGHT) | _U64(data[ptr])
                ptr += 1
            while x1 < _L:
                x1 = (x1 << _EIGHT) | _U64(data[ptr])
                ptr += 1
            while x2 < _L:
                x2 = (x2 << _EIGHT) | _U64(data[ptr])
                ptr += 1
            while x3 < _L:
                x3 = (x3 << _EIGHT) | _U64(data[ptr])
                ptr += 1
        else:
            while x0 < _L:
                if ptr >= end:
                    return -3
                x0 = (x0 << _EIGHT) | _U64(data[ptr])
                ptr += 1
            while x1 < _L:
                if ptr >= end:
                    return -3
                x1 = (x1 << _EIGHT) | _U64(data[ptr])
                ptr += 1
            while x2 < _L:
                if ptr >= end:
                    return -3
                x2 = (x2 << _EIGHT) | _U64(data[ptr])
                ptr += 1
            while x3 < _L:
                if ptr >= end:
                    return -3
                x3 = (x3 << _EIGHT) | _U64(data[ptr])
                ptr += 1
        i += 4
    while i < n:
        lane = i & 3
        x = x0 if lane == 0 else (x1 if lane == 1 else (x2 if lane == 2 else x3))
        e = slots[x & _SLOT_MASK]
        out[i] = np.uint8(e & _BYTE)
        x = ((e >> _EIGHT) & _FREQ_MASK) * (x >> _SCALE) + (x & _SLOT_MASK) - (e >> _U64(32))
        while x < _L:
            if ptr >= end:
                return -3
            x = (x << _EIGHT) | _U64(data[ptr])
            ptr += 1
        if lane == 0:
            x0 = x
        elif lane == 1:
            x1 = x
        elif lane == 2:
            x2 = x
        else:
            x3 = x
        i += 1
    if ptr != end or x0 != _L or x1 != _L or x2 != _L or x3 != _L:
        return -4
    return 0
