import os
import sys
from pathlib import Path

# this pytest process tests the communication thread in-process, so its MPI (started when a test
# module first imports hpcps) needs MPI_THREAD_MULTIPLE; mpirun.mpi_env drops the variable, so
# launched jobs get hpcps's default (SERIALIZED) unless a test asks
os.environ["HPCPS_MPI_THREADS"] = "multiple"

sys.path.insert(0, str(Path(__file__).resolve().parent))

# tests/parallel runs only under mpiexec (tests/test_parallel.py launches it);
# a plain serial run would skip every test in it.
collect_ignore = ["parallel", "programs"]
