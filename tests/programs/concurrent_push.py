"""Workers push integer gradients to overlapping hot rows at once; no update may be lost.

Usage: concurrent_push.py NUM_PS TRANSPORT ROUNDS [stateful [LIST_ROWS [locked]]]
With "stateful", gradients are staged and applied by the PS while workers keep
pushing (async mode): nothing may be lost between a push and the PS's drain.
LIST_ROWS sets the staged-row list's length (hpcps.sparse.staging.STAGED_LIST_ROWS):
a short one overflows, and the PS then finds the staged rows by scanning. "locked": no push
mailboxes, so pushes to a PS on another node take the lock and the staged-row list too.
Every other round pushes distinct sorted ids, which a PS on the same node takes
through its hand-off slab (one push at a time; the others are staged meanwhile). A first
step in which worker 0 alone pushes (then a fence) gives a PS on the node a push with
nothing else staged, which it applies straight from the slab, however the later rounds
interleave.
"""
import sys

import numpy as np

import hpcps

hpcps.prepare_process()       # before MPI starts (README, "Python API")
import hpcps.sparse.mailbox  # noqa: E402
import hpcps.sparse.staging  # noqa: E402

from mpi4py import MPI  # noqa: E402

num_ps, transport, rounds = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
stateful = len(sys.argv) > 4 and sys.argv[4] == "stateful"
if len(sys.argv) > 5:
    hpcps.sparse.staging.STAGED_LIST_ROWS = int(sys.argv[5])
if len(sys.argv) > 6 and sys.argv[6] == "locked":
    hpcps.sparse.mailbox.MAILBOX_BYTES = 0
N, D = 300, 4
# warmup_steps=1 keeps the rate at exactly 1.0 but makes SGD stateful (applied by the PS)
opt = hpcps.optim.SGD(lr=1.0, schedule=hpcps.optim.LRSchedule(warmup_steps=1 if stateful else 0))
assert opt.stateful == stateful

with hpcps.init(num_ps=num_ps, transport=transport, mode="async") as ctx:
    t = hpcps.EmbeddingTable(ctx, "hot", N, D, optimizer=opt, init_scale=0.0)
    if ctx.is_ps:
        ctx.serve()
        st = t.stats
        print(f"OK PS applies listed {st.applies_listed} scanned {st.applies_scanned} slab {st.applies_slab} "
              f"mailbox {st.applies_mailbox}", flush=True)
    else:
        w = ctx.worker_rank
        rng = np.random.default_rng(100 + w)
        mine = np.zeros((N, D), dtype=np.int64)
        ctx.worker_comm.Barrier()
        ctx.step_begin(0)
        if w == 0:                                                       # a push alone: see above
            ids = np.unique(rng.integers(0, N, 40))
            vals = rng.integers(1, 5, size=(ids.size, D))
            t.push(ids, -vals.astype(np.float32))
            np.add.at(mine, ids, vals)
        ctx.step_end(0)
        ctx.fence(1)
        for r in range(1, rounds + 1):
            ctx.step_begin(r)
            ids = np.concatenate([np.arange(10), np.arange(10),          # hot rows, twice per batch
                                  rng.integers(0, N, 40)])
            if r % 2:
                ids = np.unique(ids)                                     # distinct and sorted
            vals = rng.integers(1, 5, size=(ids.size, D))
            t.push(ids, -vals.astype(np.float32))                       # SGD lr=1: w += vals
            np.add.at(mine, ids, vals)
            if r % 7 == 0:
                t.pull_async(ids[:20]).wait()                           # reads race with writes
            ctx.step_end(r)
        ctx.fence(rounds + 1)                                            # every staged push applied
        ctx.worker_comm.Barrier()
        total = np.empty_like(mine)
        ctx.worker_comm.Allreduce(mine, total, op=MPI.SUM)
        got = t.pull(np.arange(N))
        assert total.max() < 2 ** 24                                     # exact in float32
        bad = np.flatnonzero((got != total).any(axis=1))
        assert bad.size == 0, f"worker {w}: {bad.size} rows differ, e.g. row {bad[:1]}: {got[bad[:1]]} != {total[bad[:1]]}"
        print(f"OK worker {w} hot-row sum {int(total[0, 0])}", flush=True)
