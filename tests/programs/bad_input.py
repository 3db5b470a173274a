"""Bad input raises ValueError on the worker, the table is unchanged, the job ends cleanly."""
import numpy as np

import hpcps

hpcps.prepare_process()       # before MPI starts (README, "Python API")

N, D = 50, 4
with hpcps.init(num_ps=1) as ctx:
    t = hpcps.EmbeddingTable(ctx, "clicks", N, D, optimizer=hpcps.optim.SGD(lr=0.5))
    if ctx.is_ps:
        ctx.serve()
    else:
        ctx.worker_comm.Barrier()
        before = t.pull(np.arange(N))
        ok = np.ones((3, D), np.float32)
        cases = [
            (lambda: t.pull([1.5]), "table 'clicks': ids must be integers"),
            (lambda: t.pull([-1]), "table 'clicks': id -1 out of range [0, 50)"),
            (lambda: t.pull([0, 50]), "table 'clicks': id 50 out of range [0, 50)"),
            (lambda: t.push([1, 2, 3], ok[:2]), "table 'clicks': grads must have shape (3, 4)"),
            (lambda: t.push([1, 2, 3], ok.astype(np.float64)), "table 'clicks': grads must be float32"),
            (lambda: t.push([1, 2, 3], np.where(np.eye(3, D) > 0, np.nan, 1).astype(np.float32)),
             "table 'clicks': grads hold NaN or Inf in 3 row(s)"),
            (lambda: t.push([1, 2, 60], ok), "table 'clicks': id 60 out of range"),
            (lambda: t.push([1, 2, 3], np.full((3, D), np.inf, np.float32)), "NaN or Inf"),
        ]
        for call, msg in cases:
            try:
                call()
            except ValueError as e:
                assert msg in str(e), (msg, str(e))
            else:
                raise AssertionError(f"no ValueError for: {msg}")
        ctx.worker_comm.Barrier()
        np.testing.assert_array_equal(t.pull(np.arange(N)), before)   # nothing changed
        try:
            hpcps.EmbeddingTable(ctx, "clicks", N, D)
        except ValueError as e:
            assert "already exists" in str(e)
        else:
            raise AssertionError("duplicate table name accepted")
        print(f"OK worker {ctx.worker_rank}", flush=True)
