"""Pulls equal the initial rows; API contract checks. Usage: tables_basic.py NUM_PS TRANSPORT[/RMA_READ] OUT.npy"""
import sys

import numpy as np

import hpcps

hpcps.prepare_process()       # before MPI starts (README, "Python API")
from hpcps.core.errors import FreedError, RoleError  # noqa: E402

from mpi4py import MPI  # noqa: E402

num_ps, out = int(sys.argv[1]), sys.argv[3]
transport, _, rma_read = sys.argv[2].partition("/")       # e.g. rma/messages: remote pulls by messages
N, D, SEED = 1003, 8, 7

ctx = hpcps.init(num_ps=num_ps, transport=transport, rma_read=rma_read or None)
assert ctx.is_ps != ctx.is_worker
assert ctx.num_ps == num_ps and ctx.num_workers == ctx.world.Get_size() - num_ps
if ctx.is_ps:
    assert ctx.worker_comm == MPI.COMM_NULL and ctx.ps_comm.Get_size() == num_ps
    assert 0 <= ctx.ps_rank < num_ps and ctx.worker_rank == -1
else:
    assert ctx.ps_comm == MPI.COMM_NULL and ctx.worker_comm.Get_size() == ctx.num_workers
    assert 0 <= ctx.worker_rank < ctx.num_workers and ctx.ps_rank == -1

if rma_read != "messages":      # a table cannot pull by messages where the PS ranks do not serve them
    try:
        hpcps.EmbeddingTable(ctx, "x", 10, 3, rma_read="messages")
        raise AssertionError("rma_read='messages' on a context without it must raise")
    except ValueError as e:
        assert "needs a context made with rma_read = 'messages'" in str(e), e
t = hpcps.EmbeddingTable(ctx, "items", N, D, optimizer=hpcps.optim.SGD(lr=0.1), seed=SEED)
assert t.remote == ("messages" if rma_read == "messages" else "RMA")
other = hpcps.EmbeddingTable(ctx, "users", 10, 3, seed=SEED)
tmp = hpcps.EmbeddingTable(ctx, "tmp", 10, 3)
tmp.free()                                                   # collective: every rank, same point
tmp.free()                                                   # safe twice
assert tmp.freed

# Memory: a PS holds exactly its shard, a worker exposes nothing.
if ctx.is_ps:
    assert t.rows.nbytes == t.sharding.shard_rows(ctx.ps_rank) * D * 4
    np.testing.assert_array_equal(t.shard(), hpcps.initial_rows(SEED, "items", t.sharding.global_ids(ctx.ps_rank), D))
    try:
        t.pull([0])
        raise AssertionError("pull on a PS rank must raise")
    except RoleError as e:
        assert "worker ranks" in str(e)
    ctx.serve()
else:
    assert t.rows.nbytes == 0
    try:
        t.shard()
        raise AssertionError("shard() on a worker must raise")
    except RoleError:
        pass
    expected_paths = list(range(num_ps)) if transport == "auto" else []
    assert t.shared_memory_ps == expected_paths, (t.shared_memory_ps, expected_paths)
    rng = np.random.default_rng(ctx.worker_rank)
    ids = rng.integers(0, N, 500)
    ids[:50] = ids[50:100]                                  # duplicates
    rows = t.pull(ids)
    assert rows.dtype == np.float32 and rows.shape == (500, D)
    np.testing.assert_array_equal(rows, hpcps.initial_rows(SEED, "items", ids, D))
    h = t.pull_async(np.arange(N))
    everything = h.wait()
    np.testing.assert_array_equal(h.wait(), everything)      # wait() is idempotent
    np.testing.assert_array_equal(everything, hpcps.initial_rows(SEED, "items", np.arange(N), D))
    np.testing.assert_array_equal(other.pull([9, 0]), hpcps.initial_rows(SEED, "users", [9, 0], 3))
    assert t.pull([]).shape == (0, D)
    if ctx.worker_rank == 0:
        np.save(out, everything)
    try:
        ctx.serve()
        raise AssertionError("serve on a worker must raise")
    except RoleError:
        pass

ctx.finalize()                                               # frees every table still alive
ctx.finalize()
assert t.freed and other.freed
t.free()                                                     # safe after finalize too
for use in (lambda: t.pull([0]), lambda: t.push([0], np.zeros((1, D), np.float32)), lambda: tmp.pull([1])):
    try:
        use()
        raise AssertionError("use after free must raise")
    except FreedError as e:
        assert "after free" in str(e)
print(f"OK rank {ctx.rank}", flush=True)
