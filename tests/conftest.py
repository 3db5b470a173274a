import os
import sys
from pathlib import Path

import pytest

# this pytest process (and the pytest-mpi runs of tests/parallel) tests the communication thread
# in-process: nothing here calls hpcps.prepare_process, so MPI starts at mpi4py's default level,
# MPI_THREAD_MULTIPLE. Launched programs call prepare_process (SERIALIZED), and `hpcps train`
# reads job.mpi_threads; mpirun.mpi_env drops a developer's HPCPS_MPI_THREADS.

sys.path.insert(0, str(Path(__file__).resolve().parent))

# tests/parallel runs only under mpiexec (tests/test_parallel.py launches it);
# a plain serial run would skip every test in it.
collect_ignore = ["parallel", "programs"]

import mpirun  # noqa: E402

mpirun.SKIP_MALLOC_TUNE = True   # a test's few steps do not need glibc's tcache off (see mpi_env)

# `scripts/run test` runs the suite in two pytest processes (pytest-xdist, `-n 2 --dist loadfile`:
# each file whole on one of them, so its module fixtures, pretend hosts and Slurm start once).
# Each takes the next file in this order, the longest first (their seconds in the MPICH leg on the
# 2-core VM), so that the two end together; the Slurm files, whose jobs mostly wait, go first,
# beside the others' computing. (A third process for them alone ran the leg no faster: their jobs'
# ranks then took CPU from two computing files instead of one.)
LONGEST_FIRST = ["test_slurm.py", "test_checkpoint_mpi.py", "test_slurm_hosts.py", "test_scripts.py",
                 "test_train_mpi.py", "test_predict.py", "test_failures.py", "test_dynamic_mpi.py", "test_host_loss.py",
                 "test_tables_mpi.py", "test_hosts.py", "test_deterministic_mpi.py", "test_layers.py", "test_tune.py",
                 "test_evaluation.py", "test_abuse_runs.py", "test_monitor.py", "test_cli.py", "test_dynamic_train.py",
                 "test_abuse.py", "test_parallel.py"]


def pytest_sessionstart(session):
    # the ranks' fork server (tests/zygote.py) starts with this process's environment as it is
    # before any test changes it: a launch whose environment differs where the zygote's libraries
    # read it at start runs its ranks as fresh interpreters. Not in xdist's controller: it runs no test.
    if not (getattr(session.config.option, "numprocesses", None) and "PYTEST_XDIST_WORKER" not in os.environ):
        mpirun.zygote()


def pytest_configure(config):
    # xdist deals files in the order of LONGEST_FIRST, not by how many tests each has (its default)
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    # marked openmpi_only: the MPICH leg runs a larger test of the same (named in the docstring); ulfm:
    # live failover, which needs Open MPI's ULFM
    if os.environ.get("HPCPS_MPI", "mpich") != "openmpi":
        left = [item for item in items if item.get_closest_marker("openmpi_only") or item.get_closest_marker("ulfm")]
        if left:
            config.hook.pytest_deselected(items=left)
            gone = set(map(id, left))
            items[:] = [item for item in items if id(item) not in gone]
    # xdist's workers collect (its controller deals their order), and see numprocesses None there
    if "PYTEST_XDIST_WORKER" in os.environ:
        rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))     # stable: the rest in order


@pytest.fixture(autouse=True)
def _no_launch_left_behind():
    """A test that fails between ``launch_mpi`` and ``reap`` leaves no ranks running."""
    yield
    mpirun.kill_leftovers()
