"""Argument checks for pull/push, run before any communication. Pure.

Each failure is a ``ValueError`` that names the table and the problem; a
call that fails here has not touched the table.
"""

import numpy as np

__all__ = ["as_ids", "as_id_rows", "as_grads", "grads_ok", "GRAD_LIMIT"]


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


GRAD_LIMIT = 1e19           # ~sqrt(float32's largest): a larger gradient's square is inf


def grads_ok(arr: np.ndarray) -> bool:
    """Whether float32 ``arr``'s sum of squares is finite: every value finite and none beyond
    :data:`GRAD_LIMIT` (false also for some large sums: :func:`as_grads` then looks closer). Local."""
    flat = arr.reshape(-1)
    return not flat.size or bool(np.isfinite(np.dot(flat, flat)))


def as_grads(table: str, grads, n: int, dim: int) -> np.ndarray:
    """Checked gradients as a C-contiguous float32 ``(n, dim)`` array. Local."""
    arr = _to_numpy(grads)
    if arr.dtype != np.float32:
        raise ValueError(f"table {table!r}: grads must be float32, got dtype {arr.dtype}")
    if arr.shape != (n, dim):
        raise ValueError(
            f"table {table!r}: grads must have shape ({n}, {dim}) for {n} ids, got {arr.shape}")
    if not grads_ok(arr):
        # One dot product is cheap (it is inf where a square overflows); find the offending row only
        # on the rare bad path: an optimizer's state (Adagrad's and Adam's squares) holds g * g in
        # float32, so a gradient beyond GRAD_LIMIT would make it inf and freeze the row for good
        bad_rows = np.flatnonzero(~np.isfinite(arr).all(axis=1))
        if bad_rows.size:
            raise ValueError(
                f"table {table!r}: grads hold NaN or Inf in {bad_rows.size} row(s), "
                f"first at position {int(bad_rows[0])} (a diverging model? lower the learning rate)")
        huge = np.flatnonzero((np.abs(arr) > GRAD_LIMIT).any(axis=1))
        if huge.size:
            raise ValueError(
                f"table {table!r}: grads of magnitude {float(np.abs(arr).max()):.3g} in {huge.size} row(s), first at "
                f"position {int(huge[0])}: above {GRAD_LIMIT:.0e}, whose square overflows float32 (a diverging "
                f"model? lower the learning rate)")
    return np.ascontiguousarray(arr)
