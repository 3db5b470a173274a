"""hpcps/core/wait.py: the sleep policy's timer slack and its cap on one sleep."""

import subprocess
import sys

import pytest

SLACK = "/proc/self/timerslack_ns"


def _slack_after(policy: str) -> int:
    code = ("import hpcps.core.wait as w; w.set_policy(%r); print(open(%r).read().strip())" % (policy, SLACK))
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timer slack is a Linux setting")
def test_sleep_policy_tightens_the_timer_slack_and_yield_leaves_it():
    from hpcps.core import wait as _wait
    assert _slack_after("sleep") == _wait._SLACK_NS == 1000
    with open(SLACK) as f:
        inherited = int(f.read())
    assert _slack_after("yield") == inherited               # untouched: what the child inherited


def test_backoff_sleeps_at_most_the_cap(monkeypatch):
    from hpcps.core import wait as _wait
    slept = []
    monkeypatch.setattr(_wait.time, "sleep", slept.append)
    monkeypatch.setattr(_wait, "_sleep", True)
    for misses in range(1, 40):
        _wait.backoff(misses)
    assert len(slept) == 39 - _wait._SPINS
    assert slept[0] == _wait._FIRST_S and max(slept) == _wait._MAX_S == 60e-6
    assert slept == sorted(slept)
    monkeypatch.undo()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="futexes are Linux's")
def test_futex_doorbell_across_processes():
    """The doorbell of hpcps/core/wait.py on shared memory: a wait returns at once when the word no
    longer holds the value read, times out when nobody rings, and another process's ring (after
    changing the word) wakes it long before its timeout."""
    import mmap
    import os
    import time

    import numpy as np

    from hpcps.core import wait as _wait
    assert _wait.HAVE_FUTEX
    mem = mmap.mmap(-1, 4096)                        # MAP_SHARED: the child sees the same page
    word = np.frombuffer(mem, np.int32)
    addr = word.ctypes.data
    word[0] = 7
    t0 = time.perf_counter()
    _wait.futex_wait(addr, 6, 5.0)                   # the word moved on: no sleep
    assert time.perf_counter() - t0 < 1.0
    t0 = time.perf_counter()
    _wait.futex_wait(addr, 7, 0.05)                  # nobody rings: the timeout ends it
    assert time.perf_counter() - t0 >= 0.04
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                     # the waiter: sleeps while the word is 7
        try:
            t = time.perf_counter()
            while word[0] == 7:
                _wait.futex_wait(addr, 7, 10.0)
            os.write(w, f"{time.perf_counter() - t:.3f}".encode())
        finally:
            os._exit(0)
    time.sleep(0.3)                                  # let the child fall asleep
    word[0] = 8
    _wait.futex_wake(addr)
    waited = float(os.read(r, 64))
    os.waitpid(pid, 0)
    assert 0.2 <= waited < 5.0                       # woken by the ring, not by its 10 s timeout
