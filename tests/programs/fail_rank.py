"""Worker 1 fails after the tables exist while the others wait in MPI; the job must end non-zero."""
import time

import hpcps

hpcps.prepare_process()       # before MPI starts (README, "Python API")

with hpcps.init(num_ps=1) as ctx:
    t = hpcps.EmbeddingTable(ctx, "t", 100, 4)
    if ctx.is_ps:
        ctx.serve()
    else:
        t.pull([1, 2])
        if ctx.worker_rank == 1:
            time.sleep(0.5)
            raise RuntimeError("worker 1 fails on purpose")
        ctx.worker_comm.Barrier()             # never completes: worker 1 is gone
