"""A prefetch issued before another worker's pushes of the same step is refreshed exactly.

Usage: prefetch_refresh.py NUM_PS TRANSPORT[/RMA_READ] OPTIMIZER (sgd | adagrad), 2 workers, sync mode.
Step 1: worker 0 prefetches rows 0..59 for step 2 (comm thread on), then worker 1 pushes
rows 40..79. At step 2 worker 0's forward must see worker 1's update: rows 40..59 are
pulled again (stamped 2 = step 1 + 1), rows 0..39 are used as prefetched. The same
prefetch without a refresh is stale, so the check can fail.
"""
import sys

import numpy as np
import torch

import hpcps

hpcps.prepare_process()       # before MPI starts (README, "Python API")
from hpcps.nn import ShardedEmbeddingBag  # noqa: E402
from hpcps.sparse.pipeline import CommThread, RowCache  # noqa: E402


num_ps, opt_name = int(sys.argv[1]), sys.argv[3]
transport, _, rma_read = sys.argv[2].partition("/")       # e.g. rma/messages: remote pulls by messages
N, D = 200, 4
opt = hpcps.optim.SGD(lr=0.5) if opt_name == "sgd" else hpcps.optim.Adagrad(lr=0.5)

with hpcps.init(num_ps=num_ps, transport=transport, mode="sync", rma_read=rma_read or None) as ctx:
    t = hpcps.EmbeddingTable(ctx, "emb", N, D, optimizer=opt, track_versions=True)
    if ctx.is_ps:
        ctx.serve()
    else:
        w = ctx.worker_rank
        comm = CommThread()
        emb = ShardedEmbeddingBag(t, comm=comm)
        stale_emb = ShardedEmbeddingBag(t)
        want = torch.arange(60).view(6, 10)
        for step in range(3):
            ctx.step_begin(step)
            if step == 0:
                assert (t.versions(np.arange(N)) == 0).all()
            if step == 1 and w == 0:
                emb.prefetch(want, 2, refresh_above=1)
                stale_emb.prefetch(want, 2)
                emb.comm.drain()                          # the rows are read before worker 1 pushes
            ctx.worker_comm.Barrier()
            if step == 1 and w == 1:
                t.push(np.arange(40, 80), np.ones((40, D), np.float32))
            if step == 2:
                v = t.versions(np.arange(N))
                assert (v[40:80] == 2).all() and (v[:40] == 0).all() and (v[80:] == 0).all(), v
                if w == 0:
                    fresh = t.pull(np.arange(60))
                    got = emb(want).detach().numpy()
                    old = stale_emb(want).detach().numpy()
                    assert emb.refreshed_rows == 20 and emb.prefetched_rows == 60, (emb.refreshed_rows,)
                    assert np.array_equal(got, fresh.reshape(6, 10, D).sum(1))
                    assert not np.allclose(old, got), "the unrefreshed prefetch should be stale"
                    # a cache serves training forwards and is bypassed by evaluation (no_grad)
                    ce = ShardedEmbeddingBag(t, cache=RowCache(256, D, staleness=5))
                    ce.step = 2
                    ce(want)
                    with torch.no_grad():
                        ce(want)
                    assert (ce.cache.lookups, ce.cache.hits) == (60, 0)
                    np.testing.assert_array_equal(ce(want).detach().numpy(), got)
                    assert (ce.cache.lookups, ce.cache.hits) == (120, 60)
            ctx.step_end(step)
        comm.close()
        print(f"OK worker {w}", flush=True)
