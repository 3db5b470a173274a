"""Consistency modes: ``sync``, ``async`` and ``ssp:S`` over one small RMA window.

Each PS rank exposes ``int64[4 + W]``: ``[0]`` counts step completions
reported by workers, ``[1]`` is the number of steps this PS has applied, on
PS 0 ``[2 + w]`` is worker ``w``'s clock (steps finished), ``[2 + W]`` is 1
once this PS was asked to stop (a signal to the PS alone: :meth:`StepControl.ps_asked_to_stop`),
and ``[3 + W]`` is 1 once it serves (:meth:`StepControl.ps_serving`).

Workers call ``begin(t)`` before pulling for step ``t`` and ``end(t)`` after
their pushes of step ``t`` completed:

- ``sync``: ``end`` adds 1 to every PS's completion counter; a PS applies the
  staged gradients of step ``t`` once all ``W`` workers completed it, then
  publishes ``applied = t + 1``; ``begin(t + 1)`` waits for that on every PS.
  So every push of step ``t`` is applied before any pull of step ``t + 1``.
- ``async``: no waiting; PS ranks apply staged gradients as they arrive.
- ``ssp:S``: as async, but ``begin(t)`` waits until the slowest worker's clock
  is at least ``t - S``; the staleness seen (``t - min clock``) is recorded.

``fence(t)`` (any mode) waits until every PS applied everything pushed by
workers through step ``t - 1``: used before evaluation and checkpoints.
"""

import time

import numpy as np
from mpi4py import MPI

from ..core import wait as _wait
from ..core.settings import parse_mode
from ..core.wait import backoff
from ..core.window import Window
from .staging import apply_staged

__all__ = ["StepControl"]


class StepControl:
    """The step protocol of one context. Collective over the world (creates a window)."""

    def __init__(self, ctx, mode: str):
        self.kind, self.bound = parse_mode(mode)
        self.mode = mode
        self.ctx = ctx
        W = ctx.num_workers
        self._win = Window(ctx.world, (4 + W) * 8 if ctx.is_ps else 0, what="step control")
        # the words of this PS (its own memory), and of each PS on this node as shared memory: read
        # and written with plain loads and stores between Win_sync barriers. The PS polls its counter
        # dozens of times a step, and an MPI atomic on a window shared by busy ranks cost 40 us or
        # more a call on this VM; aligned int64 loads and stores are single-copy atomic. Workers still
        # add to the completion counter with an MPI atomic (several of them add to it at once).
        self._mine = self._win.local(np.int64) if ctx.is_ps else None
        if ctx.is_ps:
            self._mine[:] = 0
            self._win.sync()
        self._views = {}
        if ctx.is_worker and ctx.transport == "auto":
            for r in ctx.ps_world_ranks:
                mem = self._win.shared(r, np.int64, 4 + W) if r in ctx.node_ranks else None
                if mem is not None:
                    self._views[r] = mem
        # doorbells (oversubscribed node, Linux): a waiting rank sleeps on a futex on these words
        # instead of waking every few tens of us to poll them (hpcps/core/wait.py). A worker rings each
        # PS on its node after adding to its completion counter; a PS rings the workers after
        # publishing a step. The PS sleeps on its counter only when every worker shares its node
        # (a remote worker cannot ring it); every sleep ends after _wait.BELL_TIMEOUT_S anyway.
        self.bells = _wait.bells() and ctx.transport == "auto"
        ps_bell = self.bells and ctx.is_ps and all(r in ctx.node_ranks for r in ctx.worker_world_ranks)
        self.bell_word = self._mine.ctypes.data if ps_bell else None   # PS: its counter, or None
        self._one = np.ones(1, np.int64)
        self._res = np.zeros(1, np.int64)
        self._clocks = np.zeros(W, np.int64)
        self._ignored = np.zeros(W, np.int64)      # origin of NO_OP reads (ignored by MPI)
        self.step = 0                    # worker: current step; PS: steps applied
        self.staleness: list[int] = []   # worker, ssp/async: t - slowest clock at begin(t)
        self.wait_seconds = 0.0
        self.wait_by_ps = np.zeros(ctx.num_ps)      # worker: seconds waiting for each PS's applies (fences)
        self.before_apply = []           # PS, sync: called before each step's apply (checkpoint cuts)
        self.on_end = []                 # worker: called with the step at each end(), before it is counted
        self.before_publish = []         # PS, async/ssp: called with the step-end count before a publish
        self.first_done = 0              # the step-end count this run started from (set_start)

    def set_start(self, step: int) -> None:
        """Every rank, before training resumes at ``step``: counters as if steps ``< step`` ran.
        Collective over the world."""
        W = self.ctx.num_workers
        self.first_done = step * W
        if self.ctx.is_ps:
            self._mine[0], self._mine[1] = step * W, step
            self._mine[2:2 + W] = step
            self._win.sync()
        self.step = step
        # a PS may be loading a large checkpoint: the others sleep meanwhile (a Barrier spins, on
        # CPUs the PS needs), and no progress timeout applies (a load takes as long as it takes)
        _wait.quiet_barrier(self.ctx.world)

    # ------------------------------------------------------------ worker side
    def _read(self, rank: int, disp: int, count: int = 1) -> np.ndarray:
        out = self._res if count == 1 else self._clocks[:count]
        view = self._views.get(rank)
        if view is not None:                # a PS on this node: a load after a barrier
            self._win.sync()
            out[:] = view[disp:disp + count]
            return out
        win = self._win.win
        win.Get_accumulate([self._ignored[:count], MPI.INT64_T], [out, MPI.INT64_T], rank,
                           (disp * 8, count, MPI.INT64_T), op=MPI.NO_OP)
        win.Flush(rank)
        return out

    def _wait_applied(self, step: int) -> None:
        for p, rank in enumerate(self.ctx.ps_world_ranks):
            t0 = time.perf_counter()
            view = self._views.get(rank) if self.bells else None
            word = view.ctypes.data + 8 if view is not None else None     # asleep until the PS publishes
            misses, started = 0, time.monotonic()
            while (applied := int(self._read(rank, 1)[0])) < step:
                misses += 1
                _wait.pause(misses, word, applied)
                _wait.overdue(started, misses, lambda: self._stall_report(rank, step, applied))
            self.wait_by_ps[p] += time.perf_counter() - t0

    def _stall_report(self, rank: int, step: int, applied: int) -> str:
        """Who holds up step ``step``: the workers that have not finished it, or the PS. Local (one-sided)."""
        clocks = self._read(self.ctx.ps_world_ranks[0], 2, self.ctx.num_workers).copy()
        late = [self.ctx.worker_world_ranks[w] for w in np.flatnonzero(clocks < step).tolist()]
        if late:
            return (f"waiting for step {step - 1} to be applied: worker world rank(s) {late} have not finished it "
                    f"(their clocks {clocks[clocks < step].tolist()})")
        return (f"waiting for PS world rank {rank} to apply step {step - 1}: every worker finished it, the PS has "
                f"applied {applied} steps (is it stopped or stuck?)")

    def begin(self, step: int) -> int:
        """Worker, before pulling for ``step``: wait as the mode asks; returns the staleness seen. Local."""
        t0 = time.perf_counter()
        self.step = step
        stale = 0
        if self.kind == "sync":
            if step > 0:
                self._wait_applied(step)
        elif self.kind == "ssp" or self.kind == "async":
            ps0 = self.ctx.ps_world_ranks[0]
            misses, started = 0, time.monotonic()
            while True:
                slowest = int(self._read(ps0, 2, self.ctx.num_workers).min())
                stale = step - slowest
                if self.kind == "async" or stale <= self.bound:
                    break
                misses += 1
                backoff(misses)
                _wait.overdue(started, misses, lambda: f"ssp: step {step} waits for the slowest worker, at step {slowest}")
            self.staleness.append(stale)
        self.wait_seconds += time.perf_counter() - t0
        return stale

    def end(self, step: int) -> None:
        """Worker, after every push of ``step`` completed. Local (one-sided)."""
        for hook in self.on_end:
            hook(step)
        win = self._win.win
        for rank in self.ctx.ps_world_ranks:
            win.Accumulate([self._one, MPI.INT64_T], rank, (0, 1, MPI.INT64_T), op=MPI.SUM)
        clock = np.array([step + 1], np.int64)
        ps0 = self.ctx.ps_world_ranks[0]
        win.Accumulate([clock, MPI.INT64_T], ps0, ((2 + self.ctx.worker_rank) * 8, 1, MPI.INT64_T),
                       op=MPI.REPLACE)
        win.Flush_all()
        if self.bells:
            for view in self._views.values():
                _wait.futex_wake(view.ctypes.data)

    def ring(self, rank: int) -> None:
        """Worker: wake PS ``rank`` if it sleeps on its doorbell (on this node): a request for it
        (a dynamic table's message) is on its way. Local."""
        view = self._views.get(rank) if self.bells else None
        if view is not None:
            _wait.futex_wake(view.ctypes.data)

    def fence(self, step: int) -> None:
        """Worker: wait until every PS applied all pushes of steps ``< step`` (all workers' ``end`` called). Local."""
        self._wait_applied(step)

    def ps_asked_to_stop(self) -> bool:
        """Worker: whether some PS rank was asked to stop (:meth:`note_stop`). Local (one-sided)."""
        return any(int(self._read(rank, 2 + self.ctx.num_workers)[0]) for rank in self.ctx.ps_world_ranks)

    def ps_serving(self) -> list[int]:
        """Worker: the world ranks of the PS ranks that entered ``serve()`` already. Local (one-sided)."""
        return [r for r in self.ctx.ps_world_ranks if int(self._read(r, 3 + self.ctx.num_workers)[0])]

    # ------------------------------------------------------------ PS side
    def note_serving(self) -> None:
        """PS, entering ``serve()``: from now on no table may be created. Local."""
        self._mine[3 + self.ctx.num_workers] = 1
        self._win.sync()

    def note_stop(self) -> None:
        """PS: record that this rank was asked to stop (a signal), for the workers to see. Local."""
        if not self._mine[2 + self.ctx.num_workers]:
            self._mine[2 + self.ctx.num_workers] = 1
            self._win.sync()

    def bell(self) -> int:
        """PS that sleeps on ``bell_word``: its value now, to read before looking for work and
        give to ``_wait.pause`` (0 on other ranks). Local."""
        return int(self._mine[0]) if self.bell_word is not None else 0

    def service(self, tables, final: bool = False) -> bool:
        """PS: apply what the mode allows now. ``final`` drains everything. Returns whether
        anything was applied or published (the serve loop polls faster after work). Local."""
        self._win.sync()
        done = int(self._mine[0])
        W = self.ctx.num_workers
        complete = done // W                      # steps every worker has finished
        if self.kind == "sync" and not final:
            if complete > self.step:              # at most one step ahead: workers wait for us
                for hook in self.before_apply:
                    hook()
                apply_staged(self.ctx, tables, self.step)
                self._publish(self.step + 1)
                return True
            if self.ctx.deterministic:            # take pieces as they come: a worker may have more
                for t in tables:
                    if t.mailbox is not None:
                        t.mailbox.collect()
            return False
        # async / ssp / final: apply whatever is staged. A staged push comes from a step at most
        # `bound` past the slowest worker's: stamp rows with that upper bound (row versions)
        rows = apply_staged(self.ctx, tables, max(complete, self.step) if final else complete,
                            stamp=complete + self.bound + 1)
        if complete > self.step or final:
            for hook in self.before_publish:
                hook(done)
            self._publish(max(complete, self.step))
            return True
        return rows > 0

    def _publish(self, applied: int) -> None:
        self.step = applied
        self._win.sync()                    # the applied rows before the count that announces them
        self._mine[1] = applied
        self._win.sync()
        if self.bells:
            _wait.futex_wake(self._mine.ctypes.data + 8, 1 << 30)

    def free(self) -> None:
        """Collective over the world; safe twice."""
        self._win.free()
