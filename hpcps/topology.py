"""Role split: which ranks are parameter servers, which are workers.

``hpcps.init`` splits the world communicator into a PS group and a worker
group and returns a :class:`Context`. PS ranks hold table shards and wait in
:meth:`Context.serve`; workers run the model and call :meth:`Context.finalize`
when done, which releases the PS ranks.
"""

import logging
import os
import sys
import time
import traceback

from mpi4py import MPI

from . import _malloc, _wait
from .errors import FreedError, RoleError
from .layout import check_launch, check_num_ps, spread_ps
from .sparse.control import StepControl, parse_mode
from .sparse.lock import ShardLocks

__all__ = ["init", "Context", "TRANSPORTS"]

logger = logging.getLogger(__name__)

TRANSPORTS = ("auto", "rma")
ABORT_GRACE_S = 0.3         # an uncaught exception's traceback gets this long to reach the launcher


def _abort_on_uncaught(world: MPI.Comm):
    """Make an uncaught exception on one rank end the whole job (like ``python -m mpi4py``)."""
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


def init(num_ps: int | None = None, comm: MPI.Comm | None = None, *,
         transport: str | None = None, mode: str | None = None,
         abort_on_error: bool = True) -> "Context":
    """Split ranks into PS and worker groups. Collective over ``comm`` (default ``MPI.COMM_WORLD``).

    num_ps: number of PS ranks; default ``$HPCPS_NUM_PS``, else 1. An explicit
        argument wins over the environment.
    transport: ``"auto"`` reads shards of PS ranks on the same node straight
        from shared memory and uses RMA across nodes; ``"rma"`` forces the
        cross-node path (RMA) everywhere. Default ``$HPCPS_TRANSPORT``, else auto.
    mode: consistency of stateful sparse updates across steps: ``"sync"``,
        ``"async"`` or ``"ssp:S"`` (see :class:`hpcps.sparse.control.StepControl`).
        Default ``$HPCPS_MODE``, else async.
    abort_on_error: install a ``sys.excepthook`` that calls ``MPI_Abort`` so an
        uncaught exception on one rank ends the job instead of hanging it.

    Raises ``ValueError`` on every rank, before any window exists, when
    ``num_ps < 1``, ``num_ps >= world size``, or ranks disagree on ``num_ps``, and
    before any communication when the world is smaller than the launch (tasks
    that each run as rank 0 of 1: see :func:`hpcps.layout.check_launch`).
    """
    world = MPI.COMM_WORLD if comm is None else comm
    if world is MPI.COMM_WORLD:
        check_launch(world.Get_size(), os.environ)
    if num_ps is None:
        num_ps = os.environ.get("HPCPS_NUM_PS", "1")
    num_ps = check_num_ps(num_ps, world.Get_size())
    transport = transport or os.environ.get("HPCPS_TRANSPORT", "auto")
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    mode = mode or os.environ.get("HPCPS_MODE", "async")
    parse_mode(mode)
    wait = os.environ.get("HPCPS_WAIT", "auto")
    if wait not in _wait.WAIT_POLICIES:
        raise ValueError(f"HPCPS_WAIT must be one of {_wait.WAIT_POLICIES}, got {wait!r}")
    seen = world.allgather((num_ps, transport, mode))
    if len(set(seen)) != 1:
        raise ValueError(f"ranks disagree on (num_ps, transport, mode): {sorted(set(seen))}")
    if abort_on_error:
        _abort_on_uncaught(world)
    return Context(world, num_ps, transport, mode, wait)


def _node_cpus(node_comm: MPI.Comm) -> int:
    """CPUs the ranks of this node may run on, together (the union of their affinity masks).
    Collective over ``node_comm``."""
    try:
        mine = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        mine = list(range(os.cpu_count() or 1))
    return len(set().union(*node_comm.allgather(mine)))


class Context:
    """Communicators and roles of one hpcps job. Made by :func:`init`."""

    def __init__(self, world: MPI.Comm, num_ps: int, transport: str, mode: str = "async", wait: str = "auto"):
        self.world = world
        self.transport = transport
        self.mode = mode
        self.node_comm = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
        # more ranks than CPUs here: waiting ranks sleep instead of spinning (hpcps/_wait.py)
        self.node_cpus = _node_cpus(self.node_comm)
        self.oversubscribed = self.node_comm.Get_size() > self.node_cpus
        if wait == "auto":
            wait = "sleep" if self.oversubscribed else "yield"
        _wait.set_policy(wait)
        self.wait_policy = wait
        node_leader = self.node_comm.bcast(world.Get_rank(), root=0)
        node_of_rank = world.allgather(node_leader)
        self.ps_world_ranks = spread_ps(node_of_rank, num_ps)
        self.worker_world_ranks = [r for r in range(world.Get_size()) if r not in set(self.ps_world_ranks)]
        me = world.Get_rank()
        self.is_ps = me in self.ps_world_ranks
        self.is_worker = not self.is_ps
        self.num_ps = num_ps
        self.num_workers = world.Get_size() - num_ps
        self.node_ranks = frozenset(r for r, n in enumerate(node_of_rank) if n == node_leader)
        color = 0 if self.is_ps else 1
        both = world.Split(color, key=me)
        self.ps_comm = both if self.is_ps else MPI.COMM_NULL
        self.worker_comm = both if self.is_worker else MPI.COMM_NULL
        self.ps_rank = self.ps_world_ranks.index(me) if self.is_ps else -1
        self.worker_rank = self.worker_world_ranks.index(me) if self.is_worker else -1
        self._tables = []          # live tables, in creation order (frees are collective)
        self._served = False
        self._finalized = False
        self._service_hooks = []   # PS: called on every poll of the serve loop
        self._resources = []       # freed collectively in finalize, after the tables
        self.control = StepControl(self, mode)
        # one lock (and one count of staged pushes) per PS for all its tables: a worker pushes a
        # step's gradients of every table under one acquisition (hpcps.sparse.table.push_many)
        self.shard_locks = ShardLocks(world, self.is_ps, what="shards")
        logger.debug("rank %d: %s, %d PS at %s", me, "PS" if self.is_ps else "worker",
                     num_ps, self.ps_world_ranks)

    # -- tables register here so finalize can free them in creation order ---
    def _register(self, table) -> None:
        self._check_open()
        self._tables.append(table)

    def _forget(self, table) -> None:
        if table in self._tables:
            self._tables.remove(table)

    def _check_open(self):
        if self._finalized:
            raise FreedError("hpcps context was used after finalize()")

    @property
    def rank(self) -> int:
        """World rank of this process."""
        return self.world.Get_rank()

    def _wait_all_workers_done(self) -> None:
        # Non-blocking barrier over the world, polled through MPI so that RMA
        # aimed at this rank keeps progressing; yield the CPU between polls.
        req = self.world.Ibarrier()
        misses = 0
        while not req.Test():
            seen = self.control.bell()               # before looking: a ring after it is not lost
            if self.is_ps:
                misses = 0 if self.control.service(self._tables) else misses + 1
                for hook in self._service_hooks:
                    hook()
            else:
                misses += 1
            _wait.pause(max(misses, 1), self.control.bell_word, seen)
        if self.is_ps:                       # every push is in: apply whatever is still staged
            self.control.service(self._tables, final=True)
            for hook in self._service_hooks:
                hook()

    # -- the step protocol (workers) -----------------------------------------
    def step_begin(self, step: int) -> int:
        """Worker, before the pulls of ``step``: wait as the mode requires. Returns the staleness seen.

        sync: until every push of ``step - 1`` is applied; ssp:S: until the
        slowest worker is at most S steps behind; async: no wait. Local (one-sided).
        """
        self._check_open()
        if not self.is_worker:
            raise RoleError("step_begin() is for worker ranks")
        return self.control.begin(step)

    def step_end(self, step: int) -> None:
        """Worker, after every push of ``step`` returned. Local (one-sided).

        Every ``hpcps._malloc.TRIM_EVERY`` steps it then returns the heap's free pages to the
        system (glibc ``malloc_trim``), so a long run's resident memory stays flat, unless the
        process runs with glibc's tcache off (``hpcps train`` does; see ``hpcps._malloc``).
        """
        self._check_open()
        if not self.is_worker:
            raise RoleError("step_end() is for worker ranks")
        self.control.end(step)
        if (step + 1) % _malloc.TRIM_EVERY == 0:
            _malloc.trim_heap()

    def fence(self, step: int) -> None:
        """Worker: wait until every push of steps ``< step`` by every worker is applied. Local.

        Every worker must have called ``step_end(step - 1)`` or this waits forever.
        """
        self._check_open()
        if not self.is_worker:
            raise RoleError("fence() is for worker ranks")
        self.control.fence(step)

    def serve(self) -> None:
        """Serve table requests until every worker has called ``finalize()``.

        PS ranks only. Create every table before calling it. Collective over the
        world communicator (pairs with the workers' ``finalize``).
        """
        self._check_open()
        if not self.is_ps:
            raise RoleError("serve() is for PS ranks; workers call finalize() when done")
        if self._served:
            return
        self._wait_all_workers_done()
        self._served = True

    def finalize(self) -> None:
        """Release the PS ranks and free every table and communicator. Collective over the world.

        Workers call it when they are done; on a PS rank it first serves until
        all workers are done. A second call does nothing.
        """
        if self._finalized:
            return
        if self.is_ps:
            self.serve()
        else:
            self._wait_all_workers_done()
        for t in list(self._tables):
            t.free()
        for r in self._resources:
            r.free()
        self.shard_locks.free()
        self.control.free()
        comm = self.ps_comm if self.is_ps else self.worker_comm
        comm.Free()
        self.node_comm.Free()
        self.ps_comm = self.worker_comm = MPI.COMM_NULL
        self._finalized = True

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, etype, value, tb) -> bool:
        if etype is None:
            self.finalize()
        # On an exception, skip the collective finalize: the other ranks may
        # never reach it. The exception propagates; the excepthook aborts the job.
        return False

    def __repr__(self) -> str:
        role = f"ps {self.ps_rank}" if self.is_ps else f"worker {self.worker_rank}"
        return (f"<hpcps.Context rank {self.rank}/{self.world.Get_size()}: {role}, num_ps={self.num_ps}, "
                f"mode={self.mode}>")
