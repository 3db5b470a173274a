"""The worker's side of the training pipeline: a communication thread and a hot-row cache.

``CommThread`` runs a worker's pulls and pushes, in the order they were
submitted, on one background thread, so that the prefetch of step t+1 and the
pushes of step t overlap the model's compute (numpy gathers, torch adds and MPI
calls release the GIL). It needs ``MPI_THREAD_MULTIPLE``; where the MPI library
gives less, it runs each call inline and says so once.

``PushBatch`` collects one step's pushes of several tables (the autograd hooks
add to it) and sends them with one :func:`hpcps.sparse.push.push_many`: one
shard-lock round trip per PS per step instead of one per table.

``RowCache`` is a direct-mapped cache of rows a worker pulled, each with the
step it was read at; a row older than ``staleness`` steps is pulled again.
"""

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
from mpi4py import MPI

from .push import push_many_checked

__all__ = ["CommThread", "PushBatch", "RowCache"]

logger = logging.getLogger(__name__)

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


class CommThread:
    """One background thread for one worker's table traffic. Local (worker ranks).

    ``submit(fn, *args)`` returns a ``Future``; ``drain()`` waits for everything
    submitted so far and re-raises the first failure. ``enabled=False`` (or an
    MPI without ``THREAD_MULTIPLE``, which is a warning where ``say``) runs every
    call at ``submit`` time instead.
    """

    def __init__(self, enabled: bool = True, say: bool = True):
        if enabled and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            say_it = logger.warning if say else logger.debug       # ``say``: one worker says it for the job
            say_it("hpcps: MPI runs without MPI_THREAD_MULTIPLE, so pulls and pushes run inline "
                   "(no background pipeline); set job.mpi_threads = multiple (HPCPS_MPI_THREADS=multiple, "
                   "or hpcps.prepare_process('multiple')) for the communication thread (hpcps train "
                   "asks for MPI_THREAD_SERIALIZED by default)")
            enabled = False
        self.enabled = enabled
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hpcps-comm") if enabled else None
        self._pending: list[Future] = []
        self._lock = threading.Lock()

    def submit(self, fn, *args) -> Future:
        if self._pool is None:
            f = Future()
            try:
                f.set_result(fn(*args))
            except BaseException as e:          # surfaced by result(), as from the thread
                f.set_exception(e)
            return f
        f = self._pool.submit(fn, *args)
        with self._lock:
            self._pending = [p for p in self._pending if not p.done()] + [f]
        return f

    def post(self, fn, *args) -> None:
        """``submit`` for a call whose result nobody reads: inline, it has run and a failure is
        raised here; on the thread, a failure is raised by the next ``drain``. Local."""
        f = self.submit(fn, *args)
        if self._pool is None:
            f.result()

    def drain(self) -> None:
        """Wait for every call submitted so far; raise the first failure. Local."""
        with self._lock:
            pending, self._pending = self._pending, []
        for f in pending:
            f.result()

    def close(self) -> None:
        """Drain, then stop the thread; safe twice. Local."""
        try:
            self.drain()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


class PushBatch:
    """One worker's pushes of a step, for several tables of one context. Local (worker ranks).

    ``add`` keeps a push; ``flush`` sends everything kept as one ``push_many`` on
    ``comm`` (inline when ``comm`` is not enabled: then it has completed, and a
    failure raised, when ``flush`` returns).
    """

    def __init__(self, comm: CommThread):
        self.comm = comm
        self._items = []

    def add(self, table, ids: np.ndarray, grads: np.ndarray, checked: bool = False) -> None:
        """Keep a push; ``checked``: the caller already checked it (``hpcps.sparse.push.push_parts``)."""
        self._items.append((table, ids, grads, checked))

    def flush(self) -> None:
        if not self._items:
            return
        items, self._items = self._items, []
        self.comm.post(push_many_checked, items)


class RowCache:
    """A direct-mapped cache of ``capacity`` rows of one table. Local (one worker).

    A row read at step ``s`` serves lookups at steps ``u`` with ``u - s <= staleness``.
    The worker's own pushes are not applied to cached rows: a cached row is at most
    ``staleness`` steps behind the table, which is the bound the cache promises.
    """

    def __init__(self, capacity: int, dim: int, staleness: int):
        if capacity < 1 or staleness < 0:
            raise ValueError(f"RowCache: capacity must be >= 1 and staleness >= 0, got {capacity}, {staleness}")
        bits = max(int(capacity - 1).bit_length(), 1)
        self.capacity, self._shift = 1 << bits, np.uint64(64 - bits)
        self.staleness = int(staleness)
        self._ids = np.full(self.capacity, -1, np.int64)
        self._step = np.zeros(self.capacity, np.int64)
        self._rows = np.zeros((self.capacity, dim), np.float32)
        self.lookups = 0
        self.hits = 0

    def _slots(self, ids: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            return ((ids.astype(np.uint64) * _GOLDEN) >> self._shift).astype(np.int64)

    def lookup(self, ids: np.ndarray, step: int) -> tuple[np.ndarray, np.ndarray]:
        """``ids`` (unique int64) wanted at ``step``: (hit mask, copies of the rows hit)."""
        slots = self._slots(ids)
        hit = (self._ids[slots] == ids) & (step - self._step[slots] <= self.staleness)
        self.lookups += ids.size
        self.hits += int(hit.sum())
        return hit, self._rows[slots[hit]]

    def insert(self, ids: np.ndarray, rows: np.ndarray, step: int) -> None:
        """Keep ``rows`` of ``ids`` (unique), read at ``step``; a slot's older row is replaced."""
        slots = self._slots(ids)
        if slots.size > 1:                      # two ids on one slot: the last one stays
            _, first_rev = np.unique(slots[::-1], return_index=True)
            keep = slots.size - 1 - first_rev
            ids, rows, slots = ids[keep], rows[keep], slots[keep]
        self._ids[slots] = ids
        self._step[slots] = step
        self._rows[slots] = rows

    def clear(self) -> None:
        """Forget every row (the table's rows were replaced: a checkpoint loaded)."""
        self._ids[:] = -1

    def take_counts(self) -> tuple[int, int]:
        """(lookups, hits) since the last call, and reset them."""
        out = (self.lookups, self.hits)
        self.lookups = self.hits = 0
        return out
