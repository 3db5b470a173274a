"""The hpcps context: the role split, plus the step protocol and the shard locks of the tables.

``hpcps.init`` splits the world communicator (:class:`hpcps.runtime.topology.Topology`)
and returns a :class:`Context`. PS ranks hold table shards and wait in
:meth:`Context.serve`; workers run the model, mark steps with
:meth:`Context.step_begin` / :meth:`Context.step_end`, and call
:meth:`Context.finalize` when done, which releases the PS ranks.
"""

import os
import time
import weakref

from mpi4py import MPI

from ..core import malloc as _malloc
from ..core import wait as _wait
from ..core.layout import PS_LAYOUTS, check_launch, check_num_ps
from ..core.locks import ShardLocks
from ..core.process import has_rdma
from ..core.settings import RMA_READS, TRANSPORTS, WAIT_POLICIES, parse_mode
from ..core.window import window_kind
from ..core.errors import FreedError, RoleError
from ..sparse.control import StepControl
from ..sparse.pull_server import PullServer
from .topology import Topology, abort_on_uncaught

__all__ = ["init", "Context", "open_contexts", "abandon_open"]

_open = 0                   # contexts made and not finalized, in this process
_made: list = []            # weak references to them (abandon_open)


def open_contexts() -> int:
    """How many contexts of this process are made and not finalized: while one is, an error on
    this rank alone must end the whole job (the other ranks may wait in it). Local."""
    return _open


def abandon_open() -> int:
    """Give up every context of this process that is not finalized, freeing nothing (a rank of the
    job was lost: its windows and communicators cannot be freed collectively; they stay until the
    process ends). Returns how many. Local."""
    global _open
    gone = sum(ctx.abandon() for ctx in (ref() for ref in _made) if ctx is not None)
    _made.clear()
    _open = 0
    return gone


def init(num_ps: int | None = None, comm: MPI.Comm | None = None, *,
         transport: str | None = None, mode: str | None = None, wait: str | None = None,
         rma_read: str | None = None, world_size: int | None = None, progress_timeout: float | None = None,
         ps_layout: str | None = None, deterministic: bool | None = None,
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
    wait: how a waiting rank waits (``hpcps.core.wait``): ``"auto"``, ``"yield"`` or
        ``"sleep"``. Default ``$HPCPS_WAIT``, else auto (sleep where the node's ranks
        outnumber its CPUs).
    rma_read: how a pull reads a shard on another node: ``"get_accumulate"`` (atomic per
        element under the MPI standard), ``"get"`` (faster; safe where the MPI's reads of aligned
        floats are not torn) or ``"messages"`` (the worker asks the owning PS, which answers from
        its serve loop: ``hpcps.sparse.pull_server``). ``"auto"``: ``messages`` where the ranks
        span several nodes and some node lists no RDMA device (``/sys/class/infiniband``): over
        TCP one-sided reads are emulated (Open MPI's ``osc/rdma`` sends an active message per row,
        MPICH's need the target in MPI): messages made the main job across pretend hosts faster
        under both (docs/benchmarks.md, "MPI libraries"). Else ``get`` where windows are made with
        ``Win.Create`` (its many-row ``Get_accumulate`` took 1.3-1.6 s), else ``get_accumulate``.
        Default ``$HPCPS_RMA_READ``, else auto.
    progress_timeout: seconds a wait may see no progress (a stopped or stuck rank) before it
        raises ``hpcps.core.errors.StalledError`` naming what it waited for, which ends the job; 0
        waits forever. Default ``$HPCPS_PROGRESS_TIMEOUT``, else 600.
    ps_layout: which ranks become PS (``hpcps.core.layout.place_ps``): ``"spread"`` (round
        robin over nodes, highest local ranks first) or ``"last"`` (the highest world ranks:
        the last node(s) under block placement). Default ``$HPCPS_PS_LAYOUT``, else spread.
    deterministic: sync mode only: the PS sums each step's pushes in worker order (every push
        through the worker's slot in the PS's push mailbox; every table applied by the PS), so
        two runs of one layout give the same bits. Default ``$HPCPS_DETERMINISTIC`` (0/1),
        else False.
    world_size: when given, the world must have exactly this many ranks (default
        ``$HPCPS_WORLD_SIZE``, else not checked).
    abort_on_error: install a ``sys.excepthook`` that calls ``MPI_Abort`` so an
        uncaught exception on one rank ends the job instead of hanging it.

    Raises ``ValueError`` on every rank, before any window exists, when
    ``num_ps < 1``, ``num_ps >= world size``, or ranks disagree on ``num_ps``, and
    before any communication when the world is smaller than the launch (tasks
    that each run as rank 0 of 1: see :func:`hpcps.core.layout.check_launch`).
    """
    world = MPI.COMM_WORLD if comm is None else comm
    if world is MPI.COMM_WORLD:
        check_launch(world.Get_size(), os.environ, world_size)
    if num_ps is None:
        num_ps = os.environ.get("HPCPS_NUM_PS", "1")
    num_ps = check_num_ps(num_ps, world.Get_size())
    transport = transport or os.environ.get("HPCPS_TRANSPORT", "auto")
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    mode = mode or os.environ.get("HPCPS_MODE", "async")
    parse_mode(mode)
    wait = wait or os.environ.get("HPCPS_WAIT", "auto")
    if wait not in WAIT_POLICIES:
        raise ValueError(f"wait (HPCPS_WAIT) must be one of {WAIT_POLICIES}, got {wait!r}")
    if progress_timeout is None:
        progress_timeout = os.environ.get("HPCPS_PROGRESS_TIMEOUT", _wait.PROGRESS_TIMEOUT_S)
    try:
        progress_timeout = float(progress_timeout)
        _wait.set_progress_timeout(progress_timeout)
    except (TypeError, ValueError):
        raise ValueError(f"progress_timeout (HPCPS_PROGRESS_TIMEOUT) must be seconds >= 0, got "
                         f"{progress_timeout!r}") from None
    rma_read = rma_read or os.environ.get("HPCPS_RMA_READ", "auto")
    if rma_read not in RMA_READS:
        raise ValueError(f"rma_read (HPCPS_RMA_READ) must be one of {RMA_READS}, got {rma_read!r}")
    ps_layout = ps_layout or os.environ.get("HPCPS_PS_LAYOUT", "spread")
    if ps_layout not in PS_LAYOUTS:
        raise ValueError(f"ps_layout (HPCPS_PS_LAYOUT) must be one of {PS_LAYOUTS}, got {ps_layout!r}")
    if deterministic is None:
        deterministic = os.environ.get("HPCPS_DETERMINISTIC", "0") not in ("", "0", "false")
    deterministic = bool(deterministic)
    if deterministic and parse_mode(mode)[0] != "sync":
        raise ValueError(f"deterministic needs mode 'sync' (the order of updates in {mode!r} depends on timing)")
    seen = world.allgather((num_ps, transport, mode, ps_layout, deterministic))
    if len(set(seen)) != 1:
        raise ValueError(f"ranks disagree on (num_ps, transport, mode, ps_layout, deterministic): {sorted(set(seen))}")
    if abort_on_error:
        abort_on_uncaught(world)
    _malloc.keep_pages()            # a pull's result keeps its pages (hpcps.core.malloc)
    return Context(world, num_ps, transport, mode, wait, rma_read, ps_layout, deterministic)


class Context(Topology):
    """Communicators, roles, step protocol and shard locks of one hpcps job. Made by :func:`init`."""

    def __init__(self, world: MPI.Comm, num_ps: int, transport: str, mode: str = "async", wait: str = "auto",
                 rma_read: str = "auto", ps_layout: str = "spread", deterministic: bool = False):
        global _open
        super().__init__(world, num_ps, transport, wait, ps_layout)
        _open += 1
        _made.append(weakref.ref(self))
        self.mode = mode
        self.deterministic = deterministic
        self._tables = []          # live tables, in creation order (frees are collective)
        self._served = False
        self._finalized = False
        self._service_hooks = []   # PS: (hook, what its work counts as), called on every poll of the serve loop
        self.busy_s = {}           # PS: seconds of the serve loop's polls that did work, by kind (hpcps.monitor)
        self.rows_applied = 0      # PS: rows its applies updated
        self._resources = []       # freed collectively in finalize, after the tables
        self.window_kind = window_kind(world)      # how its windows are made (hpcps.core.window)
        # every node lists an RDMA device: Open MPI's one-sided operations between nodes are real
        self.rdma = bool(world.allreduce(has_rdma(), op=MPI.LAND))
        self.rma_read = self.resolve_rma_read(rma_read)
        self.control = StepControl(self, mode)
        # rma_read = "messages": the PS ranks answer the fixed tables' pulls from their serve loop
        self.pull_server = PullServer(self) if self.rma_read == "messages" else None
        if self.pull_server is not None:
            self.add_resource(self.pull_server)
        # one lock (and one count of staged pushes) per PS for all its tables: a worker pushes a
        # step's gradients of every table under one acquisition (hpcps.sparse.push.push_many)
        self.shard_locks = ShardLocks(world, self.is_ps, what="shards")

    def resolve_rma_read(self, rma_read: str) -> str:
        """``rma_read`` with ``auto`` resolved for this job's windows (:func:`init`). Local."""
        if rma_read != "auto":
            return rma_read
        if len(set(self.node_of_rank)) > 1 and not self.rdma:
            return "messages"
        return "get" if self.window_kind == "create" else "get_accumulate"

    # -- what lives as long as the context ---------------------------------
    @property
    def tables(self) -> tuple:
        """The live tables of this context, in creation order. Local."""
        return tuple(self._tables)

    def register(self, table) -> None:
        """Called by a table once its windows exist: ``finalize`` frees it (in creation order). Local."""
        self.check_open()
        self._tables.append(table)

    def forget(self, table) -> None:
        """Called by a table's ``free()``. Local."""
        if table in self._tables:
            self._tables.remove(table)

    def add_resource(self, resource) -> None:
        """Have ``finalize`` call ``resource.free()`` (collective), after the tables. Local."""
        self._resources.append(resource)

    def add_service_hook(self, hook, kind: str = "other") -> None:
        """PS: call ``hook()`` on every poll of the serve loop (checkpoint requests); a true result
        means it did work, and the loop polls again without pausing; the time of such a call adds
        to ``busy_s[kind]``. Local."""
        self._service_hooks.append((hook, kind))

    def _poll(self) -> bool:
        """PS: one poll of the serve loop: apply what the mode allows, run the hooks; the time of
        each that worked adds to :attr:`busy_s`. Whether anything worked. Local."""
        t0 = time.perf_counter()
        worked = self.control.service(self._tables)
        t1 = time.perf_counter()
        if worked:
            self.busy_s["apply"] = self.busy_s.get("apply", 0.0) + t1 - t0
        for hook, kind in self._service_hooks:      # every hook runs
            if hook():
                t0, t1 = t1, time.perf_counter()
                self.busy_s[kind] = self.busy_s.get(kind, 0.0) + t1 - t0
                worked = True
            else:
                t1 = time.perf_counter()
        return worked

    def check_open(self) -> None:
        """Raise ``FreedError`` once :meth:`finalize` ran. Local."""
        if self._finalized:
            raise FreedError("hpcps context was used after finalize()")

    def _wait_all_workers_done(self) -> None:
        # Non-blocking barrier over the world, polled through MPI so that RMA
        # aimed at this rank keeps progressing; yield the CPU between polls.
        req = self.world.Ibarrier()
        misses, started = 0, time.monotonic()
        while not req.Test():
            seen = self.control.bell()               # before looking: a ring after it is not lost
            if self.is_ps:
                misses = 0 if self._poll() else misses + 1
                if misses % 64 == 63:
                    _wait.check_faults()             # a lost rank (hpcps.core.faults)
            else:
                misses += 1
                _wait.overdue(started, misses, "this worker finished; the other ranks have not reached finalize()")
            _wait.pause(max(misses, 1), self.control.bell_word, seen)
        if self.is_ps:                       # every push is in: apply whatever is still staged
            self.control.service(self._tables, final=True)
            for hook, _ in self._service_hooks:
                hook()

    # -- the step protocol (workers) -----------------------------------------
    def step_begin(self, step: int) -> int:
        """Worker, before the pulls of ``step``: wait as the mode requires. Returns the staleness seen.

        sync: until every push of ``step - 1`` is applied; ssp:S: until the
        slowest worker is at most S steps behind; async: no wait. Local (one-sided).
        """
        self.check_open()
        if not self.is_worker:
            raise RoleError("step_begin() is for worker ranks")
        return self.control.begin(step)

    def step_end(self, step: int) -> None:
        """Worker, after every push of ``step`` returned. Local (one-sided).

        Every ``hpcps.core.malloc.TRIM_EVERY`` steps it then returns the heap's free pages to the
        system (glibc ``malloc_trim``), so a long run's resident memory stays flat, unless the
        process runs with glibc's tcache off (``hpcps train`` does; see ``hpcps.core.malloc``).
        """
        self.check_open()
        if not self.is_worker:
            raise RoleError("step_end() is for worker ranks")
        self.control.end(step)
        if (step + 1) % _malloc.TRIM_EVERY == 0:
            _malloc.trim_heap()

    def fence(self, step: int) -> None:
        """Worker: wait until every push of steps ``< step`` by every worker is applied. Local.

        Every worker must have called ``step_end(step - 1)`` or this waits forever.
        """
        self.check_open()
        if not self.is_worker:
            raise RoleError("fence() is for worker ranks")
        self.control.fence(step)

    def serve(self) -> None:
        """Serve table requests until every worker has called ``finalize()``.

        PS ranks only. Create every table before calling it. Collective over the
        world communicator (pairs with the workers' ``finalize``).
        """
        self.check_open()
        if not self.is_ps:
            raise RoleError("serve() is for PS ranks; workers call finalize() when done")
        if self._served:
            return
        self.control.note_serving()
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
        self.free()
        self._finalized = True
        global _open
        _open -= 1

    def abandon(self) -> bool:
        """Give up this context without freeing anything (:func:`abandon_open`); later calls raise
        ``FreedError``. Whether it was open. Local."""
        was_open, self._finalized = not self._finalized, True
        return was_open

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
