"""The hpcps sparse-table API in one page.

    scripts/run mpiexec -n 3 .venv/bin/python -m mpi4py examples/sparse_basics.py

Any number of ranks from 2: one parameter server, the others workers (three ranks:
two workers). Each worker pulls a batch of rows, pretends to compute gradients,
pushes them back (to two tables in one ``push_many``), and then reads the rows
its colleagues updated.
"""

import numpy as np

import hpcps

hpcps.prepare_process()       # before MPI starts (README, "Python API")

with hpcps.init(num_ps=1) as ctx:                       # collective over MPI.COMM_WORLD
    items = hpcps.EmbeddingTable(ctx, "items", num_rows=100_000, dim=16,
                                 optimizer=hpcps.optim.SGD(lr=0.1), seed=0)   # collective
    users = hpcps.EmbeddingTable(ctx, "users", num_rows=1_000, dim=8,
                                 optimizer=hpcps.optim.SGD(lr=0.1), seed=0)
    if ctx.is_ps:
        ctx.serve()                                     # until every worker has finalized
    else:
        ids = (np.array([7, 42, 42, 99_998]) + ctx.worker_rank) % items.num_rows   # duplicates are fine
        rows = items.pull(ids)                          # (4, 16) float32
        grads = np.ones_like(rows)                      # your model's gradients here
        items.push(ids, grads)                          # SGD: rows -= 0.1 * summed grads
        me = [ctx.worker_rank]                          # several tables at once: one lock per PS
        hpcps.push_many([(items, [500], np.ones((1, 16), np.float32)),
                         (users, me, np.ones((1, 8), np.float32))])
        ctx.worker_comm.Barrier()                       # every worker's pushes are done
        handle = items.pull_async([7, 8])               # overlap with other work ...
        after = handle.wait()
        start = hpcps.initial_rows(0, "items", [7, 8], 16)
        print(f"worker {ctx.worker_rank}: row 7 moved by {float(after[0, 0] - start[0, 0]):+.3f}, "
              f"row 8 by {float(after[1, 0] - start[1, 0]):+.3f}", flush=True)
        moved = users.pull([0, 1]) - hpcps.initial_rows(0, "users", [0, 1], 8)
        print(f"worker {ctx.worker_rank}: users 0 and 1 moved by {float(moved[0, 0]):+.3f}, "
              f"{float(moved[1, 0]):+.3f}; items 500 by "
              f"{float(items.pull([500])[0, 0] - hpcps.initial_rows(0, 'items', [500], 16)[0, 0]):+.3f}", flush=True)
        try:
            items.pull([100_000])                       # out of range: raises before any communication
        except ValueError as e:
            print(f"worker {ctx.worker_rank}: rejected as expected: {e}", flush=True)
# leaving the with-block finalizes: PS ranks return from serve(), tables are freed
