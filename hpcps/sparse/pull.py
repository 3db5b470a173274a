"""The pull path: reading rows from the PS ranks that own them.

``EmbeddingTable.pull_async(ids)`` -> :func:`pull_async`: validate ids -> if
every shard is in this node's shared memory, a numpy gather straight from it
(:func:`gather_node`); else deduplicate, place each id (``table.sharding``:
owner PS, row in its shard), gather the rows of PS ranks on this node, and
issue one ``MPI_Rget_accumulate(NO_OP)`` (or ``MPI_Rget``, ``rma_read="get"``)
per remote owner with an indexed datatype (or, ``rma_read="messages"``, ask the owner for them:
``pull_server.py``) -> :meth:`PullHandle.wait`
completes them and scatters back through the inverse.
"""

import time

import numpy as np
from mpi4py import MPI

from ..core.wait import backoff, overdue
from .codec import widen
from .validate import as_ids

__all__ = ["PullHandle", "pull_async", "gather_local", "complete"]


def complete(requests) -> None:
    """Wait for RMA requests, pausing between tests (``hpcps.core.wait``): on a core shared with the
    model's compute (a communication thread, an oversubscribed node) a blocking flush would spin on
    it. Local."""
    misses, started = 0, time.monotonic()
    while requests and not MPI.Request.Testall(requests):
        misses += 1
        backoff(misses)
        overdue(started, misses, f"{len(requests)} RMA read(s) of a pull to complete")


class PullHandle:
    """Result of :meth:`EmbeddingTable.pull_async`; ``wait()`` returns the rows."""

    def __init__(self, table, out, pending=(), finish=None, started=0.0):
        self._table, self._out, self._pending, self._finish = table, out, list(pending), finish
        self._started = started
        self._done = not self._pending

    def test(self) -> bool:
        """True when ``wait()`` would not block on communication. Local."""
        return self._done

    def wait(self) -> np.ndarray:
        """Complete the pull; returns float32 ``(len(ids), dim)``. Local; idempotent."""
        if not self._done:
            complete([req for req, _, _, _ in self._pending])
            for _, dtype, into, buf in self._pending:
                if dtype is not None:           # (a pull by messages has none)
                    dtype.Free()
                into(buf)
            self._pending.clear()
            self._done = True
        if self._finish is not None:
            self._out, self._finish = self._finish(self._out), None
            self._table.stats.pull_seconds += time.perf_counter() - self._started
        return self._out


def pull_async(table, ids, full: bool = False) -> PullHandle:
    """:meth:`EmbeddingTable.pull_async`. Worker ranks; local (one-sided)."""
    table.check_worker("pull")
    ids = as_ids(table.name, ids, table.num_rows)
    started = time.perf_counter()
    st = table.stats
    st.pulls += 1
    st.pull_rows += ids.size
    dim = table.dim
    half = table.half if table.half is not None and not full else None
    if half is not None:
        window, views, npt, mpit, rowtype = half.window, half.views, np.uint16, MPI.UINT16_T, half.rowtype
    else:
        window, views, npt, mpit, rowtype = table.rows, table.row_views, np.float32, MPI.FLOAT, table.rowtype
    out = np.empty((ids.size, dim), dtype=npt)
    if ids.size == 0:
        return PullHandle(table, out if half is None else widen(out, half.dtype))
    if all(v is not None for v in views):                       # whole table on this node
        gather_node(table, ids, out, window, views)
        if half is not None:
            out = widen(out, half.dtype)
        st.pull_seconds += time.perf_counter() - started
        return PullHandle(table, out)

    uniq, inverse = np.unique(ids, return_inverse=True)
    owner, local = table.sharding.place(uniq)
    rows = np.empty((uniq.size, dim), dtype=npt)
    pending = []
    win = window.win
    row_bytes = dim * rows.itemsize
    for p in np.unique(owner).tolist():
        sel = np.flatnonzero(owner == p)
        st.rows_per_ps[p] += sel.size
        st.bytes_per_ps[p] += sel.size * row_bytes
        if views[p] is not None:
            rows[sel] = np.take(views[p], local[sel], axis=0)
            continue
        if table.rma_read == "messages":               # the PS answers (hpcps.sparse.pull_server)
            req, buf = table.ctx.pull_server.request(table, p, local[sel], half is not None)
            pending.append((req, None, lambda b, sel=sel: rows.__setitem__(sel, b), buf))
            continue
        rank = table.ctx.ps_world_ranks[p]
        buf = np.empty((sel.size, dim), dtype=npt)
        dtype = rowtype.Create_hindexed_block(1, (local[sel] * row_bytes).tolist()).Commit()
        if table.rma_read == "get":
            req = win.Rget([buf, mpit], rank, (0, 1, dtype))
        else:
            req = win.Rget_accumulate([buf, mpit], [buf, mpit], rank, (0, 1, dtype), op=MPI.NO_OP)
        pending.append((req, dtype, lambda b, sel=sel: rows.__setitem__(sel, b), buf))
    if half is None:
        finish = lambda r: r[inverse]  # noqa: E731
    else:
        finish = lambda r: widen(r[inverse], half.dtype)  # noqa: E731
    return PullHandle(table, rows, pending, finish=finish, started=started)


def gather_local(table, ids: np.ndarray, out: np.ndarray) -> None:
    """``pull(ids)`` into ``out`` for a table whose float32 shards are all on this node
    (``table.node_local``), without the checks: ``ids`` must be int64 in ``[0, num_rows)`` and
    ``out`` float32 ``(len(ids), dim)``. Worker ranks; local. For callers that validated many
    tables' ids at once (:class:`hpcps.nn.ShardedEmbeddingCollection`); counted like a pull."""
    table.check_worker("pull")
    started = time.perf_counter()
    st = table.stats
    st.pulls += 1
    st.pull_rows += ids.size
    gather_node(table, ids, out, table.rows, table.row_views)
    st.pull_seconds += time.perf_counter() - started


def gather_node(table, ids: np.ndarray, out: np.ndarray, window, views: list) -> None:
    """Read rows ``ids`` from ``window``'s shards, every PS's mapped in ``views`` (this node),
    into ``out``. Local."""
    st, P = table.stats, table.ctx.num_ps
    if ids.size == 0:
        return
    window.sync()
    if P == 1:
        # mode="clip": the ids are checked already, and numpy buffers `out` under the default
        # mode="raise" (a take into a given array ran at ~0.78x one that returns a new one)
        np.take(views[0], ids, axis=0, out=out, mode="clip")
        st.rows_per_ps[0] += ids.size
        st.bytes_per_ps[0] += out.nbytes
        return
    owner, local = table.sharding.place(ids)
    for p in range(P):
        sel = np.flatnonzero(owner == p)
        if sel.size:
            out[sel] = np.take(views[p], local[sel], axis=0)
            st.rows_per_ps[p] += sel.size
            st.bytes_per_ps[p] += sel.size * table.dim * out.itemsize
