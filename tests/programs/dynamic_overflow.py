"""A sync step whose workers' new ids together need more rows than the PS's shard has, while each
worker's alone fit: no worker can see it, the PS refuses the step at its apply (before changing
anything) and the job stops with that error instead of hanging. Usage: dynamic_overflow.py"""
import numpy as np

import hpcps

hpcps.prepare_process()

ctx = hpcps.init(num_ps=1, mode="sync")
t = hpcps.DynamicEmbeddingTable(ctx, "d", 4, 6)
if ctx.is_ps:
    ctx.serve()
else:
    ids = np.arange(4, dtype=np.int64) + 4 * ctx.worker_rank        # 4 each, 8 in all: 6 rows
    ctx.step_begin(0)
    t.pull(ids)
    t.push(ids, np.ones((4, 4), np.float32))
    ctx.step_end(0)
    ctx.fence(1)
    print("the step was applied", flush=True)
ctx.finalize()
