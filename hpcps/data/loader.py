"""Draw a worker's training batches ahead, in a child process, into shared memory.

A worker of the main job spent ~15% of a step drawing its batch (the synthetic
generator's random draws), time in which its PS rank mostly waited.
:class:`BatchAhead` forks one child per worker that draws batches ``start + 1,
start + 2, ...`` with ``data.train_batch(step)`` (the same function, so the same
batches bit for bit) up to ``depth`` steps ahead into fixed slots of an anonymous
shared mapping; the worker copies a finished slot out (~50 us for the main job's
1024 samples) instead of drawing it. The child sleeps on a futex while every slot
is full.

Where the child runs decides the gain: on its worker's CPU it only takes time from
the worker. :func:`placement` pins the worker to one CPU and its child to CPUs no
worker of the node is pinned to (Linux ``sched_setaffinity``); ``hpcps train``
turns the loader on by itself (``pipeline.loader = "auto"``) only where the node
has a CPU for each worker and one for each loader. And when the child draws matters:
with ``defer`` the worker hands a slot back only when it calls :meth:`release`
(``hpcps train``: after ``step_begin``, when in sync mode the PS has applied the
step), so the child draws while the worker computes and not while the PS applies.

Only the training batches come from the child; evaluation batches are drawn in
the worker. Batches must keep one shape (every source in ``hpcps.data`` does: a
worker's slice of the global batch); if one does not, the child stops and the
worker draws the rest itself. Local throughout (no MPI in the child).
"""

import ctypes
import mmap
import os
import platform
import signal
import sys
import time
import traceback

import numpy as np

from ..core import wait as _wait
from .base import Batch

__all__ = ["BatchAhead", "placement", "supported", "fits"]

_ERR_BYTES = 4096
_PR_SET_PDEATHSIG = 1
# header words (int64): [0] batches published (the next step to publish is start + [0]),
# [1] batches taken by the worker, [2] state: 0 running, 1 failed (message follows), 2 stopped
# (shape changed), [3] stop request from the worker
_PUBLISHED, _TAKEN, _STATE, _STOP = 0, 1, 2, 3
_HEADER = 8 * 8


def supported() -> bool:
    """Whether :class:`BatchAhead` runs here: Linux on x86-64, whose store order publishes a slot's
    data before the counter that announces it (plain stores to shared memory). Local."""
    return sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")


def fits(workers: int, cpus: int) -> bool:
    """Whether ``pipeline.loader = auto`` runs a loader for each of ``workers`` on a node of ``cpus``:
    each worker and each loader gets a CPU of its own (the PS ranks mostly wait). Local, pure."""
    return 2 * workers <= cpus


def placement(index: int, workers: int) -> tuple[int, set] | None:
    """Where the worker ``index`` of the ``workers`` on this node and its loader run: ``(the CPU
    to pin the worker to, the CPUs for its loader)``, or None where this process may use only one
    CPU or the CPUs are not known. Worker ``k`` takes the ``k``-th CPU this process may use; the
    loader takes the CPUs no worker does, or failing that every other one. Local."""
    if not supported() or not hasattr(os, "sched_getaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        return None
    mine = allowed[index % len(allowed)]
    free = set(allowed) - set(allowed[:workers])
    return mine, free or set(allowed) - {mine}


def _fields(batch: Batch):
    """The arrays of a batch, in slot order, with their names."""
    out = [("dense", batch.dense), ("labels", batch.labels)]
    out += [(f"sparse{t}", s) for t, s in enumerate(batch.sparse)]
    if batch.truth is not None:
        out.append(("truth", batch.truth))
    return out


class BatchAhead:
    """``train_batch(step)`` of ``data`` for ``step`` in ``[start, stop)``, drawn ahead by a forked
    child process. Local: one per worker, made before the worker starts threads; :meth:`close` (or
    a ``with`` block) stops the child.

    ``train_batch`` must be asked for the steps in order (what ``hpcps train`` does); any other
    step is drawn in this process. ``cpus``: :func:`placement`'s answer, or None to leave both
    processes where the system puts them. ``defer``: slots come back to the child only at
    :meth:`release`. ``annex``: a function of a batch giving ``(name, array)`` pairs of one shape for
    batches of one shape, which the child also computes for each batch (``hpcps train``: the ids'
    :meth:`hpcps.nn.IdPlan.pack`); :meth:`annex_of` gives them. ``wait_s``: seconds this process
    waited for the child.
    """

    def __init__(self, data, start: int, stop: int, depth: int = 2, cpus=None, defer: bool = False,
                 annex=None):
        if depth < 1:
            raise ValueError(f"BatchAhead: depth must be >= 1, got {depth}")
        if not supported():
            raise RuntimeError("BatchAhead needs Linux on x86-64 (see hpcps.data.loader.supported)")
        self.data, self.start, self.stop, self.depth, self.defer = data, start, stop, depth, defer
        self.annex = annex
        self._annexed = (None, None)                        # (step, its annex arrays) of the last batch taken
        self.next = start
        self.wait_s = 0.0
        self._pid = None
        self._taken = 0
        self._affinity = None
        self._first = data.train_batch(start) if start < stop else None   # it gives the slots' shapes
        if self._first is None or stop - start < 2:
            return
        self._layout = []
        off = _HEADER + _ERR_BYTES
        for name, a in self._fields(self._first):
            a = np.asarray(a)
            self._layout.append((name, a.dtype, a.shape, off))
            off += -(-a.nbytes // 64) * 64
        self._slot_bytes = off - _HEADER - _ERR_BYTES
        self._annexes = len(self._layout) - len(_fields(self._first))
        self._has_truth = self._first.truth is not None
        self._map = mmap.mmap(-1, _HEADER + _ERR_BYTES + depth * self._slot_bytes)
        self._head = np.frombuffer(self._map, np.int64, 8, 0)
        self._head[:] = 0
        pid = os.fork()
        if pid == 0:                                         # the child: draw, never return
            code = 1
            try:
                self._child(cpus)
                code = 0
            finally:
                os._exit(code)
        self._pid = pid
        if cpus is not None:
            try:
                self._affinity = os.sched_getaffinity(0)
                os.sched_setaffinity(0, {cpus[0]})
            except OSError:
                self._affinity = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- the child --------------------------------------------------------------------------------
    def _child(self, cpus) -> None:
        try:
            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)   # die with the worker
        except (OSError, AttributeError):
            pass
        if os.getppid() == 1:
            return
        # a stop signal (Slurm's SIGUSR1 before the time limit, SIGTERM at it) reaches every process
        # of the job step: the worker checkpoints and closes this child, which must not die first
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        if cpus is not None:
            try:
                os.sched_setaffinity(0, cpus[1])
            except OSError:
                pass
        head = self._head
        taken_word = head.ctypes.data + 8 * _TAKEN
        try:
            for step in range(self.start + 1, self.stop):
                j = step - self.start - 1                 # batches published before this one
                while j - int(head[_TAKEN]) >= self.depth:    # every slot full: sleep until one is taken
                    seen = int(head[_TAKEN])
                    if head[_STOP]:
                        return
                    if j - seen >= self.depth:
                        self._sleep(taken_word, seen)
                if head[_STOP]:
                    return
                batch = self.data.train_batch(step)
                if not self._write(j % self.depth, batch):
                    head[_STATE] = 2
                    self._ring()
                    return
                head[_PUBLISHED] = j + 1
                self._ring()
        except Exception:
            msg = traceback.format_exc().encode()[-(_ERR_BYTES - 1):]
            self._map[_HEADER:_HEADER + len(msg)] = msg
            head[_STATE] = 1
            self._ring()
            raise

    @staticmethod
    def _sleep(word: int, seen: int) -> None:
        if _wait.HAVE_FUTEX:
            _wait.futex_wait(word, (seen + (1 << 31)) % (1 << 32) - (1 << 31), 0.05)
        else:
            time.sleep(50e-6)

    def _ring(self) -> None:
        if _wait.HAVE_FUTEX:                                 # also a full barrier: data before counters
            _wait.futex_wake(self._head.ctypes.data + 8 * _PUBLISHED, 1)
            _wait.futex_wake(self._head.ctypes.data + 8 * _TAKEN, 1)

    def _slot(self, k: int):
        base = k * self._slot_bytes
        return {name: np.ndarray(shape, dtype, self._map, base + off)
                for name, dtype, shape, off in self._layout}

    def _fields(self, batch: Batch):
        return _fields(batch) + (list(self.annex(batch)) if self.annex is not None else [])

    def _write(self, k: int, batch: Batch) -> bool:
        arrays = self._fields(batch)
        if (batch.truth is not None) != self._has_truth or len(arrays) != len(self._layout):
            return False
        slot = self._slot(k)
        for (name, a), (_, dtype, shape, _) in zip(arrays, self._layout):
            a = np.asarray(a)
            if a.shape != shape or a.dtype != dtype:
                return False
            slot[name][...] = a
        return True

    # -- the worker -------------------------------------------------------------------------------
    def train_batch(self, step: int) -> Batch:
        """Batch ``step`` (``data.train_batch(step)``). Local."""
        if step != self.next or self._first is None:
            return self.data.train_batch(step)
        self.next += 1
        if step == self.start:
            return self._first
        if self._pid is None:
            return self.data.train_batch(step)
        j = step - self.start - 1                           # the child's j-th batch
        head = self._head
        if head[_PUBLISHED] <= j:
            t0 = time.monotonic()
            misses = 0
            word = head.ctypes.data + 8 * _PUBLISHED
            while head[_PUBLISHED] <= j and not head[_STATE]:
                misses += 1
                if misses % 4096 == 0 and os.waitpid(self._pid, os.WNOHANG)[0]:
                    self._pid = None
                    self._restore()
                    raise RuntimeError(f"data loader process of this worker died before batch {step}")
                _wait.pause(misses, word if _wait.bells() else None, int(head[_PUBLISHED]))
                _wait.overdue(t0, misses, lambda: f"this worker's data loader process has not drawn batch {step}")
            self.wait_s += time.monotonic() - t0
        if head[_PUBLISHED] <= j:
            if head[_STATE] == 1:
                msg = bytes(self._map[_HEADER:_HEADER + _ERR_BYTES]).rstrip(b"\0").decode(errors="replace")
                self.close()
                raise RuntimeError(f"data loader process failed drawing batch {step}:\n{msg}")
            self.close()                                     # a batch changed shape: draw here from now on
            return self.data.train_batch(step)
        slot = self._slot(j % self.depth)
        sparse = [slot[f"sparse{t}"].copy() for t in range(len(self._first.sparse))]
        batch = Batch(slot["dense"].copy(), sparse, slot["labels"].copy(),
                      slot["truth"].copy() if self._has_truth else None)
        if self.annex is not None:
            extra = self._layout[len(self._layout) - self._annexes:]
            self._annexed = (step, {name: slot[name].copy() for name, *_ in extra})
        self._taken = j + 1
        if not self.defer:
            self.release()
        return batch

    def annex_of(self, step: int) -> dict | None:
        """The annex arrays (by name) the child made with batch ``step``, if that is the last batch
        :meth:`train_batch` took from the child, else None. Local."""
        return self._annexed[1] if self._annexed[0] == step else None

    def release(self) -> None:
        """Let the child reuse the slots of the batches taken so far (``train_batch`` does this itself
        unless ``defer``). Local."""
        if self._pid is not None and self._head[_TAKEN] != self._taken:
            self._head[_TAKEN] = self._taken
            if _wait.HAVE_FUTEX:
                _wait.futex_wake(self._head.ctypes.data + 8 * _TAKEN, 1)

    def _restore(self) -> None:
        if self._affinity is not None:
            try:
                os.sched_setaffinity(0, self._affinity)
            except OSError:
                pass
            self._affinity = None

    def close(self) -> None:
        """Stop and reap the child (idempotent). Local."""
        if self._pid is None:
            return
        self._head[_STOP] = 1
        self._ring()
        pid, self._pid = self._pid, None
        self._restore()
        for _ in range(200):                                 # the child ends within one batch
            if os.waitpid(pid, os.WNOHANG)[0]:
                return
            time.sleep(0.005)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)

    def __del__(self):
        try:
            self.close()
        except Exception:                                    # noqa: BLE001 - interpreter shutdown
            pass
