"""A dynamic table's shards in window memory: each PS keeps its index's buckets and its rows in
an MPI window, and workers on its host look ids up and copy rows straight from there, without
the PS (issue 26). Only the PS writes. A version word (a seqlock) is odd while the PS changes
the index (inserts, evictions, a rebuild, a restore): a reader that saw it odd, or changed across
its read, reads again. Rows changed by an optimizer apply are not guarded: as with a fixed table
a row read during an apply may mix old and new elements (in sync mode no pull overlaps an apply).

Layout of a PS's window: ``HEADER`` bytes (the version, int64, first), the buckets (``(n, 2)``
int64: key, row), the rows (``(capacity, dim)`` float32).
"""

import time

import numpy as np

from ..core.hashindex import bucket_count, probe
from ..core.window import Window

__all__ = ["ShardMemory", "HEADER"]

HEADER = 64
_TRIES = 64                     # reads that overlap a change before the caller asks the PS instead


class ShardMemory:
    """The windows of one dynamic table (``caps``: rows per PS). Collective over the world."""

    def __init__(self, ctx, name: str, dim: int, caps: list):
        self.ctx, self.dim, self.caps = ctx, dim, caps
        self.buckets = [bucket_count(c) for c in caps]
        self.sizes = [HEADER + n * 16 + c * dim * 4 for n, c in zip(self.buckets, caps)]
        self.window = Window(ctx.world, self.sizes[ctx.ps_rank] if ctx.is_ps else 0, what=f"dynamic table {name!r}")
        self.views = [None] * ctx.num_ps
        if ctx.is_worker:
            near = [r if r in ctx.node_ranks else None for r in ctx.ps_world_ranks]
            raw = self.window.map_shared(near, self.sizes, np.uint8)
            self.views = [None if m is None else self._parts(m, p) for p, m in enumerate(raw)]
        self.retries = 0                # reads done again (a change overlapped them)

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

    def free(self) -> None:
        """Collective over the world; safe twice."""
        self.views = [None] * len(self.views)
        self.window.free()
