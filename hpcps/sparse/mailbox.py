"""Push mailboxes: pushes of stateful tables to a PS on another node, without its shard lock.

A PS keeps a slot for each worker on another node, in a window of its own: a header
``[seq, rows, taken, 0]`` (int64), then ``rows`` int64[cap], then the gradients [cap, dim]
(float32, or the uint16 bit patterns of a 16-bit ``push_dtype``). A worker writes one push's
summed gradients into its slot (``MPI_Put``), flushes, then raises ``seq`` and flushes again.
The PS, under its own shard lock, drains every slot whose ``seq`` is past its ``taken`` into its
staged rows (:meth:`hpcps.sparse.staging.Staging.take`) and sets ``taken``. So a push to another
node costs two round trips; the locked way (lock, gradients, flags, list, count, unlock) took 5-6,
each a network round trip there.

A worker writes its slot again only once the PS took the last write. In sync mode the step
protocol says so (a step begins after the apply of the step before, which drained the slot);
otherwise the worker reads ``taken`` (one more round trip, repeated until it is). A push larger
than the slot goes the locked way (:func:`hpcps.sparse.push.push_locked`).

``ordered`` (deterministic sync mode): every worker has a slot, on the PS's node too, and every
push goes through it (in slot-sized pieces when larger: :meth:`Mailbox.send`); the PS collects
the slots while the step runs (:meth:`Mailbox.collect`) and hands them out in worker order, so
the sum of a row's gradients is formed in the same order whatever order they arrived in.
"""

import os
import time

import numpy as np
from mpi4py import MPI

from ..core import settings
from ..core import wait as _wait
from ..core.window import Window

__all__ = ["Mailbox", "MAILBOX_BYTES", "MIN_SLOT_ROWS"]

MAILBOX_BYTES = settings.MAILBOX_BYTES      # per table and PS: every slot together at most this (the slot
                                            # shrinks); $HPCPS_MAILBOX_BYTES overrides it (tests: pieces
                                            # of ordered pushes)
MIN_SLOT_ROWS = settings.MIN_SLOT_ROWS      # a slot of fewer rows than this (and than the shard) is not made
_HEAD = settings.MAILBOX_HEAD


class Mailbox:
    """The push mailboxes of one stateful table. Collective over the world (allocates a window).

    ``shard_rows[p]``: rows of PS ``p``'s shard; ``dtype``: ``"float32"`` or the 16-bit
    ``push_dtype`` (then gradients travel as their bit patterns)."""

    def __init__(self, ctx, shard_rows, dim: int, dtype: str, what: str, ordered: bool = False):
        self.ctx, self.dim, self.dtype, self.ordered = ctx, dim, dtype, ordered
        self.esize = 4 if dtype == "float32" else 2
        node = ctx.node_of_rank
        row_bytes = 8 + dim * self.esize
        budget = int(os.environ.get("HPCPS_MAILBOX_BYTES", MAILBOX_BYTES))
        self.caps, self.slots = [], []          # per PS: rows per slot; {worker: slot}
        for p, prank in enumerate(ctx.ps_world_ranks):
            far = [w for w, r in enumerate(ctx.worker_world_ranks)
                   if ordered or ctx.transport == "rma" or node[r] != node[prank]]
            cap = settings.mailbox_slot_rows(shard_rows[p], len(far), row_bytes, budget, MIN_SLOT_ROWS, ordered)
            far = far if cap or not shard_rows[p] else []
            self.caps.append(cap)
            self.slots.append({w: i for i, w in enumerate(far)})
        me = ctx.ps_rank
        self.slot_bytes = [settings.mailbox_slot_bytes(c, dim, self.esize) for c in self.caps]
        nbytes = len(self.slots[me]) * self.slot_bytes[me] if ctx.is_ps and self.caps[me] else 0
        self.window = Window(ctx.world, nbytes, what=f"{what} push mailbox")
        self._seq = [0] * ctx.num_ps            # worker: its last write to each PS, and the step then
        self._taken = [0] * ctx.num_ps          # worker: the last write each PS is known to have taken
        self._step = [-1] * ctx.num_ps
        self._word = np.empty(1, np.int64)
        self._held = []                         # PS, ordered: (slot, rows, grads) collected this step
        if nbytes:
            self.window.local(np.int64)[:] = 0
            self.window.sync()

    @property
    def nbytes(self) -> int:
        return self.window.nbytes

    def fits(self, p: int, rows: int) -> bool:
        """Whether this worker has a slot at PS ``p`` that holds ``rows`` rows. Local."""
        return self.ctx.worker_rank in self.slots[p] and rows <= self.caps[p]

    def _base(self, p: int) -> int:
        return self.slots[p][self.ctx.worker_rank] * self.slot_bytes[p]

    def _wait_taken(self, p: int, rank: int) -> None:
        """Until PS ``p`` took this worker's last write (skipped when the sync step protocol says so)."""
        if self._taken[p] >= self._seq[p]:
            return
        control = self.ctx.control
        if control.kind == "sync" and control.step > self._step[p]:
            self._taken[p] = self._seq[p]       # this step began after the apply that drained it
            return
        win, base = self.window.win, self._base(p)
        misses, started = 0, time.monotonic()
        while True:
            win.Get_accumulate([self._word, MPI.INT64_T], [self._word, MPI.INT64_T], rank,
                               (base + 16, 1, MPI.INT64_T), op=MPI.NO_OP)
            win.Flush(rank)
            self._taken[p] = int(self._word[0])
            if self._taken[p] >= self._seq[p]:
                return
            misses += 1
            _wait.backoff(misses)
            _wait.overdue(started, misses, lambda: f"the push mailbox at PS world rank {rank} is not drained")

    def write(self, p: int, rank: int, rows: np.ndarray, grads: np.ndarray) -> None:
        """Worker: put one push (distinct ``rows``, their summed ``grads``: float32, or uint16 bit
        patterns for a 16-bit table) into its slot at PS ``p`` (world ``rank``); :meth:`post`
        makes it visible. Call only where :meth:`fits`. Local (one-sided)."""
        self._wait_taken(p, rank)
        win, base, k = self.window.win, self._base(p), rows.size
        self._rows = np.ascontiguousarray(rows, dtype=np.int64)
        self._grads = np.ascontiguousarray(grads)
        self._k = np.array([k], np.int64)
        mpit = MPI.FLOAT if self.esize == 4 else MPI.UINT16_T
        win.Put([self._rows, MPI.INT64_T], rank, (base + _HEAD, k, MPI.INT64_T))
        win.Put([self._grads, mpit], rank, (base + _HEAD + 8 * self.caps[p], k * self.dim, mpit))
        win.Put([self._k, MPI.INT64_T], rank, (base + 8, 1, MPI.INT64_T))

    def send(self, p: int, rank: int, rows: np.ndarray, grads: np.ndarray) -> None:
        """Worker, ``ordered`` mailbox: the whole push to PS ``p`` through this worker's slot there,
        in pieces of the slot's size (each waits until the PS took the one before). Local."""
        cap = self.caps[p]
        for start in range(0, max(rows.size, 1), cap):
            self.write(p, rank, rows[start:start + cap], grads[start:start + cap])
            self.post(p, rank)

    def post(self, p: int, rank: int) -> None:
        """Worker, after :meth:`write` to PS ``p``: complete it, then raise the slot's sequence
        number, complete on return. Local (one-sided)."""
        win = self.window.win
        win.Flush(rank)
        self._seq[p] += 1
        self._step[p] = self.ctx.control.step
        self._word[0] = self._seq[p]
        win.Accumulate([self._word, MPI.INT64_T], rank, (self._base(p), 1, MPI.INT64_T), op=MPI.REPLACE)
        win.Flush(rank)

    def _heads(self):
        me = self.ctx.ps_rank
        if not self.nbytes:
            return None
        mem = self.window.local(np.int64)
        return mem.reshape(len(self.slots[me]), self.slot_bytes[me] // 8)

    def ready(self) -> bool:
        """PS: whether a slot holds a write not taken yet (or, ``ordered``, one was collected). Local."""
        heads = self._heads()
        if heads is None:
            return False
        if self._held:
            return True
        self.window.sync()
        return bool((heads[:, 0] > heads[:, 2]).any())

    def collect(self) -> None:
        """PS, ``ordered``: take the writes waiting in the slots now (a worker's next piece may
        follow) and keep them for :meth:`drain`. Local."""
        if self.ordered:
            self._held += self._take()

    def drain(self):
        """PS holding its own shard lock: ``[(rows, grads as stored), ...]`` of every slot written
        since it was last taken (and, ``ordered``, every write collected), in worker order, each
        worker's writes in the order it made them; each marked taken. Local."""
        got, self._held = self._held + self._take(), []
        got.sort(key=lambda x: x[0])            # stable: a worker's pieces stay in their order
        return [(rows, grads) for _, rows, grads in got]

    def _take(self):
        """``[(slot, rows, grads)]`` of the slots written since last taken, each marked taken."""
        heads = self._heads()
        if heads is None:
            return []
        self.window.sync()
        cap, dim = self.caps[self.ctx.ps_rank], self.dim
        out = []
        for s in np.flatnonzero(heads[:, 0] > heads[:, 2]).tolist():
            slot = heads[s]
            k = int(slot[1])
            rows = slot[4:4 + k].copy()
            raw = slot[4 + cap:].view(np.float32 if self.esize == 4 else np.uint16)[:k * dim].reshape(k, dim).copy()
            out.append((s, rows, raw))
            slot[2] = slot[0]
        self.window.sync()
        return out

    def free(self) -> None:
        """Collective over the world; safe twice."""
        self.window.free()
