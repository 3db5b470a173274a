"""Initial row values as a pure function of (seed, table name, global row id).

Every PS computes the rows it owns; whatever the number of PS ranks, the same
global id gets the same values (resharding and the equivalence tests rely on
it). Values are uniform in ``[-scale, scale)`` from a counter-based hash
(SplitMix64 of ``key + id * dim + column``), so any row can be computed alone.
Imports no MPI.
"""

import hashlib

import numpy as np

__all__ = ["initial_rows", "default_scale", "splitmix64"]

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
                 out: np.ndarray | None = None) -> np.ndarray:
    """Initial values of rows ``ids`` of table ``name``: float32 ``(len(ids), dim)``. Local.

    Writes into ``out`` when given (shape ``(len(ids), dim)``, float32).
    """
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    scale = default_scale(dim) if scale is None else float(scale)
    if out is None:
        out = np.empty((ids.size, dim), dtype=np.float32)
    key = _table_key(seed, name)
    counters = ids.astype(np.uint64)[:, None] * np.uint64(dim) + np.arange(dim, dtype=np.uint64)
    bits = splitmix64(counters ^ key) >> np.uint64(40)            # top 24 bits
    np.multiply(bits, 2.0 * scale / (1 << 24), out=out, casting="unsafe")
    out -= np.float32(scale)
    return out
