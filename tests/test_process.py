"""hpcps.prepare_process: what a program sets before MPI starts (each case in a fresh process)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(code: str, env=None):
    import os
    full = {k: v for k, v in os.environ.items() if k not in ("MPI4PY_RC_THREAD_LEVEL", "HPCPS_MPI_THREADS")}
    full.update(env or {})
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=full)


def test_asks_for_the_level_and_mpi_gets_it():
    r = _run("import hpcps; print(hpcps.prepare_process()); from mpi4py import MPI; "
             "print(MPI.Query_thread() == MPI.THREAD_SERIALIZED)")
    assert r.returncode == 0 and r.stdout.split() == ["serialized", "True"], r.stderr


def test_without_it_mpi4py_keeps_its_default():
    r = _run("import hpcps; from mpi4py import MPI; print(MPI.Query_thread() == MPI.THREAD_MULTIPLE)")
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr


def test_the_environment_wins_and_late_calls_change_nothing():
    r = _run("import hpcps; print(hpcps.prepare_process('funneled'))", {"MPI4PY_RC_THREAD_LEVEL": "single"})
    assert r.stdout.strip() == "single", r.stderr
    r = _run("from mpi4py import MPI; import hpcps; print(hpcps.prepare_process())")
    assert r.stdout.strip() == "already started", r.stderr


@pytest.mark.parametrize("bad", ["all", "MULTIPLE", ""])
def test_unknown_level_is_a_clear_error(bad):
    from hpcps.core.process import prepare_process
    with pytest.raises(ValueError, match="job.mpi_threads"):
        prepare_process(bad)


def test_the_tcache_tunable_is_added_beside_a_users_own():
    from hpcps.core.malloc import TUNABLE, tunables_with_tcache_off
    assert tunables_with_tcache_off({"GLIBC_TUNABLES": "glibc.malloc.mxfast=64"}) == f"glibc.malloc.mxfast=64:{TUNABLE}"
    assert tunables_with_tcache_off({}) == TUNABLE
