"""The monitor's board: one row of float64 per rank in a window on the first worker, which each
rank writes with an RMA ``Put`` at its own pace and the first worker reads from its own memory.
No collective in the step path: a rank that is busy or stuck simply stops updating its row (its
``seq`` stands still), which is itself a figure (a silent rank).

A row is :data:`FIELDS` then, on a worker, its wait on and traffic with each PS. The window is ``world
size x (len(FIELDS) + 2 num_ps) x 8`` bytes on the first worker (1,000 ranks and 8 PS: 270 KB) and 0 bytes
elsewhere, made as every hpcps window (``Win.Allocate`` + ``Lock_all(MODE_NOCHECK)``: a put
completes while the first worker computes). A read may see a row half-written: two samples of one
rank mixed, harmless for figures that move slowly.
"""

import numpy as np
from mpi4py import MPI

from ..core.window import Window
from .fields import _AT, FIELDS, per_ps

__all__ = ["Board"]



class Board:
    """The rows of every rank, on ``root`` (a world rank). Collective over ``world`` (makes a window)."""

    def __init__(self, world: MPI.Comm, root: int, num_ps: int):
        self.size, self.root, self.me = world.Get_size(), root, world.Get_rank()
        self.width, self.num_ps = len(FIELDS) + 2 * num_ps, num_ps
        self._win = Window(world, self.size * self.width * 8 if self.me == root else 0, what="monitor board")
        self._rows = None
        if self.me == root:
            self._rows = self._win.local(np.float64).reshape(self.size, self.width)
            self._rows[:] = np.nan
            self._rows[:, _AT["seq"]] = 0
            self._win.sync()
        self._row = np.full(self.width, np.nan)
        self._seq = 0

    def row(self, done: bool = False, **figures) -> np.ndarray:
        """This rank's next row from ``figures`` (names of :data:`FIELDS`, and a worker's
        ``wait_ps`` and ``bytes_ps``: :func:`hpcps.monitor.fields.per_ps`); the others NaN. Local."""
        self._seq += 1
        row = self._row
        row[:] = np.nan
        row[_AT["seq"]], row[_AT["done"]] = self._seq, float(done)
        for name in ("wait_ps", "bytes_ps"):
            v = figures.pop(name, None)
            if v is not None:
                row[per_ps(name, self.num_ps)] = v
        for name, v in figures.items():
            row[_AT[name]] = v
        return row

    def put(self, row: np.ndarray) -> None:
        """Write this rank's row on the root, complete on return. Local (one-sided)."""
        if self.me == self.root:
            self._rows[self.me] = row
            return
        win = self._win.win
        win.Put([row, MPI.DOUBLE], self.root, target=(self.me * self.width * 8, self.width, MPI.DOUBLE))
        win.Flush(self.root)

    def read(self) -> np.ndarray:
        """Root: every rank's row as last written (a copy). Local."""
        self._win.sync()
        return self._rows.copy()

    def free(self) -> None:
        """Collective over the world; safe twice."""
        self._win.free()
