"""One MPI RMA window: allocated collectively, freed once.

The window is made with ``MPI.Win.Allocate`` and opened for the rest of its
life with ``Lock_all(MPI.MODE_NOCHECK)``: with that combination a pull or push
completes while the target PS is busy outside MPI (measured on MPICH; other
combinations waited for the target). Ranks that own nothing expose 0 bytes.

``shared(rank)`` maps the memory of a rank on the same node (MPI-4
``Win_shared_query`` on an allocated window); it returns ``None`` when the MPI
library cannot map it, and callers fall back to RMA.
"""

import numpy as np
from mpi4py import MPI

from ..errors import FreedError, HpcpsError

__all__ = ["Window"]


class Window:
    """An ``MPI.Win`` of ``nbytes`` local bytes. Collective over ``comm``."""

    def __init__(self, comm: MPI.Comm, nbytes: int, what: str = "window"):
        self.what = what
        try:
            self._win = MPI.Win.Allocate(int(nbytes), disp_unit=1, comm=comm)
            self._win.Lock_all(MPI.MODE_NOCHECK)
        except MPI.Exception as e:
            raise HpcpsError(f"{what}: allocating an RMA window of {nbytes} bytes failed: {e}") from e
        self.nbytes = int(nbytes)

    @property
    def win(self) -> MPI.Win:
        """The open ``MPI.Win``; raises ``FreedError`` after ``free()``. Local."""
        if self._win is None:
            raise FreedError(f"{self.what} was used after free()")
        return self._win

    def local(self, dtype=np.float32) -> np.ndarray:
        """This rank's own window memory as a 1-D numpy array. Local."""
        if self.nbytes == 0:
            return np.empty(0, dtype=dtype)
        return np.frombuffer(self.win.tomemory(), dtype=dtype)

    def shared(self, rank: int, dtype=np.float32) -> np.ndarray | None:
        """Memory of ``rank`` (same node) as a writable numpy array, or None. Local."""
        try:
            mem, _ = self.win.Shared_query(rank)
        except MPI.Exception:
            return None
        if mem is None:
            return None
        return np.frombuffer(mem, dtype=dtype)

    def map_shared(self, ranks, sizes, dtype=np.float32, dim: int | None = None) -> list:
        """For each ``(rank, size)`` pair: ``rank``'s memory as a numpy array of ``size`` elements of
        ``dtype`` (rows of ``dim`` when given), or None where ``rank`` is None, cannot be mapped or
        holds another size. Local."""
        views = []
        for rank, size in zip(ranks, sizes):
            mem = None if rank is None else self.shared(rank, dtype)
            if mem is not None and mem.size != size:
                mem = None
            views.append(mem if mem is None or dim is None else mem.reshape(-1, dim))
        return views

    def sync(self) -> None:
        """Memory barrier between direct loads/stores and RMA (``MPI_Win_sync``). Local."""
        self.win.Sync()

    def free(self) -> None:
        """Close and free the window; a second call does nothing. Collective over ``comm``."""
        if self._win is None:
            return
        win, self._win = self._win, None
        try:
            win.Unlock_all()
            win.Free()
        except MPI.Exception as e:
            raise HpcpsError(f"{self.what}: freeing the RMA window failed: {e}") from e

    @property
    def freed(self) -> bool:
        return self._win is None
