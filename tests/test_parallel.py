"""Run tests/parallel under mpiexec with pytest-mpi at several sizes."""

import re

import pytest

from mpirun import ROOT, run_mpi


@pytest.mark.parametrize("n", [2, 3])
def test_parallel_suite(n):
    r = run_mpi(n, ["-m", "pytest", "--with-mpi", "-q", "-p", "no:cacheprovider",
                    str(ROOT / "tests" / "parallel")], mpi4py_run=False, timeout=180)
    passed = [int(m) for m in re.findall(r"(\d+) passed", r.stdout)]
    assert passed and min(passed) >= (17 if n == 2 else 18), r.stdout
    assert "failed" not in r.stdout and "error" not in r.stdout.lower(), r.stdout
