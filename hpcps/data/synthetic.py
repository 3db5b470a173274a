"""Synthetic CTR data with a planted ground-truth model (the embedded default).

Sample ids are Zipf-distributed per table, wrapped modulo the table's rows
(``(zipf(a) - 1) % rows``), drawn by inverse transform from that distribution's
table (tables up to ``CDF_ROWS`` rows; larger ones call ``Generator.zipf``). The tables are
``num_tables`` of ``rows_per_table`` rows, or one per entry of ``table_rows`` (``data.table_rows``,
times ``data.scale``: :func:`synthetic_rows`), each with its own distribution. A click is drawn from
``sigmoid(bias + sum_t a_t[id_t] + dense . v)`` where ``a_t`` (one scalar per
row) and ``v`` are fixed by the seed, so the best achievable AUC on the eval
set is known: the AUC of the planted probabilities themselves.

Global batch ``b`` is a pure function of ``(seed, b)``; each worker takes its
slice, so the data seen is the same whatever the number of workers. A batch is
drawn in blocks of ``BLOCK`` samples, each from its own seed ``(seed, stream,
b, block)``, and a worker draws only the blocks its slice overlaps (not the
whole global batch). With ``raw_keys`` a batch's ids are 64-bit keys salted per column
(:func:`hpcps.data.hashing.salted_keys`), as a reader gives a dynamic table.
"""

import math
from functools import cached_property, lru_cache

import numpy as np

from ..core.ids import initial_rows
from .base import Batch, DataSource, worker_slice
from .hashing import salted_keys

__all__ = ["SyntheticCTR", "BLOCK", "CDF_ROWS", "wrapped_zipf_cdf", "synthetic_rows"]

BLOCK = 256
CDF_ROWS = 1 << 22          # tables up to this many rows sample ids from a table of the CDF
GUIDE = 1 << 16             # buckets of the CDF's guide table (SyntheticCTR._inverse_cdf)
PLANTED_ENTRIES = 1 << 24   # planted row weights kept in memory up to this many (tables x rows)


@lru_cache(maxsize=64)
def wrapped_zipf_cdf(a: float, rows: int) -> np.ndarray:
    """CDF (float64, last entry 1, read-only) of ``(X - 1) % rows`` for ``X ~ Zipf(a)``, computed
    once per process (a job rebuilt after a lost rank samples from the same). Local.

    P(k) is proportional to the sum over j >= 0 of ``(k + 1 + j * rows) ** -a``: the
    first J terms exactly, the rest by the integral from J - 1/2 (midpoint rule).
    """
    k1 = np.arange(1, rows + 1, dtype=np.float64)
    J = max(8, -(-(1 << 20) // rows))
    if J > 8:      # small tables: the 2^20 terms at once, summed over j in order (the loop's bits)
        pmf = (np.arange(1, rows * J + 1, dtype=np.float64).reshape(J, rows) ** -a).sum(axis=0)
    else:
        pmf = np.zeros(rows, np.float64)
        for j in range(J):
            pmf += (k1 + j * rows) ** -a
    pmf += (k1 + (J - 0.5) * rows) ** (1 - a) / (rows * (a - 1))
    cdf = np.cumsum(pmf)
    cdf /= cdf[-1]
    cdf[-1] = 1.0
    cdf.flags.writeable = False
    return cdf


def synthetic_rows(cfg) -> list[int]:
    """Each table's rows of a ``DataConfig``: ``table_rows``, else ``num_tables`` x ``rows_per_table``,
    times ``scale`` rounded up. Local, pure."""
    rows = list(cfg.table_rows) or [cfg.rows_per_table] * cfg.num_tables
    return [max(1, math.ceil(r * cfg.scale)) for r in rows] if cfg.scale != 1 else rows


class SyntheticCTR(DataSource):
    task = "ctr"
    steps_per_epoch = None

    def __init__(self, num_tables: int, rows_per_table: int, num_dense: int, batch_size: int,
                 eval_samples: int, zipf: float, seed: int, num_workers: int, worker: int,
                 signal: float = 1.0, bias: float = -1.0, raw_keys: bool = False, table_rows=None):
        rows = list(table_rows) if table_rows else [rows_per_table] * num_tables
        if not rows or min(rows) < 1 or num_dense < 0:
            raise ValueError("synthetic data needs num_tables >= 1, rows_per_table >= 1, num_dense >= 0")
        if zipf <= 1:
            raise ValueError(f"data.zipf must be > 1, got {zipf}")
        self.tables = [(f"cat{t}", r) for t, r in enumerate(rows)]
        self.num_dense, self.batch_size, self.seed = num_dense, batch_size, seed
        self.raw_keys = raw_keys
        self.eval_samples, self.zipf, self.signal, self.bias = eval_samples, zipf, signal, bias
        self._slice = worker_slice(batch_size, num_workers, worker)
        self._v = initial_rows(seed, "planted/dense", np.arange(max(num_dense, 1)), 1, scale=signal)[:num_dense, 0]
        self.stats = {}

    # computed on first use: ranks that only need the table sizes (PS ranks) never build them
    @cached_property
    def _cdfs(self) -> dict:
        """``{rows: (the ids' CDF, its guide)}`` of each row count up to ``CDF_ROWS`` (larger tables
        call ``Generator.zipf``). The guide: ``guide[k]`` = ``searchsorted(cdf, k / GUIDE,
        side="right")`` for ``k`` in ``[0, GUIDE]``, where the search for any ``u`` in ``[k / GUIDE,
        (k + 1) / GUIDE)`` starts (:meth:`_inverse_cdf`)."""
        out = {}
        for rows in {r for _, r in self.tables if r <= CDF_ROWS}:
            cdf = wrapped_zipf_cdf(self.zipf, rows)
            out[rows] = (cdf, np.searchsorted(cdf, np.arange(GUIDE + 1) / GUIDE, side="right"))
        return out

    @cached_property
    def _planted(self) -> list | None:
        """Every table's planted row weights (up to ``PLANTED_ENTRIES`` in all), else None."""
        if sum(r for _, r in self.tables) > PLANTED_ENTRIES:
            return None
        return [self._weights(t, np.arange(rows)) for t, (_, rows) in enumerate(self.tables)]

    def _inverse_cdf(self, u: np.ndarray, rows: int) -> np.ndarray:
        """``searchsorted(cdf, u, side="right")`` for ``u`` in ``[0, 1)`` and the CDF of ``rows``, the
        same ids: a guide table gives each draw its first candidate, and the few draws whose bucket
        spans several rows step forward to theirs (a binary search per draw cost ~4x as much)."""
        (cdf, guide), flat = self._cdfs[rows], u.reshape(-1)
        k = (flat * GUIDE).astype(np.intp)       # exact: GUIDE is a power of two
        ids = guide[k]
        todo = np.flatnonzero(ids < guide[k + 1])
        while todo.size:
            todo = todo[cdf[ids[todo]] <= flat[todo]]
            ids[todo] += 1
        return ids.reshape(u.shape)

    def _weights(self, t: int, ids: np.ndarray) -> np.ndarray:
        """Planted weights of rows ``ids`` of table ``t`` (float32, a pure function of the seed)."""
        return initial_rows(self.seed, f"planted/{t}", ids, 1, scale=self.signal)[:, 0]

    def _block(self, stream: int, b: int, k: int, n: int):
        """The draws of samples ``[k * BLOCK, k * BLOCK + n)`` of batch ``b`` of ``stream``."""
        rng = np.random.default_rng([self.seed, stream, b, k])
        sizes = {r for _, r in self.tables}
        if len(sizes) == 1 and sizes <= set(self._cdfs):       # one size, one array of draws
            rows = sizes.pop()
            ids = list(np.minimum(self._inverse_cdf(rng.random((len(self.tables), n)), rows), rows - 1))
        else:                                                 # table by table, each its own draws
            ids = [np.minimum(self._inverse_cdf(rng.random(n), rows), rows - 1) if rows in self._cdfs
                   else (rng.zipf(self.zipf, n) - 1) % rows for _, rows in self.tables]
        dense = rng.normal(size=(n, self.num_dense)).astype(np.float32)
        return ids, dense, rng.random(n)

    def _part(self, stream: int, b: int, n: int, sl: slice) -> Batch:
        """Samples ``sl`` of the ``n`` of batch ``b``: only the blocks they overlap are drawn."""
        first = sl.start // BLOCK
        last = max(-(-sl.stop // BLOCK), first + 1)   # at least one block: an empty slice keeps its shapes
        blocks = [self._block(stream, b, k, max(min(BLOCK, n - k * BLOCK), 0)) for k in range(first, last)]
        lo, hi = sl.start - first * BLOCK, sl.stop - first * BLOCK

        def cat(parts):
            return np.concatenate(parts)[lo:hi]
        sparse = [cat([x[0][t] for x in blocks]).astype(np.int64) for t in range(len(self.tables))]
        dense, u = cat([x[1] for x in blocks]), cat([x[2] for x in blocks])
        logit = np.full(dense.shape[0], self.bias, dtype=np.float64)
        for j, v in enumerate(self._v):         # column by column: the same bits whatever the slice
            logit += dense[:, j] * v
        for t, ids in enumerate(sparse):
            logit += self._planted[t][ids] if self._planted is not None else self._weights(t, ids)
        p = 1 / (1 + np.exp(-logit))
        if self.raw_keys:
            sparse = [salted_keys(ids, t) for t, ids in enumerate(sparse)]
        return Batch(dense, sparse, (u < p).astype(np.float32), p)

    def train_batch(self, step: int) -> Batch:
        return self._part(0, step, self.batch_size, self._slice)

    def eval_batches(self):
        B = self.batch_size
        for b, start in enumerate(range(0, self.eval_samples, B)):
            n = min(B, self.eval_samples - start)
            yield self._part(1, b, n, slice(self._slice.start * n // B, self._slice.stop * n // B))
