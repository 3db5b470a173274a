"""Counted MPI traffic, for ``scripts/bench_scale.py``: what grows with the ranks is counted,
since on a machine of 2 cores time says little at 32 ranks.

With ``HPCPS_COUNT_MPI=1`` in its environment each rank counts every one-sided operation it
issues on an hpcps window (``Get``, ``Put``, ``Accumulate``, ... and their request forms), by
target (a world rank), with the bytes of its origin buffer; every round trip (a ``Flush`` on a
target, a ``Flush_all``, or an ``Rget`` whose completion is waited on); and the dense
all-reduces (calls and bytes, shared-memory or MPI). A worker marks its first and last training
step, so the counts of the steps alone can be told from start-up and the final evaluation.
Reads from a PS's shared memory on the same node are not messages: they are counted as rows by
the tables' own statistics. Not counted: the two-sided messages of dynamic tables, checkpoint
partner copies, and MPI's own collectives other than the dense all-reduce.

Off (the default) it costs nothing: :func:`wrap` hands back the window itself.
"""

import os
import time
from collections import defaultdict

from mpi4py import MPI

__all__ = ["ENABLED", "wrap", "allreduce", "mark", "note", "report"]

ENABLED = os.environ.get("HPCPS_COUNT_MPI", "") == "1"

# the position of the target rank in each operation's arguments
_TARGET = {"Get": 1, "Rget": 1, "Put": 1, "Rput": 1, "Accumulate": 1, "Raccumulate": 1,
           "Get_accumulate": 2, "Rget_accumulate": 2, "Fetch_and_op": 2, "Compare_and_swap": 3}
_WAITED = ("Rget", "Rget_accumulate")      # hpcps waits on each of these: a round trip


class _Tally:
    def __init__(self):
        self.ops = defaultdict(int)         # target world rank -> operations
        self.bytes = defaultdict(int)       # target world rank -> origin bytes
        self.trips = defaultdict(int)       # target world rank (-1: Flush_all) -> round trips
        self.allreduce_calls = 0
        self.allreduce_bytes = 0

    def snapshot(self) -> dict:
        return {"ops": dict(self.ops), "bytes": dict(self.bytes), "round_trips": dict(self.trips),
                "allreduce_calls": self.allreduce_calls, "allreduce_bytes": self.allreduce_bytes}


_tally = _Tally()
_marks = {}
_notes = {}


def _nbytes(buf) -> int:
    if isinstance(buf, (list, tuple)):
        buf = buf[0]
    try:
        return memoryview(buf).nbytes
    except TypeError:
        return 0


class _CountingWin:
    """An ``MPI.Win`` that counts what goes through it; everything else is the window's own."""

    def __init__(self, win, to_world: list):
        self._win, self._to_world = win, to_world

    def __getattr__(self, name):
        attr = getattr(self._win, name)
        at = _TARGET.get(name)
        if at is not None:
            def counted(*args, **kw):
                target = self._to_world[args[at]]
                _tally.ops[target] += 1
                _tally.bytes[target] += _nbytes(args[0])
                if name in _WAITED:
                    _tally.trips[target] += 1
                return attr(*args, **kw)
            return counted
        if name == "Flush":
            def flush(rank):
                _tally.trips[self._to_world[rank]] += 1
                return attr(rank)
            return flush
        if name == "Flush_all":
            def flush_all():
                _tally.trips[-1] += 1
                return attr()
            return flush_all
        return attr


def wrap(win: MPI.Win, comm: MPI.Comm):
    """``win`` (made over ``comm``) as it is, or, counting, one that counts. Local."""
    if not ENABLED:
        return win
    ranks = comm.Get_group().Translate_ranks(list(range(comm.Get_size())), MPI.COMM_WORLD.Get_group())
    return _CountingWin(win, ranks)


def allreduce(nbytes: int) -> None:
    """One dense all-reduce of ``nbytes`` (every backend calls this). Local."""
    if ENABLED:
        _tally.allreduce_calls += 1
        _tally.allreduce_bytes += int(nbytes)


def _age() -> float:
    """Seconds since this process started (``/proc/self/stat``: an exec, such as ``hpcps train``'s
    restart with glibc's tcache off, keeps the start)."""
    start = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    return float(open("/proc/uptime").read().split()[0]) - start


def mark(name: str) -> None:
    """Remember the counts and this process's age now, as ``name`` (a worker: ``first_step``
    before its first step, ``last_step`` after its last). Local."""
    if ENABLED:
        _marks[name] = (_tally.snapshot(), _age(), time.perf_counter())


def note(name: str, value) -> None:
    """Add ``name``: ``value`` to this rank's report (a PS: the rows its applies updated). Local."""
    if ENABLED:
        _notes[name] = value


def _minus(a: dict, b: dict) -> dict:
    out = {}
    for k, v in a.items():
        if isinstance(v, dict):
            out[k] = {t: n - b[k].get(t, 0) for t, n in v.items() if n - b[k].get(t, 0)}
        else:
            out[k] = v - b[k]
    return out


def report() -> dict | None:
    """This rank's counts (None when not counting): ``total`` (the whole run so far), and where it
    marked both, ``steps`` (between ``first_step`` and ``last_step``) and ``startup_s`` (its age
    at its first step). Local."""
    if not ENABLED:
        return None
    out = {"total": _tally.snapshot(), **_notes}
    if "first_step" in _marks and "last_step" in _marks:
        out["steps"] = _minus(_marks["last_step"][0], _marks["first_step"][0])
        out["startup_s"] = _marks["first_step"][1]
        out["steps_s"] = _marks["last_step"][2] - _marks["first_step"][2]
    return out
