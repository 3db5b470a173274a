"""A mutual-exclusion lock per PS shard, built on MPI atomics.

Writers of a shard (same-node workers storing straight into shared memory,
remote workers issuing ``MPI_Accumulate``, and later the PS's own optimizer
step) take the shard's lock, so no update is lost whichever path it came by.
Readers do not take it: float32 loads and stores are single-copy atomic per
element, the same element-wise guarantee MPI gives.

Each PS rank exposes two int64 words in a window of their own: the lock,
taken with ``MPI_Compare_and_swap`` (0 -> world rank + 1) and released with an
atomic ``MPI_Accumulate(REPLACE, 0)``, and a count of pushes staged since the
PS last applied them (stateful optimizers). Waiting polls through MPI and pauses
between tries as ``hpcps.core.wait`` says (a yield, or sleeps on an oversubscribed node).
"""

import time

import numpy as np
from mpi4py import MPI

from .wait import backoff, overdue
from .window import Window

__all__ = ["ShardLocks"]


class ShardLocks:
    """One lock per PS rank. Collective over the world communicator."""

    def __init__(self, world: MPI.Comm, owns_shard: bool, what: str):
        self._window = Window(world, 16 if owns_shard else 0, what=f"{what} locks")
        if owns_shard:
            self._window.local(np.int64)[:] = 0
            self._window.sync()
        self._me = np.array([world.Get_rank() + 1], dtype=np.int64)
        self._zero = np.zeros(1, dtype=np.int64)
        self._result = np.empty(1, dtype=np.int64)
        self.spins = 0  # failed tries, for contention metrics

    def acquire(self, rank: int) -> None:
        """Block until this rank holds the lock of PS at world ``rank``. Local (one-sided)."""
        win = self._window.win
        misses, started = 0, time.monotonic()
        while True:
            win.Compare_and_swap(self._me, self._zero, self._result, rank, 0)
            win.Flush(rank)
            if self._result[0] == 0:
                return
            self.spins += 1
            misses += 1
            backoff(misses)
            overdue(started, misses, lambda: f"the shard lock of PS world rank {rank} is held by world rank "
                                             f"{int(self._result[0]) - 1}")

    def release(self, rank: int) -> None:
        """Release the lock of PS at world ``rank``. Local (one-sided)."""
        win = self._window.win
        win.Accumulate([self._zero, MPI.INT64_T], rank, (0, 1, MPI.INT64_T), op=MPI.REPLACE)
        win.Flush(rank)

    def add_pending(self, rank: int) -> None:
        """Count one staged push at PS ``rank``; call while holding its lock. Local (one-sided)."""
        win = self._window.win
        one = np.ones(1, np.int64)
        win.Accumulate([one, MPI.INT64_T], rank, (8, 1, MPI.INT64_T), op=MPI.SUM)
        win.Flush(rank)

    def pending(self, rank: int, reset: bool = False) -> int:
        """Staged pushes counted at PS ``rank`` (atomically reset to 0 if ``reset``). Local (one-sided)."""
        win = self._window.win
        win.Fetch_and_op(self._zero, self._result, rank, 8, MPI.REPLACE if reset else MPI.NO_OP)
        win.Flush(rank)
        return int(self._result[0])

    def free(self) -> None:
        """Collective over the world communicator; safe twice."""
        self._window.free()
