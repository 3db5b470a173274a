"""Impossible layouts raise ValueError on every rank, before any window. Usage: init_errors.py NUM_PS"""
import sys

import hpcps

hpcps.prepare_process()       # before MPI starts (README, "Python API")
from mpi4py import MPI  # noqa: E402

arg = sys.argv[1]
num_ps = None if arg == "env" else (int(arg) if arg.lstrip("-").isdigit() else arg)
if arg == "mismatch":
    num_ps = 1 + MPI.COMM_WORLD.Get_rank() % 2
try:
    hpcps.init(num_ps=num_ps)
except ValueError as e:
    print(f"rank {MPI.COMM_WORLD.Get_rank()}: ValueError: {e}", flush=True)
else:
    print(f"rank {MPI.COMM_WORLD.Get_rank()}: no error", flush=True)
