"""The push path: gradients to the PS ranks that own the rows, through three transports.

:func:`push_many` validates every push, splits it by owner (``table.sharding``)
and prepares each part before any lock is taken (:func:`push_parts`); then, per
PS, it takes that PS's shard lock once for every table and writes each part
(:func:`push_locked`):

- PS on this node: the hand-off slab (stateful, one push of distinct rows,
  :meth:`Staging.to_slab`), else ``index_add_`` into shared memory (the staging
  rows, or the weights with ``-lr`` for plain SGD) and the staged-row list;
- PS on another node, stateful table: this worker's slot in its push mailbox
  (``MPI_Put``, no lock: :mod:`hpcps.sparse.mailbox`), when the push fits;
- PS on another node otherwise: one ``MPI_Accumulate(SUM)`` with an indexed
  datatype of the summed gradients (duplicates summed first, so no two targets
  overlap), under the lock.

Deterministic sync mode (``hpcps.init(deterministic=True)``): every table is stateful and every
part goes through this worker's mailbox slot at its PS, same node or not (no lock), so the PS sums
the workers' gradients in worker order.
"""

import time

import numpy as np
from mpi4py import MPI

from ..core.settings import F32_MAX as _F32_MAX
from .codec import narrow, torch_module, widen
from .staging import listed, sum_rows
from .validate import as_grads, as_ids

__all__ = ["PushHandle", "push_many", "push_many_checked", "push_parts"]


class PushHandle:
    """Result of :meth:`EmbeddingTable.push_async`. Local."""

    def test(self) -> bool:
        return True

    def wait(self) -> None:
        """Pushes complete before ``push_async`` returns today; kept for the async API."""
        return None


def push_many(pushes) -> None:
    """Push to several tables in one go: ``pushes`` is ``[(table, ids, grads), ...]``, each as
    :meth:`EmbeddingTable.push_async`. Worker ranks; local (one-sided).

    Every push is validated before any communication (a bad one raises ``ValueError``
    and nothing is pushed). Then each PS's shard lock, shared by all tables of a
    context, is taken once for all the tables' rows it owns, and one staged push is
    counted: a training step's pushes of N tables cost one lock round trip per PS
    instead of N. Same result as the pushes one by one.
    """
    push_many_checked([(table, ids, grads, False) for table, ids, grads in pushes])


def push_many_checked(pushes) -> None:
    """:func:`push_many` of ``[(table, ids, grads, checked), ...]``: ``checked`` as in
    :func:`push_parts` (True skips that push's checks). Worker ranks; local."""
    if not pushes:
        return
    ctx = pushes[0][0].ctx
    if any(item[0].ctx is not ctx for item in pushes):
        raise ValueError("push_many: all tables must belong to one hpcps context")
    started = time.perf_counter()
    by_ps = {}
    for table, ids, grads, checked in pushes:
        for p, part in push_parts(table, ids, grads, checked):
            by_ps.setdefault(p, []).append((table, part))
    locks = ctx.shard_locks
    for p in sorted(by_ps):
        rank = ctx.ps_world_ranks[p]
        by_ps[p] = _mail(p, rank, by_ps[p])
        if not by_ps[p]:
            continue
        locks.acquire(rank)
        try:
            for table, part in by_ps[p]:
                push_locked(table, p, part)
            if any(table.stateful for table, _ in by_ps[p]):
                locks.add_pending(rank)
        finally:
            locks.release(rank)
    elapsed = time.perf_counter() - started
    for item in pushes:
        item[0].stats.push_seconds += elapsed / len(pushes)


def _mail(p: int, rank: int, parts):
    """Put the parts to PS ``p`` that fit this worker's mailbox slots there (stateful tables, PS on
    another node) into them, every write issued before the first wait; return the other parts."""
    mailed, rest = [], []
    for table, part in parts:
        rows_p, g_p, uniq, buf, _ = part
        box = table.mailbox
        if box is not None and box.ordered:         # deterministic: every part, whole, in pieces
            box.send(p, rank, uniq, buf)
            table.stats.rows_per_ps[p] += rows_p.size
            table.stats.bytes_per_ps[p] += buf.nbytes
        elif box is not None and buf is not None and table.staging.views[p] is None and box.fits(p, uniq.size):
            box.write(p, rank, uniq, buf)
            table.stats.rows_per_ps[p] += rows_p.size
            table.stats.bytes_per_ps[p] += buf.nbytes
            mailed.append(table)
        else:
            rest.append((table, part))
    for table in mailed:
        table.mailbox.post(p, rank)
    return rest


def push_parts(table, ids, grads, checked: bool = False):
    """Validate one push, split it by owner and prepare each part, all before any lock is
    taken: ``[(p, (local rows, grads, their unique rows, summed grads or None, alpha))]``. Local,
    no communication. ``checked``: the caller vouches that ``ids`` are int64, unique, sorted
    and in range and ``grads`` float32, C-contiguous, finite and ``(len(ids), dim)``
    (:class:`hpcps.nn.ShardedEmbeddingCollection` checked them for all its tables at once)."""
    table.check_worker("push")
    if not checked:
        ids = as_ids(table.name, ids, table.num_rows)
        grads = as_grads(table.name, grads, ids.size, table.dim)
    st = table.stats
    st.pushes += 1
    st.push_rows += ids.size
    if ids.size == 0:
        return []
    if table.ctx.num_ps == 1:
        split = [(0, ids, grads)]
    else:
        owner, local = table.sharding.place(ids)
        # a placement keeps each owner's ids in order (sorted ids stay sorted per owner)
        split = [(p, local[sel], grads[sel]) for p in np.unique(owner).tolist()
                 for sel in (np.flatnonzero(owner == p),)]
    return [(p, _prepare(table, p, rows_p, g_p, checked)) for p, rows_p, g_p in split]


def _prepare(table, p: int, rows_p: np.ndarray, g_p: np.ndarray, distinct: bool = False):
    """The work of a push part that needs no lock: unique rows, the factor on the gradient
    (stateful: 1, the PS applies the optimizer; SGD: -lr), and for RMA the summed, scaled
    gradients (one accumulate per row). ``distinct``: the rows are known unique and sorted."""
    alpha = 1.0 if table.stateful else -table.optimizer.lr_at(table.ctx.control.step)
    if alpha != 1.0 and g_p.size and float(np.abs(g_p).max()) * abs(alpha) >= _F32_MAX:
        raise ValueError(f"table {table.name!r}: lr {-alpha} times gradients up to {float(np.abs(g_p).max()):.3g} "
                         f"overflows float32: the rows would become inf; the learning rate is too large")
    # ids already unique and sorted (what ShardedEmbeddingBag pushes) skip the sort
    distinct = distinct or bool(np.all(rows_p[1:] > rows_p[:-1]))
    shared = (table.staging.views if table.stateful else table.row_views)[p] is not None \
        and not table.ctx.deterministic
    if table.push_dtype != "float32":        # stateful: each row's summed gradient, rounded
        uniq, sums = (rows_p, g_p) if distinct else sum_rows(table.dim, rows_p, g_p, alpha)
        half = narrow(sums, table.push_dtype)
        if shared:                          # nothing to save: add the rounded values here
            wide = widen(half, table.push_dtype)
            return uniq, wide, uniq, None, alpha
        return uniq, half, uniq, half, alpha
    if shared:
        return rows_p, g_p, rows_p if distinct else np.unique(rows_p), None, alpha
    if distinct:
        return rows_p, g_p, rows_p, g_p if alpha == 1.0 else g_p * np.float32(alpha), alpha
    uniq, sums = sum_rows(table.dim, rows_p, g_p, alpha)
    return rows_p, g_p, uniq, sums, alpha


def push_locked(table, p: int, part) -> None:
    """Worker holding PS ``p``'s shard lock: add a prepared part (:func:`push_parts`) into its rows
    (stateful: stage it). Local (one-sided)."""
    rows_p, g_p, uniq, buf, alpha = part
    st = table.stats
    rank = table.ctx.ps_world_ranks[p]
    st.rows_per_ps[p] += rows_p.size
    st.bytes_per_ps[p] += g_p.nbytes
    if (table.staging.views if table.stateful else table.row_views)[p] is not None:
        _push_shared(table, p, rank, part)
        return
    if table.mailbox is not None:            # too large for this worker's mailbox slot
        st.inbox_full += 1
    if buf.dtype == np.uint16:              # 16-bit: the same rounded values, as float32
        buf = widen(buf, table.push_dtype)
        st.bytes_per_ps[p] += buf.nbytes - g_p.nbytes
    _push_rma(table, p, rank, uniq, buf)


def _push_shared(table, p: int, rank: int, part) -> None:
    """:func:`push_locked` to a PS on this node: the hand-off slab, or adds into shared memory."""
    rows_p, g_p, uniq, _, alpha = part
    staging = table.staging
    if table.stateful:
        if staging.slab is not None and uniq is rows_p and alpha == 1.0 and staging.to_slab(p, rows_p, g_p):
            return
        window, view = staging.stage, staging.views[p]
    else:
        window, view = table.rows, table.row_views[p]
    torch = torch_module()
    window.sync()
    torch.from_numpy(view).index_add_(0, torch.from_numpy(rows_p), torch.from_numpy(g_p), alpha=alpha)
    if table.stateful:
        flags = staging.flag_views[p]
        staging.flags.sync()
        new = uniq[flags[uniq] == 0]
        flags[new] = 1
        staging.list_rows(p, new)
        staging.flags.sync()
    elif table.dirty is not None:
        table.dirty.views[p][rows_p] = table.dirty.ALL
    window.sync()
    if table.row_versions is not None and not table.stateful:
        table.row_versions.stamp(p, rank, uniq, table.ctx.control.step + 1)


def _push_rma(table, p: int, rank: int, uniq: np.ndarray, buf: np.ndarray) -> None:
    """:func:`push_locked` to a PS on another node: every operation is issued before the first wait,
    so their latencies overlap: the flags and list count are read first (the rows not staged yet go
    on the PS's list), then the gradient, the marks and the list entries are written and flushed
    together."""
    staging = table.staging
    stateful = table.stateful
    window = staging.stage if stateful else table.rows
    marks = staging.flags if stateful else (table.dirty.window if table.dirty is not None else None)
    dtype = table.rowtype.Create_hindexed_block(1, (uniq * (table.dim * 4)).tolist()).Commit()
    flag_type = MPI.BYTE.Create_indexed_block(1, uniq.tolist()).Commit() if marks is not None else None
    try:
        window.win.Accumulate([buf, MPI.FLOAT], rank, (0, 1, dtype), op=MPI.SUM)
        if stateful:
            lst = staging.list.win
            seen, count = np.empty(uniq.size, np.uint8), np.empty(1, np.int64)
            staging.flags.win.Get([seen, MPI.BYTE], rank, (0, 1, flag_type))
            lst.Get([count, MPI.INT64_T], rank, (0, 1, MPI.INT64_T))
            staging.flags.win.Flush(rank)
            lst.Flush(rank)
            new = np.ascontiguousarray(uniq[seen == 0], dtype=np.int64)
            n = int(count[0])
            if new.size:
                count[0] = listed(n, new.size, staging.list_caps[p])
                if count[0] > 0:
                    lst.Put([new, MPI.INT64_T], rank, ((1 + n) * 8, new.size, MPI.INT64_T))
                lst.Put([count, MPI.INT64_T], rank, (0, 1, MPI.INT64_T))
        if marks is not None:
            ones = np.full(uniq.size, 1 if stateful else table.dirty.ALL, np.uint8)   # staged / changed
            marks.win.Put([ones, MPI.BYTE], rank, (0, 1, flag_type))
        window.win.Flush(rank)      # remote completion (a request would only say "buffer free")
        if marks is not None:
            marks.win.Flush(rank)
        if stateful:
            staging.list.win.Flush(rank)
        if not stateful and table.row_versions is not None:
            table.row_versions.stamp(p, rank, uniq, table.ctx.control.step + 1)
    finally:
        dtype.Free()
        if flag_type is not None:
            flag_type.Free()
