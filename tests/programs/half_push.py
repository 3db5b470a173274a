"""16-bit pushes: the PS applies each worker's per-row gradient sums rounded to bfloat16 /
float16, over shared memory and RMA, and over RMA they travel in 16 bits (through the push
mailbox, or as float32 when a push does not fit the worker's slot).

Usage: half_push.py NUM_PS TRANSPORT DTYPE [SLOT_ROWS]   (2 workers)
"""
import sys

import numpy as np
import torch

import hpcps

hpcps.prepare_process()       # before MPI starts (README, "Python API")
import hpcps.sparse.mailbox as mailbox_module  # noqa: E402


num_ps, transport, dtype = int(sys.argv[1]), sys.argv[2], sys.argv[3]
N, D, LR, B = 300, 8, 0.5, 96
if len(sys.argv) > 4:                       # each worker's slot holds this many rows
    mailbox_module.MAILBOX_BYTES = int(sys.argv[4]) * (8 + 2 * D) * 2
    mailbox_module.MIN_SLOT_ROWS = 1
tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def batch(worker, step):
    """Worker ``worker``'s push at ``step`` (repeated ids included): every worker can make anyone's."""
    rng = np.random.default_rng(1000 * step + worker)
    return rng.integers(0, N, B), rng.standard_normal((B, D)).astype(np.float32)


def row_sums(ids, grads):
    """Each distinct row's gradients summed in float32, the way a worker sums them."""
    uniq, inverse = np.unique(ids, return_inverse=True)
    sums = torch.zeros((uniq.size, D)).index_add_(0, torch.from_numpy(inverse), torch.from_numpy(grads))
    return uniq, sums


with hpcps.init(num_ps=num_ps, transport=transport, mode="sync") as ctx:
    t = hpcps.EmbeddingTable(ctx, "emb", N, D, optimizer=hpcps.optim.SGD(lr=LR), push_dtype=dtype)
    if ctx.is_ps:
        ctx.serve()
    else:
        assert ctx.num_workers == 2
        remote = transport == "rma"
        all_ids = np.arange(N)
        want = unrounded = None
        for step in range(5):
            ctx.step_begin(step)
            rows = t.pull(all_ids)      # sync: every push of the steps before is applied, none of this one's
            if want is not None:
                assert np.array_equal(rows, want), f"step {step}: not the rounded gradients' update"
                assert np.abs(rows - unrounded).max() > 1e-5, "the gradients were not rounded"
            if step == 4:
                break
            ids, grads = batch(ctx.worker_rank, step)
            moved = sum(t.stats.bytes_per_ps)
            t.push(ids, grads)
            pushed = sum(t.stats.bytes_per_ps) - moved
            distinct = np.unique(ids).size
            if transport == "rma" and t.stats.inbox_full == 0:
                assert pushed == distinct * D * 2, f"{pushed} bytes pushed for {distinct} rows: not 16-bit"
            ctx.step_end(step)
            staged, exact = torch.zeros((N, D)), torch.zeros((N, D))
            for w in range(2):          # 0 + a + b == 0 + b + a: the order of arrival is moot
                u, sums = row_sums(*batch(w, step))
                staged[u] += sums.to(tdt).to(torch.float32)
                exact[u] += sums
            want = torch.from_numpy(rows).add(staged, alpha=-LR).numpy()
            unrounded = torch.from_numpy(rows).add(exact, alpha=-LR).numpy()
        ctx.fence(4)
        print(f"OK worker {ctx.worker_rank} inbox_full {t.stats.inbox_full}", flush=True)
