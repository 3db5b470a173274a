"""Sync mode, a dynamic table: the worker pulls at step 0, ends the step without pushing and
finalizes (what a program that catches an over-capacity error and gives up does). The PS must end
with an error naming the missing push, not wait forever. Usage: dynamic_no_push.py (2 ranks)"""
import numpy as np

import hpcps

hpcps.prepare_process()
with hpcps.init(num_ps=1, mode="sync", progress_timeout=30) as ctx:
    t = hpcps.DynamicEmbeddingTable(ctx, "emb", 8, 100, optimizer=hpcps.optim.SGD(lr=0.1), seed=1)
    if ctx.is_ps:
        ctx.serve()
    else:
        ctx.step_begin(0)
        t.pull(np.array([5, 6, 7]))
        ctx.step_end(0)                   # no push of step 0
