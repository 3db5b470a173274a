"""Run the pytest-mpi bodies of tests/parallel under mpiexec at several sizes (through mpirun.py,
like every multi-rank test): pytest's exit status on every rank decides."""

import re

import pytest

from mpirun import ROOT, run_mpi


@pytest.mark.parametrize("n", [2, 3])
def test_parallel_suite(n):
    # no addopts (setup.cfg's --durations): n ranks' reports interleave on one stdout
    r = run_mpi(n, ["-m", "pytest", "--with-mpi", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                    str(ROOT / "tests" / "parallel")], mpi4py_run=False, timeout=240, check=False)
    assert r.returncode == 0, r.stdout + r.stderr             # any rank's failure, error or no test
    # every rank ran its tests (not anchored to a line start: the ranks' lines interleave)
    assert len(re.findall(r"\d+ passed", r.stdout)) == n, r.stdout
