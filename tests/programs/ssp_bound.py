"""One deliberately slow worker; the others may run at most S steps ahead (ssp:S).

Usage: ssp_bound.py MODE STEPS   -> worker 0 prints {"max_staleness": [...per worker], "fast_waited": bool}
"""
import json
import sys
import time

import numpy as np

import hpcps

hpcps.prepare_process()       # before MPI starts (README, "Python API")

mode, steps = sys.argv[1], int(sys.argv[2])
with hpcps.init(num_ps=1, mode=mode) as ctx:
    t = hpcps.EmbeddingTable(ctx, "x", 64, 4, optimizer=hpcps.optim.Adagrad(lr=0.1))
    if ctx.is_ps:
        ctx.serve()
    else:
        ids = np.arange(ctx.worker_rank, 64, 3)
        g = np.ones((ids.size, 4), np.float32)
        t0 = time.perf_counter()
        for step in range(steps):
            ctx.step_begin(step)
            t.pull(ids)
            t.push(ids, g)
            if ctx.worker_rank == 1:
                time.sleep(0.02)                     # the straggler
            ctx.step_end(step)
        stale = ctx.control.staleness
        report = ctx.worker_comm.gather({"max": max(stale), "wait": ctx.control.wait_seconds}, root=0)
        if ctx.worker_rank == 0:
            print(json.dumps({"max_staleness": [r["max"] for r in report],
                              "wait_seconds": [r["wait"] for r in report]}), flush=True)
