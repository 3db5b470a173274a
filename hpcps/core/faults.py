"""Lost ranks seen while the job runs, under an MPI with ULFM (Open MPI launched ``--with-ft ulfm``).

Without ULFM a rank that dies ends the whole launch and hpcps recovers by restart (checkpoint
levels). With it the survivors see the loss as an MPI error (``MPI_ERR_PROC_FAILED``) and go on:
``hpcps.train.failover`` rebuilds the job on them and its standby ranks. This module is the low
part of that:

- :func:`ulfm_launched`: whether this process runs under ULFM (local, reads the environment);
- :class:`FaultWatch`: a receive from any rank, posted on a communicator of its own, that
  completes with an error once any rank of the job is lost; every wait of hpcps polls it
  (``hpcps.core.wait.set_fault_check``), so a rank spinning on shared memory learns of a loss too;
- :func:`track` and :func:`revoke_all`: the communicators a rank revokes when it leaves the job's
  work for recovery, so that a peer blocked in a collective with it leaves too (ULFM's
  ``MPI_Comm_revoke``);
- :func:`is_loss`: whether an exception is the sign of a lost rank.
"""

import os
import threading
import time

from mpi4py import MPI

from . import wait as _wait
from .errors import HpcpsError

__all__ = ["RankLost", "ulfm_launched", "ulfm_note", "FaultWatch", "track", "revoke_all", "is_loss",
           "loss_seen"]

# the error classes a lost rank raises (mpi4py names them where its MPI has ULFM's)
LOSS_CLASSES = frozenset(getattr(MPI, name) for name in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING",
                                                         "ERR_REVOKED") if hasattr(MPI, name))
_WATCH_TAG = 0x4C05             # nothing is ever sent with it
_tracked: list = []             # the job's communicators (freed ones read as MPI.COMM_NULL)


class RankLost(HpcpsError):
    """A rank of the job was lost (or a peer revoked a communicator on seeing such a loss)."""


def ulfm_launched(environ=os.environ) -> bool:
    """Whether this process can survive a lost peer: its MPI has ULFM's calls and the launcher
    enabled them (Open MPI's ``mpiexec --with-ft ulfm`` sets ``OMPI_MCA_mpi_ft_enable``). Local."""
    enabled = str(environ.get("OMPI_MCA_mpi_ft_enable", "")).strip().lower() in ("1", "true", "yes", "on")
    return enabled and hasattr(MPI.Comm, "Shrink") and bool(LOSS_CLASSES)


def ulfm_note() -> str:
    """What to do for live failover where :func:`ulfm_launched` is False (an error's tail). Local."""
    return ("live failover needs an MPI with ULFM: Open MPI 5 launched as `mpiexec --with-ft ulfm` "
            "(HPCPS_MPI=openmpi). Under MPICH or without "
            "--with-ft a lost rank ends the launch and the job recovers by restart from its last checkpoint "
            "(slurm/train.sbatch requeues), as without standbys")


class FaultWatch:
    """A receive from any rank on a duplicate of ``comm`` that never matches: it completes with an
    error once a rank of ``comm`` is lost or a peer revokes it. Collective over ``comm`` (duplicates it)."""

    def __init__(self, comm: MPI.Comm):
        self.comm = comm.Dup()
        self.comm.Set_errhandler(MPI.ERRORS_RETURN)
        self._buf = bytearray(1)
        self._req = self.comm.Irecv(self._buf, source=MPI.ANY_SOURCE, tag=_WATCH_TAG)
        self.seen_at = None             # time.monotonic() of the first check that saw a loss
        self._lock = threading.Lock()   # the worker's comm thread waits too (MPI_THREAD_MULTIPLE)

    def lost(self) -> bool:
        """Whether a loss (or a revoke) has reached this rank. Local; any thread."""
        with self._lock:
            if self.seen_at is not None:
                return True
            try:
                done = self._req.Test()
            except MPI.Exception:
                done = True
            if done:
                self.seen_at = time.monotonic()
            return done

    def check(self) -> None:
        """Raise :class:`RankLost` where :meth:`lost`. Local."""
        if self.lost():
            raise RankLost("a rank of the job was lost")

    def wait_for(self, seconds: float) -> bool:
        """Poll :meth:`lost` for up to ``seconds``: the detector's heartbeat takes a moment to tell
        every rank. Local."""
        end = time.monotonic() + seconds
        while not self.lost() and time.monotonic() < end:
            time.sleep(0.005)
        return self.lost()


def track(comm: MPI.Comm) -> MPI.Comm:
    """Have :func:`revoke_all` revoke ``comm`` (a communicator the job made), and let its calls
    return errors instead of ending the process. Does nothing without ULFM. Local; returns ``comm``."""
    if ulfm_launched() and comm != MPI.COMM_NULL:
        comm.Set_errhandler(MPI.ERRORS_RETURN)
        _tracked[:] = [c for c in _tracked if c != MPI.COMM_NULL] + [comm]
    return comm


def revoke_all(*comms) -> None:
    """Revoke ``comms`` and every tracked communicator: a peer blocked in a call on one of them
    returns ``MPI_ERR_REVOKED`` and joins the recovery. Local; errors ignored (some are broken)."""
    for comm in (*comms, *_tracked):
        try:
            if comm != MPI.COMM_NULL:
                comm.Revoke()
        except (MPI.Exception, AttributeError):
            pass
    _tracked.clear()


def is_loss(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an exception it was raised from) says a rank was lost. Local."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, RankLost):
            return True
        if isinstance(exc, MPI.Exception) and exc.Get_error_class() in LOSS_CLASSES:
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


_watch: FaultWatch | None = None


def install(watch: FaultWatch | None) -> None:
    """Make every wait of hpcps poll ``watch`` (None: none). Local."""
    global _watch
    _watch = watch
    _wait.set_fault_check(watch.check if watch is not None else None)


def loss_seen(exc: BaseException | None, grace_s: float = 2.0) -> bool:
    """Whether ``exc`` came from a lost rank: it says so, or the installed watch sees a loss within
    ``grace_s`` (an error from a peer that left may come before the detector tells this rank). Local."""
    if is_loss(exc):
        return True
    return _watch is not None and _watch.wait_for(grace_s)
