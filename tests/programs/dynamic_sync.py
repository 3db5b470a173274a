"""A dynamic table in sync mode against a one-process reference, bit for bit; stats; bad input.
Usage: dynamic_sync.py NUM_PS OPTIMIZER STEPS"""
import sys

import numpy as np

import hpcps

hpcps.prepare_process()
from hpcps.core.dynshard import DynamicShard, sum_rows  # noqa: E402
from hpcps.core.errors import RoleError  # noqa: E402

num_ps, opt_name, steps = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
D, SEED, CAP = 8, 11, 4000
EDGE = np.array([0, -1, 1, -(2 ** 63), 2 ** 63 - 1, 2 ** 62, 2 ** 62 + 1, -(2 ** 62)], np.int64)
UNIVERSE = np.concatenate([EDGE, np.random.default_rng(0).integers(-2 ** 63, 2 ** 63 - 1, 500, dtype=np.int64)])


def make_opt():
    return hpcps.optim.make_optimizer(opt_name, lr=0.05)


def batch(step: int, w: int):
    rng = np.random.default_rng(1000 * step + w)
    ids = rng.choice(UNIVERSE, 64)
    return ids, rng.standard_normal((ids.size, D)).astype(np.float32)


ctx = hpcps.init(num_ps=num_ps, mode="sync")
try:
    hpcps.DynamicEmbeddingTable(ctx, "bad", D, 0)
    raise AssertionError("capacity 0 must be refused")
except ValueError as e:
    assert "capacity" in str(e)
t = hpcps.DynamicEmbeddingTable(ctx, "emb", D, CAP, optimizer=make_opt(), seed=SEED)
if ctx.is_ps:
    try:
        t.pull([1])
        raise AssertionError("pull on a PS must raise")
    except RoleError:
        pass
    ctx.serve()
else:
    W = ctx.num_workers
    ref = DynamicShard("emb", D, CAP, make_opt(), seed=SEED)
    for bad, what in (([1.5, 2.0], "integers"), (np.array([2 ** 64 - 1], np.uint64), "fit int64")):
        try:
            t.pull(bad)
            raise AssertionError("bad ids must be refused")
        except ValueError as e:
            assert what in str(e), e
    for step in range(steps):
        ctx.step_begin(step)
        ids, g = batch(step, ctx.worker_rank)
        rows = t.pull(ids)
        np.testing.assert_array_equal(rows, ref.pull(ref.resolve(ids, step), ids))
        if step == 0:
            nan = g.copy()
            nan[3, 1] = np.nan
            try:
                t.push(ids, nan)
                raise AssertionError("NaN gradients must be refused")
            except ValueError as e:
                assert "NaN" in str(e)
        t.push(ids, g)
        # the reference: each worker's repeats summed, then the workers' sums in worker order
        # (as each PS does with its part)
        sums = [sum_rows(*batch(step, w)) for w in range(W)]     # an id's sum: its rows, in order
        u, s = sum_rows(np.concatenate([x[0] for x in sums]), np.concatenate([x[1] for x in sums]))
        ref.push(ref.resolve(u, step), s, step)
        ctx.step_end(step)
    ctx.fence(steps)
    final = t.pull(UNIVERSE)
    np.testing.assert_array_equal(final, ref.pull(ref.index.find(UNIVERSE), UNIVERSE))
    st = t.stats()
    # every id some worker pushed is stored (a pull stores nothing: the final one added no id)
    pushed = np.unique(np.concatenate([batch(s, w)[0] for s in range(steps) for w in range(W)]))
    assert st["capacity"] == CAP and st["size"] == pushed.size == st["inserts"] == ref.stats()["size"], st
    assert st["evictions"] == 0 and st["rejected"] == 0, st
    # on one host every push went through the worker's slab (only a header travelled); across
    # hosts only those to a PS on this worker's host did
    near = sum(v is not None for v in t.memory.views)
    assert t.memory.slab_pushes == near * steps, (t.memory.slab_pushes, near, steps)
    print(f"OK worker {ctx.worker_rank} size {st['size']} checksum {float(np.abs(final).sum()):.6f}", flush=True)
ctx.finalize()
