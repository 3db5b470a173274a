"""A dynamic table through checkpoints: train steps [START, STOP), a checkpoint at each step of
CKPTS (every second one a delta), resuming from DIR's checkpoint of step START when START > 0; the PS
ranks save their shards (after the restore, and at the end) as DIR/TAG-{restored,end}-psP.npz.
Integer gradients, lr 0.5 and INIT zeros keep every sum exact (async mode gives the sync result).
Usage: dynamic_ckpt.py NUM_PS MODE OPT CAPACITY ADMIT INIT DIR START STOP CKPTS TAG"""
import sys

import numpy as np

import hpcps

hpcps.prepare_process()
import torch  # noqa: E402

from hpcps.checkpoint import Checkpointer, restore_tables, store  # noqa: E402

num_ps, mode, opt_name, cap, admit = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
init, root, start, stop, tag = sys.argv[6], sys.argv[7], int(sys.argv[8]), int(sys.argv[9]), sys.argv[11]
ckpts = [int(s) for s in sys.argv[10].split(",") if s]
D = 4
EDGE = np.array([0, -1, 1, -(2 ** 63), 2 ** 63 - 1, 2 ** 62, 2 ** 62 + 1, -(2 ** 62)], np.int64)
UNIVERSE = np.concatenate([EDGE, np.random.default_rng(0).integers(-2 ** 63, 2 ** 63 - 1, 400, dtype=np.int64)])


def save(what: str) -> None:
    snap = t.shard.snapshot()
    np.savez(f"{root}/{tag}-{what}-ps{ctx.ps_rank}.npz", ids=snap["ids"], weights=snap["weights"],
             last=snap["last"], uses=snap["uses"], **{f"state_{k}": v for k, v in snap["state"].items()},
             counters=np.array([snap["counters"][k] for k in ("inserts", "evictions", "rejected")]),
             applies=snap["applies"])


ctx = hpcps.init(num_ps=num_ps, mode=mode)
t = hpcps.DynamicEmbeddingTable(ctx, "emb", D, cap, optimizer=hpcps.optim.make_optimizer(opt_name, lr=0.5),
                                seed=3, admit_min_count=admit, init=init)
ck = Checkpointer(ctx, [t], root, keep=10, compression="", meta={}, full_every=2)
ctx.add_resource(ck)
if start:
    restore_tables(store.step_dir(root, start), ctx, [t])
    ctx.control.set_start(start)
    if ctx.is_ps:
        save("restored")
model = torch.nn.Linear(1, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
if ctx.is_ps:
    ctx.serve()
    save("end")
else:
    for step in range(start, stop):
        if step in ckpts:
            ck.checkpoint(step, model, opt)
            ck.wait_commit()
        ctx.step_begin(step)
        rng = np.random.default_rng(1000 * step + ctx.worker_rank)
        ids = rng.choice(UNIVERSE, 48)
        t.pull(ids)
        t.push(ids, rng.integers(-3, 4, (ids.size, D)).astype(np.float32))
        ctx.step_end(step)
    if stop in ckpts:
        ctx.fence(stop)
        ck.checkpoint(stop, model, opt)
        ck.wait_commit()
    print(f"OK worker {ctx.worker_rank} {t.stats()}", flush=True)
ctx.finalize()
