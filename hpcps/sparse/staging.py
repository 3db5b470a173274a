"""Staged gradients of stateful tables, and the PS's drain and apply.

Workers add gradients into a staging copy of the rows (shared memory on the
node, ``MPI_Accumulate`` across nodes), flag each row and list the rows not
flagged yet; a push of distinct sorted rows to a PS on the worker's node may
instead go whole into the hand-off slab. The PS, under its shard lock, takes
everything staged (slab, push mailboxes, listed rows) and applies the optimizer
(:func:`apply_staged`, from the serve loop).

Windows of one table (:class:`Staging`): staging rows (float32), touched-row
flags (uint8), the staged-row list (int64: ``[0]`` rows listed, -1 when it
overflowed and the PS scans the flags; ``[1:]`` the rows) and the slab (int64
``[0]`` rows in it, 0: empty, ``[1]`` unused; int64 rows[cap]; float32
grads[cap, dim]).
"""

import numpy as np

from ..core.window import Window
from .codec import torch_module, widen

__all__ = ["Staging", "apply_staged", "STAGED_LIST_ROWS", "SLAB_ROWS"]

# staged-row list: up to this many distinct rows staged between two applies are listed, so an
# apply costs O(rows staged), not a scan of the shard's flags; past it, the PS scans
STAGED_LIST_ROWS = 1 << 18
# hand-off slab (float32 pushes, PS on the worker's node): one push of up to this many distinct
# rows, written in order by a worker and applied from there by the PS, instead of scattered into
# the staging rows (the PS's take of those cost ~60 ns a row in cache misses)
SLAB_ROWS = 1 << 18


def listed(n: int, k: int, cap: int) -> int:
    """A staged-row list of ``n`` rows (-1: overflowed) after ``k`` more: ``n + k``, or -1 past ``cap``."""
    return n + k if n >= 0 and n + k <= cap else -1


def _slab_bytes(cap: int, dim: int) -> int:
    """Bytes of a hand-off slab of ``cap`` rows (a multiple of 8)."""
    return 16 + 8 * cap + -(-4 * dim * cap // 8) * 8


def _slab_parts(mem, cap: int, dim: int):
    """``(head, rows, grads)`` of a hand-off slab's bytes ``mem`` holding ``cap`` rows, or None."""
    if mem is None or mem.size != _slab_bytes(cap, dim):
        return None
    head = mem[:16].view(np.int64)
    rows = mem[16:16 + 8 * cap].view(np.int64)
    grads = mem[16 + 8 * cap:16 + 8 * cap + 4 * dim * cap].view(np.float32).reshape(cap, dim)
    return head, rows, grads


class Staging:
    """Staging windows of one stateful table. Collective over the world (allocates windows)."""

    def __init__(self, ctx, local_rows: int, dim: int, what: str, slab: bool):
        self.dim = dim
        P = ctx.num_ps
        self.stage = Window(ctx.world, local_rows * dim * 4, what=f"{what} staging")
        self.flags = Window(ctx.world, -(-local_rows // 8) * 8, what=f"{what} touched rows")
        self.list_cap = min(local_rows, STAGED_LIST_ROWS) if ctx.is_ps else 0
        cap = ctx.world.allgather(self.list_cap)
        self.list_caps = [cap[r] for r in ctx.ps_world_ranks]
        self.list = Window(ctx.world, (1 + self.list_cap) * 8 if ctx.is_ps else 0, what=f"{what} staged-row list")
        self.slab = None
        if slab:
            self.slab_cap = min(local_rows, SLAB_ROWS) if ctx.is_ps else 0
            cap = ctx.world.allgather(self.slab_cap)
            self.slab_caps = [cap[r] for r in ctx.ps_world_ranks]
            self.slab = Window(ctx.world, _slab_bytes(self.slab_cap, dim) if ctx.is_ps else 0,
                               what=f"{what} hand-off slab")
        if ctx.is_ps:
            self.stage.local()[:] = 0
            self.flags.local(np.uint8)[:] = 0
            self.list.local(np.int64)[:] = 0
            self.list.sync()
            if self.slab is not None:
                self.slab.local(np.int64)[:2] = 0
                self.slab.sync()
            self.stage.sync()
            self.flags.sync()
        # worker: each PS's windows on this node (None: reached over RMA)
        self.views = self.flag_views = self.list_views = self.slab_views = [None] * P
        self._local = None                  # PS: views of its own memory (local())

    def map(self, ranks, sizes) -> None:
        """Worker: map the staging of the PS ranks in ``ranks`` (None: not on this node); ``sizes``:
        their staging floats. Local."""
        self.views = self.stage.map_shared(ranks, sizes, np.float32, self.dim)
        near = [r if v is not None else None for r, v in zip(ranks, self.views)]
        self.flag_views = [None if r is None else self.flags.shared(r, np.uint8) for r in near]
        self.list_views = [None if r is None else self.list.shared(r, np.int64) for r in near]
        if self.slab is not None:
            self.slab_views = [None if r is None else _slab_parts(self.slab.shared(r, np.uint8, _slab_bytes(cap, self.dim)), cap, self.dim)
                               for r, cap in zip(near, self.slab_caps)]

    @property
    def nbytes(self) -> int:
        """Bytes of this rank's staging windows. Local."""
        return sum(w.nbytes for w in (self.stage, self.flags, self.list, self.slab) if w is not None)

    # ------------------------------------------------------------ worker side, same node
    def list_rows(self, p: int, new: np.ndarray) -> None:
        """Worker holding PS ``p``'s shard lock, PS on this node: add ``new`` (unique rows whose flag
        was clear) to its staged-row list, or mark the list overflowed. Local."""
        if new.size == 0:
            return
        view = self.list_views[p]
        self.list.sync()
        n = int(view[0])
        view[0] = listed(n, new.size, self.list_caps[p])
        if view[0] > 0:
            view[1 + n:1 + n + new.size] = new
        self.list.sync()

    def to_slab(self, p: int, rows_p: np.ndarray, g_p: np.ndarray) -> bool:
        """Worker holding PS ``p``'s shard lock, PS on this node: write one push of distinct sorted
        rows into its hand-off slab if the slab is empty and large enough; False when not. Local."""
        slab = self.slab_views[p]
        if slab is None or rows_p.size > slab[1].size:
            return False
        head, rows, grads = slab
        self.slab.sync()
        if head[0] != 0:
            return False
        k = rows_p.size
        rows[:k] = rows_p
        grads[:k] = g_p
        self.slab.sync()             # the rows before the count that announces them
        head[0] = k
        self.slab.sync()
        return True

    # ------------------------------------------------------------ PS side
    def local(self):
        """PS: ``(stage, flags, list, slab)``, this rank's memory (the slab as ``(head, rows, grads)``,
        or None without one): made once, since a window's memory stays put until ``free()``. Local."""
        if self._local is None:
            stage = self.stage.local().reshape(-1, self.dim)
            slab = _slab_parts(self.slab.local(np.uint8), self.slab_cap, self.dim) if self.slab is not None else None
            self._local = (stage, self.flags.local(np.uint8)[:stage.shape[0]], self.list.local(np.int64), slab)
        return self._local

    def take(self, mailbox, stats):
        """PS holding its own shard lock: the staged rows and their summed gradients, which are
        reset to zero; None when nothing is staged. ``mailbox``: the table's push mailbox
        (:class:`hpcps.sparse.mailbox.Mailbox`) or None; its 16-bit gradients are widened to
        float32 here. Counts in ``stats`` how the rows were found. Local."""
        if self.stage.freed:
            return None
        stage, flags, listed_, slab = self.local()
        self.stage.sync()
        self.flags.sync()
        self.list.sync()
        mailed = [(rows, widen(grads, mailbox.dtype) if grads.dtype == np.uint16 else grads)
                  for rows, grads in (mailbox.drain() if mailbox is not None else ())]
        if mailed and int(listed_[0]) == 0 and (slab is None or int(slab[0][0]) == 0):
            stats.applies_mailbox += 1          # nothing else staged: sum the mailed pushes, no scatter
            return _merge(mailed, self.dim)
        for rows, grads in mailed:
            self._stage_here(stage, flags, listed_, rows, grads, rows)      # a push's rows are distinct
        taken = self._take_slab(slab, stage, flags, listed_, stats)
        if taken is not None:
            return taken
        n = int(listed_[0])
        rows = np.sort(listed_[1:1 + n]) if n >= 0 else np.flatnonzero(flags)
        if n < 0:
            stats.applies_scanned += 1
        elif n:
            stats.applies_listed += 1
        listed_[0] = 0
        self.list.sync()
        if rows.size == 0:
            return None
        grads = stage[rows]
        stage[rows] = 0
        flags[rows] = 0
        self.stage.sync()
        self.flags.sync()
        return rows, grads

    def _take_slab(self, slab, stage, flags, listed_, stats):
        """Inside :meth:`take`: empty the hand-off ``slab``. When nothing else is staged, return its
        ``(rows, grads)`` (one push's distinct rows: what the apply needs as they are); else add it
        to the staged gradients, flag and list its rows, and return None."""
        if slab is None:
            return None
        head, rows, grads = slab
        self.slab.sync()
        k = int(head[0])
        if k == 0:
            return None
        rows, grads = rows[:k].copy(), grads[:k].copy()
        head[0] = 0
        self.slab.sync()
        if int(listed_[0]) == 0:
            stats.applies_slab += 1
            return rows, grads
        self._stage_here(stage, flags, listed_, rows, grads, rows)
        return None

    def _stage_here(self, stage, flags, listed_, rows: np.ndarray, grads: np.ndarray, uniq: np.ndarray) -> None:
        """PS holding its own shard lock: add ``grads`` to the staged gradients of ``rows`` (whose
        distinct values are ``uniq``), flag and list the rows not staged yet."""
        torch = torch_module()
        torch.from_numpy(stage).index_add_(0, torch.from_numpy(rows), torch.from_numpy(grads))
        new = uniq[flags[uniq] == 0]
        flags[new] = 1
        n = int(listed_[0])
        listed_[0] = listed(n, new.size, self.list_cap)
        if listed_[0] > 0:
            listed_[1 + n:1 + n + new.size] = new

    def free(self) -> None:
        """Collective over the world; safe twice."""
        self._local = None
        self.views = self.flag_views = self.list_views = self.slab_views = [None] * len(self.views)
        if self.slab is not None:
            self.slab.free()
        self.list.free()
        self.flags.free()
        self.stage.free()


def sum_rows(dim: int, rows: np.ndarray, grads: np.ndarray, alpha: float = 1.0):
    """The distinct rows of ``rows`` (sorted) and ``alpha`` times the sum of each one's ``grads``. Local."""
    torch = torch_module()
    uniq, inverse = np.unique(rows, return_inverse=True)
    sums = torch.zeros((uniq.size, dim), dtype=torch.float32)
    sums.index_add_(0, torch.from_numpy(inverse.reshape(-1)), torch.from_numpy(grads), alpha=alpha)
    return uniq, sums.numpy()


def _merge(pushes, dim: int):
    """``(rows, grads)`` of several pushes (each of distinct sorted rows): one push's as they are, or
    the distinct rows of all and each one's summed gradients, added in the pushes' order."""
    if len(pushes) == 1:
        return pushes[0]
    return sum_rows(dim, np.concatenate([r for r, _ in pushes]), np.concatenate([g for _, g in pushes]))


def apply_staged(ctx, tables, step: int, stamp: int | None = None) -> int:
    """PS: apply the gradients staged in this rank's shards of ``tables``; returns the rows updated.
    Local; called from the serve loop (``StepControl.service``).

    Staged sums of every table are taken and zeroed under the shard lock in one
    acquisition, so a worker's push (all tables of a step, :func:`hpcps.sparse.push.push_many`)
    lands either wholly in this apply or wholly in the next one. ``stamp`` (default
    ``step + 1``) is an upper bound on ``step + 1`` of the pushes applied (``track_versions``).
    """
    me = ctx.rank
    locks = ctx.shard_locks
    if locks.pending(me) == 0 and not any(t.mailbox is not None and t.mailbox.ready() for t in tables):
        return 0
    locks.acquire(me)
    try:
        taken = [(t, t.staging.take(t.mailbox, t.stats) if t.staging is not None else None) for t in tables]
        locks.pending(me, reset=True)
    finally:
        locks.release(me)
    rows = 0
    for t, got in taken:
        if got is not None:
            t.apply(*got, step, stamp)
            rows += got[0].size
    ctx.rows_applied += rows
    return rows
