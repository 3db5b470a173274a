"""Column values to 64-bit keys, vectorised over Arrow string columns: hex values, decimal values,
and a stable hash of arbitrary bytes. Every function works on the ``(offsets, data)`` buffers of an
Arrow binary array, one numpy pass per byte, no Python per value. Local, pure (no MPI).

The string hash is part of the data format (checkpoints keep rows by id): a polynomial over the
bytes mod 2^64 (multiplier ``_P``), finished with SplitMix64 over the length and the column key.
"""

import numpy as np

from ..core.ids import splitmix64

__all__ = ["binary_buffers", "hex_keys", "decimal_keys", "hash_keys", "column_key", "salted_keys", "EMPTY_HEX"]

EMPTY_HEX = 0xFFFF_FFFF_FFFF          # the key of an empty hex field (Criteo's missing categoricals)
_P = np.uint64(0x100000001B3)         # the FNV-64 prime, as the polynomial's multiplier
_HEX = np.full(256, 255, np.uint8)
for _k, _c in enumerate(b"0123456789abcdef"):
    _HEX[_c] = _k
for _k, _c in enumerate(b"ABCDEF"):
    _HEX[_c] = 10 + _k
_DEC = np.full(256, 255, np.uint8)
_DEC[48:58] = np.arange(10)


def column_key(index: int) -> np.uint64:
    """The key mixed into the ids of the ``index``-th categorical column (0-based). Local."""
    return np.uint64((index + 1) * 0x9E3779B97F4A7C15 % (1 << 64))


def salted_keys(ids: np.ndarray, index: int) -> np.ndarray:
    """The 64-bit keys (int64) of integer ids of the ``index``-th categorical column: a bijection
    per column (``splitmix64(id ^ column_key)``), so distinct ids of a column stay distinct and
    equal ids of two columns differ. Local."""
    with np.errstate(over="ignore"):
        return splitmix64(np.asarray(ids, np.int64).view(np.uint64) ^ column_key(index)).view(np.int64)


def binary_buffers(arr):
    """``(offsets (n+1,) int64 from 0, data uint8)`` of a pyarrow binary/string array without
    nulls. Local."""
    bufs = arr.buffers()
    wide = str(arr.type).startswith("large_")
    off = np.frombuffer(bufs[1], np.int64 if wide else np.int32, len(arr) + 1, arr.offset * (8 if wide else 4))
    off = off.astype(np.int64)
    data = np.frombuffer(bufs[2], np.uint8)[off[0]:off[-1]] if bufs[2] is not None else np.zeros(0, np.uint8)
    return off - off[0], data


def _sums(values, off):
    """Per value, the sum of ``values`` over its bytes ``off[i]:off[i+1]`` (an empty value's: not
    meaningful, the callers set it). A zero is appended so that every start is an index, the last
    value's included: clamping the starts instead cut the last byte off a value that only empty
    values followed (a Criteo block whose last lines leave a column empty read 'a61' as 'a6')."""
    return np.add.reduceat(np.append(values, values.dtype.type(0)), off[:-1])


def _one_length(lens, data):
    """``(mask of the non-empty values, their common length)`` where every non-empty value has one
    length (then ``data`` is a matrix, one row a value), else None."""
    full = lens > 0
    m = int(full.sum())
    if m == 0 or data.shape[0] % m:
        return None
    length = data.shape[0] // m
    return (full, length) if (lens[full] == length).all() else None


def _by_digit(digits):
    v = np.zeros(digits.shape[0], np.uint64)
    for c in range(digits.shape[1]):
        v <<= np.uint64(4)
        v |= digits[:, c] & np.uint8(15)
    return v


_LO4, _BIT6 = np.uint64(0x0F0F0F0F0F0F0F0F), np.uint64(0x0101010101010101)


def _swar8(data):
    """Values of exactly 8 hex digits, 8 bytes a uint64 word: each byte to its nibble
    (``(c & 15) + 9 * (c >> 6)``: digits and both letter cases), then the nibbles packed in
    pairs, fours and eights with the first byte most significant."""
    w = data.view("<u8")
    with np.errstate(over="ignore"):
        x = (w & _LO4) + np.uint64(9) * ((w >> np.uint64(6)) & _BIT6)
        x = ((x & np.uint64(0x000F000F000F000F)) << np.uint64(4)) | ((x >> np.uint64(8)) & np.uint64(0x000F000F000F000F))
        x = ((x & np.uint64(0x000000FF000000FF)) << np.uint64(8)) | ((x >> np.uint64(16)) & np.uint64(0x000000FF000000FF))
        x = ((x & np.uint64(0x000000000000FFFF)) << np.uint64(16)) | ((x >> np.uint64(32)) & np.uint64(0xFFFF))
    return x


def hex_keys(off, data):
    """Values of 1-16 hex digits -> uint64; empty -> ``EMPTY_HEX``. Also a bool mask of the values
    that are not such hex (over 16 digits, or a byte outside ``0-9a-fA-F``). Local."""
    lens = np.diff(off)
    n = lens.shape[0]
    if data.shape[0] == 0:
        return np.full(n, EMPTY_HEX, np.uint64), np.zeros(n, bool)
    one = _one_length(lens, data)
    if one is not None and one[1] <= 16:             # the common case: a matrix, one op per digit
        full, length = one
        digits = _HEX[data]
        bad = np.zeros(n, bool)
        if (digits == 255).any():                    # rare: find the values holding a non-hex byte
            bad[full] = (digits.reshape(-1, length) == 255).any(axis=1)
        keys = np.full(n, EMPTY_HEX, np.uint64)
        keys[full] = _swar8(data) if length == 8 else _by_digit(digits.reshape(-1, length))
        return keys, bad
    digits = _HEX[data]
    bad = _sums((digits == 255).astype(np.int64), off) > 0
    place = np.repeat(off[1:], lens) - 1 - np.arange(data.shape[0])
    with np.errstate(over="ignore"):
        contrib = (digits & np.uint8(15)).astype(np.uint64) << (np.minimum(place, 15) * 4).astype(np.uint64)
    keys = _sums(contrib, off)
    empty = lens == 0
    bad = (bad & ~empty) | (lens > 16)
    keys[empty] = EMPTY_HEX
    return keys, bad


def decimal_keys(off, data):
    """Values of 1-19 decimal digits -> uint64 (raw keys); also a mask of values that are not
    (empty, a non-digit byte, more than 19 digits). Local."""
    lens = np.diff(off)
    n = lens.shape[0]
    if data.shape[0] == 0:
        return np.zeros(n, np.uint64), np.ones(n, bool)
    digits = _DEC[data]
    bad = _sums((digits == 255).astype(np.int64), off) > 0
    place = np.minimum(np.repeat(off[1:], lens) - 1 - np.arange(data.shape[0]), 19)
    tens = np.uint64(10) ** np.arange(20, dtype=np.uint64)
    with np.errstate(over="ignore"):
        contrib = (digits % np.uint8(10)).astype(np.uint64) * tens[place]
    keys = _sums(contrib, off)
    bad = bad | (lens == 0) | (lens > 19)
    keys[lens == 0] = 0
    return keys, bad


def hash_keys(off, data, key: np.uint64):
    """A stable 64-bit hash of each value's bytes (any bytes, the empty value included), mixed
    with the column ``key``. Local."""
    lens = np.diff(off)
    n = lens.shape[0]
    one = _one_length(lens, data) if data.shape[0] else None
    if data.shape[0] == 0:
        h = np.zeros(n, np.uint64)
    elif one is not None:                            # one length: a matrix, one op per byte column
        full, length = one
        rows = data.reshape(-1, length)
        v = np.zeros(rows.shape[0], np.uint64)
        with np.errstate(over="ignore"):
            for c in range(length):
                v *= _P
                v += rows[:, c]
        h = np.zeros(n, np.uint64)
        h[full] = v
    else:
        place = np.repeat(off[1:], lens) - 1 - np.arange(data.shape[0])
        top = int(place.max()) + 1 if place.shape[0] else 1
        with np.errstate(over="ignore"):
            powers = np.cumprod(np.concatenate([[np.uint64(1)], np.full(top - 1, _P, np.uint64)]))
            h = _sums(data.astype(np.uint64) * powers[place], off)
        h[lens == 0] = 0
    with np.errstate(over="ignore"):
        return splitmix64(h ^ splitmix64(lens.astype(np.uint64) ^ key))
