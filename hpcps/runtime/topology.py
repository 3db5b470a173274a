"""Role split: which ranks are parameter servers, which are workers, and where they run.

:class:`Topology` splits the world communicator into a PS group and a worker
group, finds the ranks of this node (MPI shared-memory communicator) and the
CPUs they may use, and picks how waiting ranks wait (``hpcps.core.wait``). It
knows nothing of tables or of the step protocol: :class:`hpcps.runtime.context.Context`
adds those on top.
"""

import logging
import os
import sys
import time
import traceback

from mpi4py import MPI

from ..core import wait as _wait
from ..core.faults import track
from ..core.layout import place_ps

__all__ = ["Topology", "abort_on_uncaught", "node_keys", "ABORT_GRACE_S"]

logger = logging.getLogger(__name__)

ABORT_GRACE_S = 0.3         # an uncaught exception's traceback gets this long to reach the launcher


def abort_on_uncaught(world: MPI.Comm) -> None:
    """Make an uncaught exception on one rank end the whole job (like ``python -m mpi4py``). Local."""
    if world.Get_size() == 1 or sys.excepthook is not sys.__excepthook__:
        return

    def hook(etype, value, tb):
        # one write, then a pause: the launcher forwards a rank's output while the job runs, and
        # once MPI_Abort kills the job it may drop what it has not read yet (under load, 2 of 60
        # launches lost the traceback after its first line, written line by line just before)
        try:
            sys.stderr.write(f"hpcps: uncaught exception on world rank {world.Get_rank()}, aborting the job\n"
                             + "".join(traceback.format_exception(etype, value, tb)))
            sys.stderr.flush()
        finally:
            time.sleep(ABORT_GRACE_S)
            MPI.COMM_WORLD.Abort(1)

    sys.excepthook = hook


def _node_cpus(node_comm: MPI.Comm) -> int:
    """CPUs the ranks of this node may run on, together (the union of their affinity masks).
    Collective over ``node_comm``."""
    try:
        mine = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        mine = list(range(os.cpu_count() or 1))
    return len(set().union(*node_comm.allgather(mine)))


def node_keys(world: MPI.Comm, node_comm: MPI.Comm) -> list:
    """Each world rank's node key: the world rank of its node's first rank (``node_comm``: this
    rank's node, a shared-memory split of ``world``). Collective over ``world``."""
    return world.allgather(node_comm.bcast(world.Get_rank(), root=0))


class Topology:
    """Communicators, roles and node facts of one job. Collective over ``world`` (it splits it).

    ``transport`` (``"auto"`` or ``"rma"``) is kept for the layers above; ``wait``
    (``hpcps.core.settings.WAIT_POLICIES``) sets this process's wait policy; ``ps_layout``
    (``hpcps.core.layout.PS_LAYOUTS``) says which ranks become PS.
    """

    def __init__(self, world: MPI.Comm, num_ps: int, transport: str = "auto", wait: str = "auto",
                 ps_layout: str = "spread"):
        self.world = world
        self.transport = transport
        self.node_comm = track(world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank()))
        # more ranks than CPUs here: waiting ranks sleep instead of spinning (hpcps/core/wait.py)
        self.node_cpus = _node_cpus(self.node_comm)
        self.oversubscribed = self.node_comm.Get_size() > self.node_cpus
        if wait == "auto":
            wait = "sleep" if self.oversubscribed else "yield"
        _wait.set_policy(wait)
        self.wait_policy = wait
        node_of_rank = node_keys(world, self.node_comm)
        node_leader = node_of_rank[world.Get_rank()]
        self.ps_world_ranks = place_ps(node_of_rank, num_ps, ps_layout)
        self.node_of_rank = node_of_rank
        self.worker_world_ranks = [r for r in range(world.Get_size()) if r not in set(self.ps_world_ranks)]
        me = world.Get_rank()
        self.is_ps = me in self.ps_world_ranks
        self.is_worker = not self.is_ps
        self.num_ps = num_ps
        self.num_workers = world.Get_size() - num_ps
        self.node_ranks = frozenset(r for r, n in enumerate(node_of_rank) if n == node_leader)
        self.node_workers = [r for r in self.worker_world_ranks if r in self.node_ranks]   # this host's, ascending
        color = 0 if self.is_ps else 1
        both = track(world.Split(color, key=me))
        self.ps_comm = both if self.is_ps else MPI.COMM_NULL
        self.worker_comm = both if self.is_worker else MPI.COMM_NULL
        self.ps_rank = self.ps_world_ranks.index(me) if self.is_ps else -1
        self.worker_rank = self.worker_world_ranks.index(me) if self.is_worker else -1
        logger.debug("rank %d: %s, %d PS at %s", me, "PS" if self.is_ps else "worker",
                     num_ps, self.ps_world_ranks)

    @property
    def rank(self) -> int:
        """World rank of this process."""
        return self.world.Get_rank()

    def free(self) -> None:
        """Free the communicators this split made. Collective over the world; safe twice."""
        if self.node_comm == MPI.COMM_NULL:
            return
        comm = self.ps_comm if self.is_ps else self.worker_comm
        comm.Free()
        self.node_comm.Free()
        self.ps_comm = self.worker_comm = self.node_comm = MPI.COMM_NULL
