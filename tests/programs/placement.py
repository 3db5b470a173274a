"""Tables under another row placement pull and push the right rows, on both push paths.

Usage: placement.py NUM_PS TRANSPORT SHARDING   (SHARDING: range | modulo | custom)
custom: a placement object of this program (PS p holds the ids with id % P == P - 1 - p).
"""
import sys
from dataclasses import dataclass

import numpy as np

import hpcps

hpcps.prepare_process()       # before MPI starts (README, "Python API")


@dataclass(frozen=True)
class Mirrored:
    """Modulo with the PS order reversed: the same promises (order kept per owner, identity at P = 1)."""

    num_rows: int
    num_ps: int
    name = "mirrored"

    def place(self, ids):
        local, r = np.divmod(np.asarray(ids, np.int64), self.num_ps)
        return self.num_ps - 1 - r, local

    def owner(self, ids):
        return self.place(ids)[0]

    def local_row(self, ids):
        return self.place(ids)[1]

    def shard_rows(self, ps):
        return len(range(self.num_ps - 1 - ps, self.num_rows, self.num_ps))

    def global_ids(self, ps, start=0, stop=None):
        return np.arange(self.num_ps - 1 - ps, self.num_rows, self.num_ps, dtype=np.int64)[start:stop]


num_ps, transport, kind = int(sys.argv[1]), sys.argv[2], sys.argv[3]
N, D, SEED, ROUNDS = 257, 4, 5, 6
with hpcps.init(num_ps=num_ps, transport=transport, mode="sync") as ctx:
    sharding = Mirrored(N, num_ps) if kind == "custom" else kind
    plain = hpcps.EmbeddingTable(ctx, "plain", N, D, optimizer=hpcps.optim.SGD(lr=1.0), seed=SEED, sharding=sharding)
    # warmup_steps=1 keeps the rate at 1.0 but makes SGD stateful: staged, applied by the PS
    staged = hpcps.EmbeddingTable(ctx, "staged", N, D, seed=SEED, sharding=sharding,
                                  optimizer=hpcps.optim.SGD(lr=1.0, schedule=hpcps.optim.LRSchedule(warmup_steps=1)))
    assert plain.sharding.name == ("mirrored" if kind == "custom" else kind)
    if ctx.is_ps:
        p = ctx.ps_rank
        gids = plain.sharding.global_ids(p)
        assert (plain.sharding.owner(gids) == p).all() and gids.size == plain.shard().shape[0]
        np.testing.assert_array_equal(plain.shard(), hpcps.initial_rows(SEED, "plain", gids, D))
        ctx.world.Barrier()                                  # checked before any worker pushes
        ctx.serve()
        # snapshot / restore round trip on the trained rows (what checkpoints use)
        snap = staged.snapshot()
        assert (snap["ids"] == gids).all() and snap["applies"] == ROUNDS
        staged.shard()[:] = 0
        assert staged.restore([(snap["ids"], snap["weights"], snap["state"])], snap["applies"]) == gids.size
        np.testing.assert_array_equal(staged.shard(), snap["weights"])
        for bad, what in (([(snap["ids"], snap["weights"], {"nope": snap["weights"]})], "unknown optimizer state"),
                          ([(np.array([int(plain.sharding.global_ids((p + 1) % num_ps)[0])]), snap["weights"][:1], {})],
                           "another PS")):
            if what == "another PS" and num_ps == 1:
                continue
            try:
                staged.restore(bad, 0)
                raise AssertionError(f"restore must refuse {what}")
            except ValueError as e:
                assert what in str(e), e
        print(f"OK PS {p} snapshot", flush=True)
    else:
        W, w = ctx.num_workers, ctx.worker_rank
        everything = np.arange(N)
        for t in (plain, staged):
            np.testing.assert_array_equal(t.pull(everything), hpcps.initial_rows(SEED, t.name, everything, D))
        ctx.world.Barrier()                                  # every worker read the initial rows, every PS its shard
        ids = np.concatenate([np.arange(w, N, W), [0, 0, N - 1]])      # own rows, and shared hot ones
        grads = np.ones((ids.size, D), np.float32)
        for step in range(ROUNDS):
            ctx.step_begin(step)
            hpcps.push_many([(plain, ids, grads), (staged, ids, grads)])
            ctx.step_end(step)
        ctx.fence(ROUNDS)
        ctx.worker_comm.Barrier()
        want = hpcps.initial_rows(SEED, "plain", everything, D) - ROUNDS
        want[[0, N - 1]] -= 2 * ROUNDS * W                   # each worker pushed 0 twice and N - 1 once more
        want[N - 1] += ROUNDS * W
        np.testing.assert_allclose(plain.pull(everything), want, rtol=0, atol=1e-5)
        got = staged.pull(everything)
        np.testing.assert_allclose(got - hpcps.initial_rows(SEED, "staged", everything, D),
                                   want - hpcps.initial_rows(SEED, "plain", everything, D), rtol=0, atol=1e-5)
        print(f"OK worker {w} {kind}", flush=True)
