"""Initial row values as a pure function of (seed, table name, global row id).

Every PS computes the rows it owns; whatever the number of PS ranks, the same
global id gets the same values (resharding and the equivalence tests rely on
it). Values come from a counter-based hash (SplitMix64 of ``key + id * dim +
column``), so any row can be computed alone: ``uniform`` in ``[-scale, scale)``,
``normal`` with standard deviation ``scale`` (Box-Muller over two hashes), or
``zeros``. Imports no MPI.
"""

import hashlib

import numpy as np

__all__ = ["initial_rows", "default_scale", "splitmix64", "INITS"]

INITS = ("uniform", "normal", "zeros")

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x + _GOLDEN
        x ^= x >> np.uint64(30)
        x *= _M1
        x ^= x >> np.uint64(27)
        x *= _M2
        x ^= x >> np.uint64(31)
    return x


def _table_key(seed: int, name: str) -> np.uint64:
    digest = hashlib.blake2b(f"{int(seed)}\0{name}".encode(), digest_size=8).digest()
    return np.uint64(int.from_bytes(digest, "little"))


def default_scale(dim: int) -> float:
    """The default init half-width, ``1/sqrt(dim)``. Local."""
    return 1.0 / float(np.sqrt(dim))


def initial_rows(seed: int, name: str, ids, dim: int, scale: float | None = None,
                 out: np.ndarray | None = None, kind: str = "uniform") -> np.ndarray:
    """Initial values of rows ``ids`` of table ``name``: float32 ``(len(ids), dim)``. Local.

    ``kind``: ``uniform`` (half-width ``scale``), ``normal`` (standard deviation ``scale``) or
    ``zeros``; ``scale`` defaults to ``1/sqrt(dim)``. Writes into ``out`` when given (shape
    ``(len(ids), dim)``, float32).
    """
    if kind not in INITS:
        raise ValueError(f"table {name!r}: init must be one of {', '.join(INITS)}, got {kind!r}")
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    scale = default_scale(dim) if scale is None else float(scale)
    if out is None:
        out = np.empty((ids.size, dim), dtype=np.float32)
    if kind == "zeros" or scale == 0.0:
        out[...] = 0.0
        return out
    key = _table_key(seed, name)
    counters = ids.astype(np.uint64)[:, None] * np.uint64(dim) + np.arange(dim, dtype=np.uint64)
    bits = splitmix64(counters ^ key) >> np.uint64(40)            # top 24 bits
    if kind == "normal":
        u1 = (bits.astype(np.float64) + 1.0) / float(1 << 24)      # (0, 1]: log is finite
        u2 = (splitmix64(counters ^ splitmix64(key)) >> np.uint64(40)).astype(np.float64) / float(1 << 24)
        np.multiply(np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2), scale, out=out, casting="unsafe")
        return out
    np.multiply(bits, 2.0 * scale / (1 << 24), out=out, casting="unsafe")
    out -= np.float32(scale)
    return out
