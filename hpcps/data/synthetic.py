"""Synthetic CTR data with a planted ground-truth model (the embedded default).

Sample ids are Zipf-distributed per table, wrapped modulo the table's rows
(``(zipf(a) - 1) % rows``), drawn by inverse transform from that distribution's
table (tables up to ``CDF_ROWS`` rows; larger ones call ``Generator.zipf``). A click is drawn from
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

from functools import cached_property

import numpy as np

from ..core.ids import initial_rows
from .base import Batch, DataSource, worker_slice
from .hashing import salted_keys

__all__ = ["SyntheticCTR", "BLOCK", "CDF_ROWS", "wrapped_zipf_cdf"]

BLOCK = 256
CDF_ROWS = 1 << 22          # tables up to this many rows sample ids from a table of the CDF
GUIDE = 1 << 16             # buckets of the CDF's guide table (SyntheticCTR._inverse_cdf)
PLANTED_ENTRIES = 1 << 24   # planted row weights kept in memory up to this many (tables x rows)


def wrapped_zipf_cdf(a: float, rows: int) -> np.ndarray:
    """CDF (float64, last entry 1) of ``(X - 1) % rows`` for ``X ~ Zipf(a)``. Local.

    P(k) is proportional to the sum over j >= 0 of ``(k + 1 + j * rows) ** -a``: the
    first J terms exactly, the rest by the integral from J - 1/2 (midpoint rule).
    """
    k1 = np.arange(1, rows + 1, dtype=np.float64)
    J = max(8, -(-(1 << 20) // rows))
    pmf = np.zeros(rows, np.float64)
    for j in range(J):
        pmf += (k1 + j * rows) ** -a
    pmf += (k1 + (J - 0.5) * rows) ** (1 - a) / (rows * (a - 1))
    cdf = np.cumsum(pmf)
    cdf /= cdf[-1]
    cdf[-1] = 1.0
    return cdf


class SyntheticCTR(DataSource):
    task = "ctr"
    steps_per_epoch = None

    def __init__(self, num_tables: int, rows_per_table: int, num_dense: int, batch_size: int,
                 eval_samples: int, zipf: float, seed: int, num_workers: int, worker: int,
                 signal: float = 1.0, bias: float = -1.0, raw_keys: bool = False):
        if num_tables < 1 or rows_per_table < 1 or num_dense < 0:
            raise ValueError("synthetic data needs num_tables >= 1, rows_per_table >= 1, num_dense >= 0")
        if zipf <= 1:
            raise ValueError(f"data.zipf must be > 1, got {zipf}")
        self.tables = [(f"cat{t}", rows_per_table) for t in range(num_tables)]
        self.num_dense, self.batch_size, self.seed = num_dense, batch_size, seed
        self.raw_keys = raw_keys
        self.eval_samples, self.zipf, self.signal, self.bias = eval_samples, zipf, signal, bias
        self._slice = worker_slice(batch_size, num_workers, worker)
        self._v = initial_rows(seed, "planted/dense", np.arange(max(num_dense, 1)), 1, scale=signal)[:num_dense, 0]
        self.stats = {}

    # computed on first use: ranks that only need the table sizes (PS ranks) never build them
    @cached_property
    def _cdf(self) -> np.ndarray | None:
        """The ids' CDF (tables up to ``CDF_ROWS`` rows), else None: ``Generator.zipf``."""
        rows = self.tables[0][1]
        return wrapped_zipf_cdf(self.zipf, rows) if rows <= CDF_ROWS else None

    @cached_property
    def _planted(self) -> np.ndarray | None:
        """Every table's planted row weights (up to ``PLANTED_ENTRIES`` in all), else None."""
        rows = self.tables[0][1]
        if len(self.tables) * rows > PLANTED_ENTRIES:
            return None
        return np.stack([self._weights(t, np.arange(rows)) for t in range(len(self.tables))])

    @cached_property
    def _guide(self) -> np.ndarray:
        """``_guide[k]`` = ``searchsorted(_cdf, k / GUIDE, side="right")`` for ``k`` in ``[0, GUIDE]``:
        where the search for any ``u`` in ``[k / GUIDE, (k + 1) / GUIDE)`` starts (:meth:`_inverse_cdf`)."""
        return np.searchsorted(self._cdf, np.arange(GUIDE + 1) / GUIDE, side="right")

    def _inverse_cdf(self, u: np.ndarray) -> np.ndarray:
        """``searchsorted(_cdf, u, side="right")`` for ``u`` in ``[0, 1)``, the same ids: a guide table
        gives each draw its first candidate, and the few draws whose bucket spans several rows step
        forward to theirs (a binary search per draw cost ~4x as much)."""
        cdf, guide, flat = self._cdf, self._guide, u.reshape(-1)
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
        if self._cdf is not None:
            ids = self._inverse_cdf(rng.random((len(self.tables), n)))
            ids = list(np.minimum(ids, self._cdf.size - 1))
        else:
            ids = [(rng.zipf(self.zipf, n) - 1) % rows for _, rows in self.tables]
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
