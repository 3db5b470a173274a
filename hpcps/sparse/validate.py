"""Argument checks for pull/push, run before any communication. Pure.

Each failure is a ``ValueError`` that names the table and the problem; a
call that fails here has not touched the table.
"""

import numpy as np

__all__ = ["as_ids", "as_id_rows", "as_grads"]


def _to_numpy(x):
    if hasattr(x, "detach") and hasattr(x, "cpu"):      # torch.Tensor without importing torch
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def as_ids(table: str, ids, num_rows: int) -> np.ndarray:
    """Checked ids as a 1-D int64 array. Local."""
    arr = _to_numpy(ids)
    if arr.size == 0 and arr.dtype.kind in "fO":      # [] comes in as float64
        arr = arr.astype(np.int64).reshape(arr.shape)
    _integers(table, arr)
    if arr.ndim != 1:
        raise ValueError(f"table {table!r}: ids must be 1-D, got shape {arr.shape}")
    if arr.size:
        lo, hi = arr.min(), arr.max()
        if lo < 0 or hi >= num_rows:
            _out_of_range(table, lo, hi, num_rows)
    return arr.astype(np.int64, copy=False)


def as_id_rows(tables, ids, num_rows: np.ndarray) -> np.ndarray:
    """Several tables' ids at once, one 1-D integer numpy array of one length per table: checked
    as :func:`as_ids` would check each (the same errors), with one min and one max over all of
    them, as an int64 ``(tables, ids)`` array. Local."""
    for table, x in zip(tables, ids):
        _integers(table, x)
    arr = np.stack(ids).astype(np.int64, copy=False)
    if arr.shape[1]:
        lo, hi = arr.min(axis=1), arr.max(axis=1)
        bad = np.flatnonzero((lo < 0) | (hi >= num_rows))
        if bad.size:
            j = int(bad[0])
            _out_of_range(tables[j], lo[j], hi[j], int(num_rows[j]))
    return arr


def _integers(table: str, arr: np.ndarray) -> None:
    if arr.dtype.kind not in "iu":
        raise ValueError(f"table {table!r}: ids must be integers, got dtype {arr.dtype}")


def _out_of_range(table: str, lo, hi, num_rows: int) -> None:
    bad = lo if lo < 0 else hi
    raise ValueError(f"table {table!r}: id {int(bad)} out of range [0, {num_rows})")


def as_grads(table: str, grads, n: int, dim: int) -> np.ndarray:
    """Checked gradients as a C-contiguous float32 ``(n, dim)`` array. Local."""
    arr = _to_numpy(grads)
    if arr.dtype != np.float32:
        raise ValueError(f"table {table!r}: grads must be float32, got dtype {arr.dtype}")
    if arr.shape != (n, dim):
        raise ValueError(
            f"table {table!r}: grads must have shape ({n}, {dim}) for {n} ids, got {arr.shape}")
    if arr.size and not np.isfinite(arr.sum(dtype=np.float64)):
        # One sum is cheap; find the offending row only on the rare bad path.
        bad_rows = np.flatnonzero(~np.isfinite(arr).all(axis=1))
        if bad_rows.size:
            raise ValueError(
                f"table {table!r}: grads hold NaN or Inf in {bad_rows.size} row(s), "
                f"first at position {int(bad_rows[0])}")
    return np.ascontiguousarray(arr)
