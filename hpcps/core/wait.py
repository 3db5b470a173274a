"""How hpcps waits in its polling loops (fences, shard locks, RMA requests, the PS's serve
loop, the dense all-reduce).

Each loop calls :func:`backoff` after a poll that found nothing. Two policies:

- ``yield``: ``sched_yield()`` after every miss. The lowest latency; right when
  every rank has a core of its own.
- ``sleep``: a few yields, then sleeps that double from 20 us up to 60 us. Right
  on an oversubscribed node (more ranks than CPUs): a waiting rank gives its core
  to the ranks that compute, instead of taking half of it to spin. A shared-memory
  or RMA operation aimed at a sleeping rank still completes (windows are
  ``Win.Allocate`` + ``Lock_all(MODE_NOCHECK)``, see ``hpcps/core/window.py``).
  The process's timer slack is set to 1 us (Linux ``PR_SET_TIMERSLACK``; the
  default 50 us stretched every short sleep), so a rank notices a finished wait
  within ~60 us. Against a 200 us cap with the default slack, 1 PS + 3 workers on
  2 CPUs ran 85k -> 99k samples/s (median of 5 alternating runs each): in ``sync``
  mode every step waits on the slowest rank, and each late wake-up idles a core.

``wait`` of :func:`hpcps.init` (config key ``job.wait``, environment ``HPCPS_WAIT``) = ``auto``
(default) | ``yield`` | ``sleep``; ``auto`` is ``sleep`` where the ranks on this node outnumber the
CPUs they may run on, else ``yield``. :func:`hpcps.init` decides it once per process.
"""

import ctypes
import os
import platform
import sys
import time

from .errors import StalledError
from .settings import WAIT_POLICIES

__all__ = ["WAIT_POLICIES", "backoff", "set_policy", "wait_request", "bells", "pause", "futex_wait", "futex_wake",
           "HAVE_FUTEX", "BELL_TIMEOUT_S", "set_progress_timeout", "overdue", "quiet_barrier", "PROGRESS_TIMEOUT_S",
           "set_fault_check", "check_faults"]

PROGRESS_TIMEOUT_S = 600.0  # default of job.progress_timeout
_timeout = PROGRESS_TIMEOUT_S
_CLOCK_EVERY = 64           # misses between two looks at the clock (a wait's polls stay cheap)

_SPINS = 2                  # misses answered with a yield before the first sleep
_FIRST_S, _MAX_S = 20e-6, 60e-6
QUIET_MAX_S = 2e-3            # quiet_barrier's longest nap
QUIET_SHARE = 0.1             # and its naps' share of the time it waited so far
_SLACK_NS = 1000            # timer slack while the policy is sleep

_PR_SET_TIMERSLACK = 29
_sleep = False
_fault_check = None         # raises where a rank of the job was lost (hpcps.core.faults)


def set_policy(name: str) -> None:
    """``"yield"`` or ``"sleep"`` for this process. Local."""
    global _sleep
    if name not in ("yield", "sleep"):
        raise ValueError(f"wait policy must be 'yield' or 'sleep', got {name!r}")
    _sleep = name == "sleep"
    if _sleep:
        _tight_timer_slack()


def _tight_timer_slack() -> bool:
    """Linux: this thread's (and its future threads') timer slack to ``_SLACK_NS``. True if set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, _SLACK_NS, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def backoff(misses: int) -> None:
    """Pause after the ``misses``-th poll in a row that found nothing (counting from 1). Local."""
    if not _sleep or misses <= _SPINS:
        os.sched_yield()
        return
    time.sleep(min(_FIRST_S * (1 << min(misses - _SPINS - 1, 8)), _MAX_S))


def set_progress_timeout(seconds: float) -> None:
    """Seconds a wait may see no progress before it raises :class:`hpcps.core.errors.StalledError`
    (0: wait forever). Local; :func:`hpcps.init` sets it (``job.progress_timeout``)."""
    global _timeout
    if not seconds >= 0:
        raise ValueError(f"progress timeout must be >= 0 seconds, got {seconds!r}")
    _timeout = float(seconds)


def overdue(started: float, misses: int, what) -> None:
    """In a wait that began at ``time.monotonic()`` ``started``, after its ``misses``-th fruitless
    poll: raise :class:`hpcps.core.errors.StalledError` saying ``what()`` (or ``what``) once the progress
    timeout has passed. Looks at the clock (and for a lost rank, :func:`set_fault_check`) every
    ``_CLOCK_EVERY`` misses only. Local."""
    if misses % _CLOCK_EVERY:
        return
    check_faults()
    if not _timeout or time.monotonic() - started <= _timeout:
        return
    text = what() if callable(what) else what
    raise StalledError(f"no progress for {_timeout:g} s (job.progress_timeout): {text}")


def set_fault_check(check) -> None:
    """Have every wait call ``check()`` (None: nothing) when it looks at the clock: it raises where
    a rank of the job was lost (``hpcps.core.faults.FaultWatch``), so a rank that spins on shared
    memory leaves its wait too. Local."""
    global _fault_check
    _fault_check = check


def check_faults() -> None:
    """Call the check :func:`set_fault_check` set, if any. Local."""
    if _fault_check is not None:
        _fault_check()


def wait_request(req, what="an MPI request to complete") -> None:
    """Complete an MPI request by polling ``Test`` under the policy, within the progress timeout. Local."""
    misses, started = 0, time.monotonic()
    while not req.Test():
        misses += 1
        backoff(misses)
        overdue(started, misses, what)


def quiet_barrier(comm) -> None:
    """A barrier whose waiters sleep (:func:`backoff`) instead of spinning in MPI, with no progress
    timeout: for waits on one rank's long local work (verifying or loading a checkpoint), whose
    CPUs the spinning ranks would take. Its naps grow to ``QUIET_MAX_S``, not to the 60 us of a
    step's waits: three ranks waking every 60 us took a third of the 2 CPUs a PS loading a GB
    shard needed (its load 0.6-1.0 s against 0.4 s). Each nap is a tenth of the time waited so far,
    so a short wait ends soon after its last rank arrives (naps that doubled added 5-8 ms to a
    10 ms load of the main job's shard). Collective over ``comm``."""
    req, start = comm.Ibarrier(), time.monotonic()
    while not req.Test():
        time.sleep(min(max(QUIET_SHARE * (time.monotonic() - start), _FIRST_S), QUIET_MAX_S))
        check_faults()


def bells() -> bool:
    """Whether waits sleep on doorbells (:func:`pause` with a word): the ``sleep`` policy, on a
    system with futexes. Local."""
    return HAVE_FUTEX and _sleep


def pause(misses: int, word: int | None = None, seen: int = 0) -> None:
    """:func:`backoff` after the ``misses``-th fruitless poll; or, given a doorbell ``word`` (the
    address of a word in shared memory that another rank changes, then rings) and ``seen`` (its
    value in that poll), once the first yields are spent sleep until it is rung or holds something
    else, at most ``BELL_TIMEOUT_S``. ``seen`` must be what the poll read, not a later read: a
    ring between the two would be lost. Local."""
    if word is not None and misses > _SPINS:
        futex_wait(word, (seen + (1 << 31)) % (1 << 32) - (1 << 31), BELL_TIMEOUT_S)   # its low 32 bits
    else:
        backoff(misses)


# Linux futexes on words of MPI shared memory (a MAP_SHARED mapping: the kernel matches the waiter
# and the waker by the page, whatever address each process maps it at). A rank waits on a word with
# FUTEX_WAIT (it sleeps only while the word still holds the value it last read, so a wake that came
# first is not lost) and is woken by another rank's FUTEX_WAKE after that rank changed the word.
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "ppc64le": 221, "riscv64": 98}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
BELL_TIMEOUT_S = 1e-3       # longest sleep on a doorbell (remote progress, ends of jobs, checkpoint polls)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _libc():
    try:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.syscall.restype = ctypes.c_long
        return lib
    except (OSError, AttributeError):
        return None


_LIBC = _libc() if sys.platform.startswith("linux") and _SYS_FUTEX and sys.byteorder == "little" else None
HAVE_FUTEX = _LIBC is not None


def futex_wait(addr: int, expected: int, timeout_s: float) -> None:
    """Sleep while the int32 at ``addr`` (shared memory) equals ``expected``, until a
    :func:`futex_wake` on it or ``timeout_s``. Returns at once if the word differs. Local."""
    ts = _Timespec(int(timeout_s), int((timeout_s % 1) * 1e9))
    _LIBC.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT, ctypes.c_int(expected), ctypes.byref(ts),
                  None, 0)


def futex_wake(addr: int, n: int = 1) -> None:
    """Wake up to ``n`` ranks waiting in :func:`futex_wait` on the word at ``addr``. Local."""
    _LIBC.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, ctypes.c_int(n), None, None, 0)
