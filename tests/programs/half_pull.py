"""16-bit pulls: the rows a worker gets are the float32 rows rounded to bfloat16 / float16,
before and after updates, over shared memory and RMA.

Usage: half_pull.py NUM_PS TRANSPORT[/RMA_READ] DTYPE OPTIMIZER (sgd | adam)
"""
import sys

import numpy as np
import torch

import hpcps

hpcps.prepare_process()       # before MPI starts (README, "Python API")

num_ps, dtype, opt_name = int(sys.argv[1]), sys.argv[3], sys.argv[4]
transport, _, rma_read = sys.argv[2].partition("/")       # e.g. rma/messages: remote pulls by messages
N, D = 500, 8
opt = hpcps.optim.SGD(lr=0.3) if opt_name == "sgd" else hpcps.optim.Adam(lr=0.05)
tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def rounded(x):
    return torch.from_numpy(x).to(tdt).to(torch.float32).numpy()


with hpcps.init(num_ps=num_ps, transport=transport, mode="sync", rma_read=rma_read or None) as ctx:
    t = hpcps.EmbeddingTable(ctx, "emb", N, D, optimizer=opt, pull_dtype=dtype)
    if ctx.is_ps:
        ctx.serve()
    else:
        ids = np.arange(N)
        rng = np.random.default_rng(ctx.worker_rank)
        for step in range(4):
            ctx.step_begin(step)
            full, got = t.pull(ids, full=True), t.pull(ids)
            assert got.dtype == np.float32 and got.shape == (N, D)
            assert np.array_equal(got, rounded(full)), f"step {step}: not the rounded rows"
            assert not np.array_equal(got, full)                  # it really is 16-bit
            some = rng.integers(0, N, 64)
            t.push(some, rng.standard_normal((64, D)).astype(np.float32))
            ctx.step_end(step)
        ctx.fence(4)
        full, got = t.pull(ids, full=True), t.pull(ids)
        assert np.array_equal(got, rounded(full))
        moved = t.stats.bytes_per_ps
        print(f"OK worker {ctx.worker_rank} bytes {sum(moved)}", flush=True)
