"""Per-row bookkeeping on the PS: version stamps (prefetch refresh) and dirty marks (incremental
checkpoints). Each class owns one window over the world communicator."""

import numpy as np
from mpi4py import MPI

from ..core.window import Window

__all__ = ["RowVersions", "DirtyRows"]


class RowVersions:
    """Per-row int32 stamp: the highest ``step + 1`` of any update applied to the row (0: never).
    Collective over the world (allocates a window)."""

    def __init__(self, ctx, local_rows: int, what: str):
        self.ctx = ctx
        self.window = Window(ctx.world, local_rows * 4, what=f"{what} row versions")
        if ctx.is_ps:
            self.window.local(np.int32)[:] = 0
            self.window.sync()
        self.views = [None] * ctx.num_ps        # worker: each PS's stamps on this node

    def map(self, ranks, sizes) -> None:
        """Worker: map the stamps of the PS ranks in ``ranks`` (None: not on this node). Local."""
        self.views = self.window.map_shared(ranks, sizes, np.int32)

    def read(self, owner: np.ndarray, local: np.ndarray) -> np.ndarray:
        """Worker: stamps of the rows at ``(owner, local)``; atomic per element against concurrent
        stamping (``Get_accumulate(NO_OP)`` on the RMA path). Local (one-sided)."""
        out = np.empty(owner.size, np.int32)
        win = self.window.win
        for p in np.unique(owner).tolist():
            sel = np.flatnonzero(owner == p)
            view = self.views[p]
            if view is not None:
                self.window.sync()
                out[sel] = np.take(view, local[sel])
                continue
            rank = self.ctx.ps_world_ranks[p]
            buf = np.empty(sel.size, np.int32)
            dtype = MPI.INT32_T.Create_indexed_block(1, local[sel].tolist()).Commit()
            try:
                win.Get_accumulate([buf, MPI.INT32_T], [buf, MPI.INT32_T], rank, (0, 1, dtype), op=MPI.NO_OP)
                win.Flush(rank)
            finally:
                dtype.Free()
            out[sel] = buf
        return out

    def stamp(self, p: int, rank: int, rows: np.ndarray, stamp: int) -> None:
        """Worker holding PS ``p``'s shard lock: raise the stamps of ``rows`` (unique) to ``stamp``. Local."""
        view = self.views[p]
        if view is not None:
            self.window.sync()
            view[rows] = np.maximum(view[rows], np.int32(stamp))
            self.window.sync()
            return
        vals = np.full(rows.size, stamp, np.int32)
        dtype = MPI.INT32_T.Create_indexed_block(1, rows.tolist()).Commit()
        try:
            self.window.win.Accumulate([vals, MPI.INT32_T], rank, (0, 1, dtype), op=MPI.MAX)
            self.window.win.Flush(rank)
        finally:
            dtype.Free()

    def raise_local(self, rows: np.ndarray, stamp: int) -> None:
        """PS, after applying ``rows``: raise their stamps to ``stamp`` (after the rows: a reader that
        sees the stamp sees them). Local."""
        ver = self.window.local(np.int32)
        ver[rows] = np.maximum(ver[rows], np.int32(stamp))
        self.window.sync()

    def local(self) -> np.ndarray:
        """PS: this rank's stamps (a view). Local."""
        return self.window.local(np.int32)

    def free(self) -> None:
        """Collective over the world; safe twice."""
        self.views = [None] * len(self.views)
        self.window.free()


class DirtyRows:
    """Per-row "changed since the last checkpoint" byte, a bit per checkpoint level: ``PFS``
    (changed since the filesystem level's last checkpoint) and ``LOCAL`` (since the node-local
    level's); a change sets both (``ALL``), a level's checkpoint takes and clears its own.
    Collective over the world (allocates a window)."""

    PFS, LOCAL, ALL = 1, 2, 3

    def __init__(self, ctx, local_rows: int, what: str):
        self.local_rows = local_rows
        self.window = Window(ctx.world, -(-local_rows // 8) * 8, what=f"{what} dirty rows")
        if ctx.is_ps:
            self.window.local(np.uint8)[:] = 0
            self.window.sync()
        self.views = [None] * ctx.num_ps        # worker, plain SGD: each PS's marks on this node

    def map(self, ranks, sizes) -> None:
        """Worker: map the marks of the PS ranks in ``ranks`` (None: not on this node). Local."""
        self.views = self.window.map_shared(ranks, sizes, np.uint8)

    def mark_local(self, rows: np.ndarray) -> None:
        """PS: mark ``rows`` changed (synced with the rows by the caller). Local."""
        self.window.local(np.uint8)[rows] = self.ALL

    def take(self, level: int = PFS) -> np.ndarray:
        """PS, while no worker pushes (checkpoint cut): rows changed since ``level``'s last call
        (a bit: :attr:`PFS` or :attr:`LOCAL`), and reset its marks. Local."""
        self.window.sync()
        flags = self.window.local(np.uint8)[:self.local_rows]
        rows = np.flatnonzero(flags & level)
        flags[rows] &= np.uint8(~level & 0xFF)
        self.window.sync()
        return rows

    def free(self) -> None:
        """Collective over the world; safe twice."""
        self.views = [None] * len(self.views)
        self.window.free()
