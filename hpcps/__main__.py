import sys

from .cli import main
from .stopping import EXIT_CHECKPOINTED

code = main()
if code == EXIT_CHECKPOINTED and "mpi4py.MPI" in sys.modules:
    # Every rank agreed to stop after a checkpoint: finalize MPI and leave with the code. Under
    # `python -m mpi4py`, sys.exit(85) would become MPI_Abort(85), which srun reports as killed
    # tasks (exit 137) instead of 85.
    import logging
    import os

    from mpi4py import MPI
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()
    os._exit(code)
sys.exit(code)
