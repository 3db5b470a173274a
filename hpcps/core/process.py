"""What a process sets before MPI starts: the MPI thread level, glibc's heap, and the settings
hpcps gives the MPI library.

``hpcps train`` calls :func:`prepare_process` from the command, with the values of
the config keys ``job.mpi_threads`` and ``job.malloc_tune``. A program of your own
that imports hpcps calls it first thing, before anything imports ``mpi4py.MPI``
(``hpcps.init`` does), or sets the same through the environment
(``MPI4PY_RC_THREAD_LEVEL=serialized``, ``GLIBC_TUNABLES=glibc.malloc.tcache_count=0``).
Pure: imports no MPI. Local.

Why ``serialized``: under ``MPI_THREAD_MULTIPLE`` (mpi4py's default) MPICH guards every
call with a global lock and yields the CPU (``sched_yield``) while it progresses an RMA
flush or atomic, which on a node with more ranks than CPUs made such calls wait for other
ranks' time slices (a fetch-and-add + flush: median 186 us against 17 us under
SERIALIZED, 4 ranks on 2 CPUs). Only the pipeline's communication thread calls MPI off
the main thread: ``multiple`` enables it. Why the tcache and the heap's thresholds:
``hpcps.core.malloc``. MPI settings: :func:`mpi_settings`.
"""

import os
import sys

from . import malloc
from .settings import THREAD_LEVELS

__all__ = ["prepare_process", "mpi_settings", "has_rdma"]

_RDMA_DEVICES = "/sys/class/infiniband"


def mpi_settings(environ=os.environ, rdma_devices: str = _RDMA_DEVICES) -> dict:
    """What hpcps sets in the environment for the MPI library, where the user set nothing:
    ``{variable: value}``. Open MPI's UCX one-sided component (``osc/ucx``) needs an RDMA device;
    without one it prints ``OSC UCX component priority set inside component query failed`` on
    every rank at start and is not used anyway, so where ``rdma_devices`` lists none,
    ``OMPI_MCA_osc=^ucx`` (MPICH ignores the variable). Local, pure."""
    out = {}
    if "OMPI_MCA_osc" not in environ and not has_rdma(rdma_devices):
        out["OMPI_MCA_osc"] = "^ucx"
    return out


def has_rdma(rdma_devices: str = _RDMA_DEVICES) -> bool:
    """Whether this node lists an RDMA device (``/sys/class/infiniband``). Local."""
    try:
        return bool(os.listdir(rdma_devices))
    except OSError:
        return False


def prepare_process(thread_level: str | None = "serialized", malloc_tune: bool = True, restart: bool = True) -> str:
    """Set the MPI thread level mpi4py asks for and glibc's heap handling, before MPI starts. Local.

    thread_level: one of ``hpcps.core.settings.THREAD_LEVELS``, or None to leave mpi4py's
        choice. ``MPI4PY_RC_THREAD_LEVEL`` in the environment wins, as in mpi4py.
    malloc_tune: keep the workers' heap from fragmenting and a freed block's pages in the
        process (``hpcps.core.malloc``); False leaves the allocator alone (no restart, no trim,
        glibc's moving thresholds).
    restart: where this process runs ``hpcps train``, start it again at once with
        glibc's tcache off (``hpcps.core.malloc.restart_without_tcache``; glibc reads
        its tunables only at start). Does nothing once MPI has started.

    Also sets :func:`mpi_settings` in ``os.environ``.

    Returns the thread level mpi4py will ask for (``"already started"`` when MPI runs
    already, which is then left alone). Raises ``ValueError`` on an unknown level.
    """
    if thread_level is not None and thread_level not in THREAD_LEVELS:
        raise ValueError(f"thread level (job.mpi_threads) must be one of {THREAD_LEVELS}, got {thread_level!r}")
    malloc.set_tuning(malloc_tune)
    malloc.keep_pages()
    if "mpi4py.MPI" in sys.modules:
        return "already started"
    os.environ.update(mpi_settings())
    if restart:
        malloc.restart_without_tcache()
    import mpi4py
    if "MPI4PY_RC_THREAD_LEVEL" in os.environ:
        return os.environ["MPI4PY_RC_THREAD_LEVEL"]
    if thread_level is not None:
        mpi4py.rc.thread_level = thread_level
    return mpi4py.rc.thread_level
