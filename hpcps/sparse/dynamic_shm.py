"""A dynamic table's shards in window memory: each PS keeps its index's buckets and its rows in
an MPI window, and workers on its host look ids up and copy rows straight from there, without
the PS (issue 26). Only the PS writes. A version word (a seqlock) is odd while the PS changes
the index (inserts, evictions, a rebuild, a restore): a reader that saw it odd, or changed across
its read, reads again. Rows changed by an optimizer apply are not guarded: as with a fixed table
a row read during an apply may mix old and new elements (in sync mode no pull overlaps an apply).

Layout of a PS's window: ``HEADER`` bytes (the version, int64, first), the buckets (``(n, 2)``
int64: key, row), the rows (``(capacity, dim)`` float32).

Pushes to a PS on the same host go through a *slab* in the worker's own window memory, one per such
PS: the worker writes the ids and gradients there, sets the slab's state word to 1 and sends only
a header (a small message, sent at once: the worker never waits for the PS to take it); the PS
copies them out when it handles that header and sets the word back to 0. A worker whose slab is
still full (async modes: the PS has not taken the last one), or whose push does not fit, sends the
push as a message instead. Layout of a worker's window: a slab per PS on its host, in PS order,
each ``HEADER`` bytes (the state word first) and then room for ``slab_rows`` ids and gradients.
"""

import time

import numpy as np

from ..core.hashindex import bucket_count, probe
from ..core.window import Window

__all__ = ["ShardMemory", "HEADER"]

HEADER = 64
_TRIES = 64                     # reads that overlap a change before the caller asks the PS instead
SLAB_BYTES = 8 << 20            # a worker's slabs, together (each holds 256 to 8192 rows)


class ShardMemory:
    """The windows of one dynamic table (``caps``: rows per PS). Collective over the world."""

    def __init__(self, ctx, name: str, dim: int, caps: list):
        self.ctx, self.dim, self.caps = ctx, dim, caps
        self.buckets = [bucket_count(c) for c in caps]
        self.sizes = [HEADER + n * 16 + c * dim * 4 for n, c in zip(self.buckets, caps)]
        near = [p for p, r in enumerate(ctx.ps_world_ranks) if r in ctx.node_ranks]     # PS on this host
        self.slab_rows = min(8192, max(256, SLAB_BYTES // max(len(near), 1) // (16 + 4 * dim)))
        slab = HEADER + self.slab_rows * (16 + 4 * dim)         # ids, gradients, ids pulled
        mine = self.sizes[ctx.ps_rank] if ctx.is_ps else slab * len(near)
        self.window = Window(ctx.world, mine, what=f"dynamic table {name!r}")
        self.views = [None] * ctx.num_ps
        self.slabs = [None] * ctx.num_ps        # worker: its slab for each PS on its host
        self.worker_slabs = {}                  # PS: each same-host worker's slab for it, by world rank
        if ctx.is_worker:
            raw = self.window.map_shared([ctx.ps_world_ranks[p] if p in near else None for p in range(ctx.num_ps)],
                                         self.sizes, np.uint8)
            self.views = [None if m is None else self._parts(m, p) for p, m in enumerate(raw)]
            own = self.window.local(np.uint8)
            own[:] = 0                          # every slab free (the PS reads none before a header)
            for i, p in enumerate(near):
                if self.views[p] is not None:
                    self.slabs[p] = own[i * slab:(i + 1) * slab]
        else:
            at = near.index(ctx.ps_rank) * slab
            workers = ctx.node_workers
            for r, m in zip(workers, self.window.map_shared(workers, [slab * len(near)] * len(workers), np.uint8)):
                if m is not None:
                    self.worker_slabs[r] = m[at:at + slab]
        # a worker uses its slab for PS p only where p mapped it too (collective)
        mapped = ctx.world.allgather(sorted(self.worker_slabs) if ctx.is_ps else None)
        for p in range(ctx.num_ps):
            if ctx.rank not in mapped[ctx.ps_world_ranks[p]]:
                self.slabs[p] = None
        self.retries = 0                # reads done again (a change overlapped them)
        self.slab_pushes = 0            # worker: pushes handed over through a slab

    def _parts(self, mem: np.ndarray, p: int) -> dict:
        n, cap = self.buckets[p], self.caps[p]
        return {"version": mem[:HEADER].view(np.int64),
                "buckets": mem[HEADER:HEADER + n * 16].view(np.int64).reshape(n, 2),
                "rows": mem[HEADER + n * 16:].view(np.float32).reshape(cap, self.dim)}

    def memory(self) -> dict:
        """PS: its shard's ``memory`` (:class:`hpcps.core.dynshard.DynamicShard`). Local."""
        return {**self._parts(self.window.local(np.uint8), self.ctx.ps_rank), "fence": self.window.sync}

    def read(self, p: int, ids: np.ndarray):
        """Worker: ``(rows, found)`` of PS ``p``'s distinct ``ids`` read from its window
        (``found``: -1 where absent), or None when every try overlapped a change of its index.
        Local."""
        view = self.views[p]
        version = view["version"]
        for tries in range(_TRIES):
            before = int(version[0])
            if before & 1:
                self.retries += 1
                time.sleep(0) if tries < 8 else time.sleep(20e-6)
                continue
            self.window.sync()
            found, _ = probe(view["buckets"], ids)
            rows = np.take(view["rows"], np.maximum(found, 0), axis=0)
            self.window.sync()
            if int(version[0]) == before:
                return rows, found
            self.retries += 1
        return None

    def put(self, p: int, step: int, ids: np.ndarray, grads: np.ndarray, seen: tuple | None = None) -> bool:
        """Worker: write a push for PS ``p`` into its slab (then send the PS a header), with the
        ids of a pull to count first (``seen``: ``(step, distinct, ids)``, at most
        :attr:`slab_rows` ids); False when there is no slab for ``p``, the push does not fit or the
        PS has not taken the last one. Local."""
        slab = self.slabs[p]
        if slab is None or ids.size > self.slab_rows:
            return False
        head = slab[:HEADER].view(np.int64)
        self.window.sync()
        if head[0] != 0:
            return False
        m = -1 if seen is None else seen[2].size
        at_ids, at_grads, at_seen = self._body(slab, ids.size, m)
        at_ids[:], at_grads[:] = ids, grads
        if seen is not None:
            at_seen[:] = seen[2]
            head[4:6] = seen[0], bool(seen[1])
        head[1:4] = step, ids.size, m
        self.window.sync()              # the rows before the word that hands them over
        head[0] = 1
        self.window.sync()
        self.slab_pushes += 1
        return True

    def _body(self, slab: np.ndarray, n: int, m: int) -> tuple:
        """Views of a slab's ``n`` ids, their ``(n, dim)`` gradients and ``m`` ids to count (None
        when ``m`` < 0), one after another past the header."""
        d, body = self.dim, slab[HEADER:]
        at = (8 + 4 * d) * n
        return (body[:8 * n].view(np.int64), body[8 * n:at].view(np.float32).reshape(n, d),
                None if m < 0 else body[at:at + 8 * m].view(np.int64))

    def take(self, src: int, n: int) -> tuple:
        """PS: ``(ids, gradients, seen)``: copies of the ``n`` ids and gradients worker ``src`` (world
        rank) put in its slab for this PS, and of the pull's ids to count with them (``(step,
        distinct, ids)`` or None); the slab is free again. Local."""
        slab = self.worker_slabs[src]
        self.window.sync()
        head = slab[:HEADER].view(np.int64)
        if head[0] != 1 or head[2] != n:
            raise RuntimeError(f"dynamic table: worker {src}'s slab holds no push of {n} ids (state {head[0]}, "
                               f"{head[2]} ids)")
        m = int(head[3])
        at_ids, at_grads, at_seen = self._body(slab, n, m)
        ids, grads = at_ids.copy(), at_grads.copy()
        seen = None if m < 0 else (int(head[4]), bool(head[5]), at_seen.copy())
        self.window.sync()
        head[0] = 0
        self.window.sync()
        return ids, grads, seen

    def free(self) -> None:
        """Collective over the world; safe twice."""
        self.views = [None] * len(self.views)
        self.slabs = [None] * len(self.slabs)
        self.worker_slabs = {}
        self.window.free()
