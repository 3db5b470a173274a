"""Dynamic embedding tables under a real mpiexec (oversubscribed), each launch under a timeout."""

import re

import pytest

from mpirun import run_mpi


@pytest.mark.parametrize("n,num_ps,opt", [(3, 1, "adagrad"), (4, 2, "adam"), (5, 2, "sgd")])
def test_sync_mode_equals_a_one_process_reference_for_any_int64_id(n, num_ps, opt):
    r = run_mpi(n, ["dynamic_sync.py", num_ps, opt, 12], timeout=180)
    got = re.findall(r"OK worker \d+ size (\d+) checksum ([0-9.]+)", r.stdout)
    assert len(got) == n - num_ps and len(set(got)) == 1, r.stdout
    assert int(got[0][0]) > 300                           # most of the 508 ids were seen and stored


def test_admission_eviction_and_stats_over_mpi_in_async_mode():
    r = run_mpi(3, ["dynamic_misc.py"], timeout=120)
    assert "OK dynamic misc" in r.stdout
