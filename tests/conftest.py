import sys
from pathlib import Path

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
