import sys

from .cli import main
from .runtime.stopping import EXIT_CHECKPOINTED, EXIT_STOPPED

EXIT_CONFIG = 2       # an error alike on every rank (cli._error): one line, no MPI_Abort per rank

code = main()
if code in (EXIT_CHECKPOINTED, EXIT_STOPPED, EXIT_CONFIG) and "mpi4py.MPI" in sys.modules:
    # Every rank agreed to stop after a checkpoint: finalize MPI first, then exit with the code.
    # Under `python -m mpi4py`, sys.exit(85) with MPI still initialized becomes MPI_Abort(85),
    # which srun reports as killed tasks (exit 137). And a normal exit, not os._exit: after
    # os._exit(85), MPICH's mpiexec returned 9 instead of 85 in 38% of launches on a loaded
    # machine (it killed ranks still exiting); Finalize + sys.exit gave 85 in 80 of 80.
    from mpi4py import MPI
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()
sys.exit(code)
