"""hpcps/_wait.py: the sleep policy's timer slack and its cap on one sleep."""

import subprocess
import sys

import pytest

SLACK = "/proc/self/timerslack_ns"


def _slack_after(policy: str) -> int:
    code = ("import hpcps._wait as w; w.set_policy(%r); print(open(%r).read().strip())" % (policy, SLACK))
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timer slack is a Linux setting")
def test_sleep_policy_tightens_the_timer_slack_and_yield_leaves_it():
    from hpcps import _wait
    assert _slack_after("sleep") == _wait._SLACK_NS == 1000
    with open(SLACK) as f:
        inherited = int(f.read())
    assert _slack_after("yield") == inherited               # untouched: what the child inherited


def test_backoff_sleeps_at_most_the_cap(monkeypatch):
    from hpcps import _wait
    slept = []
    monkeypatch.setattr(_wait.time, "sleep", slept.append)
    monkeypatch.setattr(_wait, "_sleep", True)
    for misses in range(1, 40):
        _wait.backoff(misses)
    assert len(slept) == 39 - _wait._SPINS
    assert slept[0] == _wait._FIRST_S and max(slept) == _wait._MAX_S == 60e-6
    assert slept == sorted(slept)
    monkeypatch.undo()
