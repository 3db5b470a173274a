"""A pull and a push complete while the PS computes in pure Python (not inside MPI).

Usage: busy_ps.py TRANSPORT
"""
import sys
import time

import numpy as np

import hpcps

hpcps.prepare_process()       # before MPI starts (README, "Python API")

BUSY = 2.0
with hpcps.init(num_ps=1, transport=sys.argv[1]) as ctx:
    t = hpcps.EmbeddingTable(ctx, "rows", 10_000, 16, optimizer=hpcps.optim.SGD(lr=1.0))
    ctx.world.Barrier()
    if ctx.is_ps:
        start = time.time()
        x = 0
        while time.time() - start < BUSY:                    # pure Python, no MPI call
            x += 1
        busy_end = time.time()
        finished = ctx.world.recv(source=ctx.worker_world_ranks[0])
        ctx.serve()
        assert finished < busy_end - 0.5, (finished, busy_end)
        print(f"OK PS was busy until {busy_end:.3f}, worker done at {finished:.3f}", flush=True)
    else:
        time.sleep(0.3)                                      # the PS is in its loop now
        ids = np.arange(0, 10_000, 7)
        t0 = time.time()
        before = t.pull(ids)
        t.push(ids, -np.ones((ids.size, 16), np.float32))
        after = t.pull(ids)
        done = time.time()
        np.testing.assert_allclose(after, before + 1, rtol=0, atol=1e-6)
        assert done - t0 < 0.5 * BUSY, done - t0
        if ctx.worker_rank == 0:
            print(f"OK pull+push+pull took {done - t0:.4f}s while the PS was busy", flush=True)
            ctx.world.send(done, dest=ctx.ps_world_ranks[0])
