"""One MPI RMA window: allocated collectively, freed once.

Every window is opened for the rest of its life with ``Lock_all(MPI.MODE_NOCHECK)``;
ranks that own nothing expose 0 bytes. How its memory is made depends on the MPI
library (:func:`window_kind`, printed in ``hpcps train``'s layout line):

- ``allocate`` (MPICH 4 and newer, and MPIs of its kind that map such windows): ``MPI.Win.Allocate``
  over the communicator. With ``Lock_all(MODE_NOCHECK)`` a pull or push completed while
  the target PS was busy outside MPI (measured on MPICH; other combinations waited for
  the target), and MPI-4's ``Win_shared_query`` maps the memory of a rank on the same node.
- ``shared`` (an MPI that cannot map an allocated window, every rank of the communicator on
  one node): ``MPI.Win.Allocate_shared``. Open MPI 5.0 and Intel MPI 2021 refuse
  ``Win_shared_query`` on a window made by ``Win.Allocate``, so their shared-memory window
  (Open MPI's ``osc/sm``: RMA calls are loads, stores and CPU atomics, nothing waits for the
  target) is the one that can be mapped.
- ``create`` (such an MPI, ranks on several nodes): each node's memory from
  ``Allocate_shared`` over the node's ranks, and the RMA window ``MPI.Win.Create`` over that
  memory on the whole communicator (``osc/rdma``), so same-node peers map it and other nodes
  reach it by RMA.

``shared(rank)`` maps the memory of a rank on the same node; it returns ``None`` when the
MPI library cannot map it, and callers fall back to RMA.
"""

import os

import numpy as np
from mpi4py import MPI

from .errors import FreedError, HpcpsError
from . import counts

__all__ = ["Window", "window_kind", "WINDOW_KINDS"]

WINDOW_KINDS = ("allocate", "shared", "create")
_NONCONTIG = None           # MPI.Info: each rank's part of a shared window on its own pages
_ROUNDING = 2 << 20         # a shared part's size is rounded up by less than this (a huge page)
_MAPS_ALLOCATED = None     # _library_maps_allocated(), once tried
_node_comms = {}            # communicator handle -> (its node-local split, its group) for `create` windows


def _library_maps_allocated() -> bool:
    """Whether this MPI maps a ``Win.Allocate`` window's memory through ``Win_shared_query``
    (MPICH 4 and newer do; Open MPI 5.0 and Intel MPI 2021 raise): tried once on a 64-byte
    window over ``COMM_SELF``. Local."""
    global _MAPS_ALLOCATED
    if _MAPS_ALLOCATED is None:
        win = MPI.Win.Allocate(64, disp_unit=1, comm=MPI.COMM_SELF)
        try:
            mem, _ = win.Shared_query(0)
            _MAPS_ALLOCATED = mem is not None and len(mem) == 64
        except MPI.Exception:
            _MAPS_ALLOCATED = False
        finally:
            win.Free()
    return _MAPS_ALLOCATED


def window_kind(comm: MPI.Comm) -> str:
    """How windows over ``comm`` are made here: ``allocate``, ``shared`` or ``create`` (module
    docstring). ``$HPCPS_WINDOWS`` forces one (``shared`` needs every rank on one node).
    Collective over ``comm``."""
    forced = os.environ.get("HPCPS_WINDOWS", "")
    if forced and forced not in WINDOW_KINDS:
        raise ValueError(f"HPCPS_WINDOWS must be one of {WINDOW_KINDS}, got {forced!r}")
    if forced == "allocate" or (not forced and _library_maps_allocated()):
        return "allocate"
    one_node = _node_split(comm)[2]
    if forced == "shared" and not one_node:
        raise ValueError("HPCPS_WINDOWS=shared needs every rank on one node")
    return forced or ("shared" if one_node else "create")


def _node_split(comm: MPI.Comm):
    """``(node, group, one_node)``: ``comm``'s ranks on this node as a communicator, ``comm``'s
    group, and whether every rank is on one node. Kept for the next window over the same ranks
    (a handle of a freed communicator may come back for another group: compared). Collective
    over ``comm``."""
    key, group = MPI.Comm.py2f(comm), comm.Get_group()
    known = _node_comms.get(key)
    same = known is not None and MPI.Group.Compare(known[1], group) == MPI.IDENT
    if not comm.allreduce(same, op=MPI.LAND):
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        one = comm.allreduce(node.Get_size(), op=MPI.MIN) == comm.Get_size()
        _node_comms[key] = (node, group, one)
    return _node_comms[key]


def _noncontig() -> MPI.Info:
    global _NONCONTIG
    if _NONCONTIG is None:
        _NONCONTIG = MPI.Info.Create()
        _NONCONTIG.Set("alloc_shared_noncontig", "true")
    return _NONCONTIG


class Window:
    """An ``MPI.Win`` of ``nbytes`` local bytes. Collective over ``comm``."""

    def __init__(self, comm: MPI.Comm, nbytes: int, what: str = "window"):
        self.what = what
        self.nbytes = int(nbytes)
        self.kind = window_kind(comm)
        self._node = None           # `create`: the node's shared window that holds the memory
        self._node_rank = None      # `create`: rank of comm -> rank of the node's window, or None
        try:
            if self.kind == "allocate":
                self._win = MPI.Win.Allocate(self.nbytes, disp_unit=1, comm=comm)
            elif self.kind == "shared":
                self._win = MPI.Win.Allocate_shared(self.nbytes, disp_unit=1, info=_noncontig(), comm=comm)
            else:
                node, group, _ = _node_split(comm)
                self._node = MPI.Win.Allocate_shared(self.nbytes, disp_unit=1, info=_noncontig(), comm=node)
                ranks = group.Translate_ranks(list(range(comm.Get_size())), node.Get_group())
                self._node_rank = [None if r == MPI.UNDEFINED else r for r in ranks]
                mem = self._node.tomemory() if self.nbytes else MPI.BOTTOM
                self._win = MPI.Win.Create(mem, disp_unit=1, comm=comm)
            self._win.Lock_all(MPI.MODE_NOCHECK)
            self._view = counts.wrap(self._win, comm)   # the window itself unless HPCPS_COUNT_MPI=1
        except MPI.Exception as e:
            raise HpcpsError(f"{what}: allocating an RMA window of {nbytes} bytes ({self.kind}) failed: {e}") from e

    @property
    def win(self) -> MPI.Win:
        """The open ``MPI.Win``; raises ``FreedError`` after ``free()``. Local."""
        if self._win is None:
            raise FreedError(f"{self.what} was used after free()")
        return self._view

    def local(self, dtype=np.float32) -> np.ndarray:
        """This rank's own window memory (``nbytes``) as a 1-D numpy array. Local."""
        if self.nbytes == 0:
            return np.empty(0, dtype=dtype)
        mem = self._node.tomemory() if self._node is not None else self.win.tomemory()
        return np.frombuffer(mem, dtype=dtype, count=self.nbytes // np.dtype(dtype).itemsize)

    def shared(self, rank: int, dtype=np.float32, size: int | None = None) -> np.ndarray | None:
        """Memory of ``rank`` (same node) as a writable numpy array, or None. With ``size``, its
        first ``size`` elements, or None when it holds fewer or much more (another size than the
        caller's): a shared window's part is page-rounded (Open MPI's ``alloc_shared_noncontig``
        reported 32768 bytes for 32096). Local."""
        mem = self._query(rank, dtype)
        if mem is None or size is None:
            return mem
        slack = mem.size - size
        if slack < 0 or (slack and (self.kind == "allocate" or slack * mem.itemsize >= _ROUNDING)):
            return None
        return mem[:size]

    def _query(self, rank: int, dtype):
        win, peer = self.win, rank
        if self._node is not None:
            win, peer = self._node, self._node_rank[rank]
            if peer is None:
                return None
        try:
            mem, _ = win.Shared_query(peer)
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
            mem = None if rank is None else self.shared(rank, dtype, size)
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
            if self._node is not None:
                self._node.Free()
                self._node = None
        except MPI.Exception as e:
            raise HpcpsError(f"{self.what}: freeing the RMA window failed: {e}") from e

    @property
    def freed(self) -> bool:
        return self._win is None
