"""hpcps.nn (torch modules over sharded tables) written once and run at several world sizes with
pytest-mpi. Launched by tests/test_parallel.py (``mpiexec -n N python -m pytest --with-mpi``, under
a timeout); not collected by the serial run."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

import hpcps
from hpcps.nn import IdPlan, ShardedEmbeddingBag, ShardedEmbeddingCollection


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_sharded_embedding_bag_matches_torch(mode):
    N, D = 40, 6
    with hpcps.init(num_ps=1, mode="sync") as ctx:
        t = hpcps.EmbeddingTable(ctx, "bag", N, D, optimizer=hpcps.optim.SGD(lr=1.0), seed=5)
        if ctx.is_ps:
            ctx.serve()
            return
        ref = torch.nn.EmbeddingBag.from_pretrained(torch.from_numpy(hpcps.initial_rows(5, "bag", np.arange(N), D)),
                                                    freeze=False, mode=mode)
        bag = ShardedEmbeddingBag(t, mode=mode)
        ids = torch.tensor([3, 3, 7, 1, 39, 3, 0])
        offsets = torch.tensor([0, 2, 5])                       # bags of 2, 3, 2 (duplicates inside)
        weights = torch.arange(1.0, 4.0)[:, None]
        out = bag(ids, offsets)
        expected = ref(ids, offsets)
        torch.testing.assert_close(out, expected)
        single = bag(ids.view(-1, 1))                          # 2-D input, bags of one id (F.embedding path)
        single_expected = ref(ids.view(-1, 1))
        torch.testing.assert_close(single, single_expected)
        ctx.worker_comm.Barrier()                              # every worker read before anyone pushes
        ctx.step_begin(0)
        w1 = torch.arange(1.0, 8.0)[:, None]
        ((out * weights).sum() + (single * w1).sum()).backward()   # pushes -1 * grad into the table
        ctx.step_end(0)
        ((expected * weights).sum() + (single_expected * w1).sum()).backward()
        ctx.fence(1)
        ctx.worker_comm.Barrier()
        W = ctx.num_workers
        want = ref.weight.detach() - W * ref.weight.grad     # every worker pushed the same gradient
        torch.testing.assert_close(torch.from_numpy(t.pull(np.arange(N))), want, rtol=1e-5, atol=1e-6)


@pytest.mark.mpi(min_size=2)
def test_sharded_embedding_collection_equals_stacked_bags():
    """The collection (one leaf, one hook for every table) gives the stacked bags' output and
    pushes the same gradients to each table."""
    N, D, T = 30, 4, 3
    with hpcps.init(num_ps=1, mode="sync") as ctx:
        tabs = [hpcps.EmbeddingTable(ctx, f"c{i}", N, D, optimizer=hpcps.optim.SGD(lr=1.0), seed=2) for i in range(T)]
        odd = hpcps.EmbeddingTable(ctx, "odd", N, D + 1, optimizer=hpcps.optim.SGD(lr=1.0), seed=2)
        if ctx.is_ps:
            ctx.serve()
            return
        with pytest.raises(ValueError, match="one dim"):
            ShardedEmbeddingCollection([ShardedEmbeddingBag(tabs[0]), ShardedEmbeddingBag(odd)])
        coll = ShardedEmbeddingCollection([ShardedEmbeddingBag(t, grad_scale=0.5) for t in tabs])
        ids = [torch.tensor([1, 1, 29, 4]), torch.tensor([0, 5, 5, 5]), torch.tensor([[7], [8], [9], [7]])]
        with pytest.raises(ValueError, match="one id per sample"):
            coll([ids[0], ids[1], torch.tensor([1, 2])])
        refs = [torch.from_numpy(hpcps.initial_rows(2, f"c{i}", np.arange(N), D)).requires_grad_() for i in range(T)]
        out = coll(ids)                                        # one np.unique for all tables
        expected = torch.stack([F.embedding(x.reshape(-1), r) for x, r in zip(ids, refs)], dim=1)
        torch.testing.assert_close(out, expected)
        with pytest.raises(ValueError, match="out of range"):  # a bad id: the per-table path names it
            coll([ids[0], torch.tensor([0, 1, 2, N]), ids[2]])
        with torch.no_grad():                                  # a prefetch waiting: the per-table path
            coll.bags[1].prefetch(ids[1], 0)
            torch.testing.assert_close(coll(ids), expected.detach())
        ctx.worker_comm.Barrier()                              # every worker read before anyone pushes
        w = torch.arange(1.0, 1.0 + out.numel()).view_as(out)
        ctx.step_begin(0)
        (out * w).sum().backward()                             # pushes -0.5 * grad into each table
        ctx.step_end(0)
        (expected * w).sum().backward()
        ctx.fence(1)
        ctx.worker_comm.Barrier()
        W = ctx.num_workers
        for t, r in zip(tabs, refs):
            torch.testing.assert_close(torch.from_numpy(t.pull(np.arange(N))), r.detach() - 0.5 * W * r.grad,
                                       rtol=1e-5, atol=1e-5)


def _push_one_sync_step(ctx, batch, outs):
    """Step 0 on a worker: the backward of each of ``outs`` times one random weight (per worker),
    their pushes sent in one batch, then the fence, so every PS applied them."""
    w = torch.randn(outs[0].shape, generator=torch.Generator().manual_seed(ctx.worker_rank))
    ctx.worker_comm.Barrier()                              # every worker read before anyone pushes
    ctx.step_begin(0)
    for out in outs:
        (out * w).sum().backward()
    batch.flush()
    ctx.step_end(0)
    ctx.fence(1)


@pytest.mark.mpi(min_size=2)
def test_collection_in_one_pass_matches_the_bags_one_by_one():
    """With every shard in this node's shared memory the collection pulls all its tables in one
    pass, and its pushes skip the per-table checks: the same rows and the same Adagrad step as
    separate bags. A NaN gradient is still refused, naming the table, and nothing is pushed.
    At 3 ranks the tables have 2 PS ranks (each pull splits by owner)."""
    from hpcps.sparse.pipeline import CommThread, PushBatch
    N, D, T = 50, 4, 3
    num_ps = 2 if MPI.COMM_WORLD.Get_size() >= 3 else 1
    with hpcps.init(num_ps=num_ps, mode="sync") as ctx:
        opt = hpcps.optim.Adagrad(lr=0.1)
        a = [hpcps.EmbeddingTable(ctx, f"a{i}", N, D, optimizer=opt, seed=3) for i in range(T)]
        b = [hpcps.EmbeddingTable(ctx, f"b{i}", N, D, optimizer=opt, seed=3) for i in range(T)]
        if ctx.is_ps:
            ctx.serve()
            return
        batch = PushBatch(CommThread(enabled=False))
        coll = ShardedEmbeddingCollection([ShardedEmbeddingBag(t, batch=batch) for t in a])
        bags = [ShardedEmbeddingBag(t, batch=batch) for t in b]
        assert coll._together()
        ids = [torch.tensor([3, 3, 17, 49, 0]), torch.tensor([1, 2, 3, 4, 5]), torch.tensor([49, 49, 49, 0, 0])]
        everything = np.arange(N)
        before_a, before_b = [t.pull(everything) for t in a], [t.pull(everything) for t in b]
        out = coll(ids)
        for j, (t, x) in enumerate(zip(a, ids)):
            torch.testing.assert_close(out[:, j], torch.from_numpy(t.pull(x.numpy())), rtol=0, atol=0)
        # the plan the batch loader's child makes (IdPlan over the same tables, passed as arrays)
        made = IdPlan.unpack({k: v.copy() for k, v in IdPlan(a).pack([x.numpy() for x in ids])})
        coll.prepare(ids, made)
        assert coll._prepared[1] is made
        torch.testing.assert_close(coll(ids), out, rtol=0, atol=0)
        assert coll._prepared is None
        sep = torch.stack([bag(x.view(-1, 1)) for bag, x in zip(bags, ids)], dim=1)
        reported = []
        coll.after_push = lambda: reported.append(len(batch._items))    # every table's push is in the batch
        _push_one_sync_step(ctx, batch, [out, sep])
        assert reported == [T]
        coll.after_push = None
        for ta, tb, a0, b0 in zip(a, b, before_a, before_b):
            moved = ta.pull(everything) - a0
            assert np.abs(moved).max() > 0
            np.testing.assert_allclose(moved, tb.pull(everything) - b0, rtol=1e-6, atol=1e-7)
        ctx.worker_comm.Barrier()
        after = [t.pull(everything) for t in a]
        (coll(ids) * float("nan")).sum().backward()
        with pytest.raises(ValueError, match="table 'a0'.*NaN"):
            batch.flush()
        for t, x in zip(a, after):
            np.testing.assert_array_equal(t.pull(everything), x)


@pytest.mark.mpi(min_size=2)
def test_table_batched_collection_equals_separate_tables():
    """One table with a segment per logical table (what ``hpcps train`` builds) starts with each
    segment's rows as the separate tables' and, under the collection, gives the same lookups and
    the same Adagrad step; a bad id names its logical table; a prefetch is used as with
    separate bags. At 3 ranks the tables have 2 PS ranks (each pull splits by owner)."""
    from hpcps.sparse.pipeline import CommThread, PushBatch
    D, rows = 4, [50, 7, 30]
    num_ps = 2 if MPI.COMM_WORLD.Get_size() >= 3 else 1
    with hpcps.init(num_ps=num_ps, mode="sync") as ctx:
        opt = hpcps.optim.Adagrad(lr=0.1)
        apart = [hpcps.EmbeddingTable(ctx, f"s{i}", r, D, optimizer=opt, seed=3) for i, r in enumerate(rows)]
        fused = hpcps.EmbeddingTable(ctx, "fused", sum(rows), D, optimizer=opt, seed=3,
                                     segments=[(f"s{i}", r) for i, r in enumerate(rows)])
        if ctx.is_ps:
            ctx.serve()
            return
        starts = fused.segment_starts
        assert starts.tolist() == [0, 50, 57, 87]

        def segments():
            every = fused.pull(np.arange(sum(rows)))
            return [every[a:b] for a, b in zip(starts[:-1], starts[1:])]
        for seg, t in zip(segments(), apart):
            np.testing.assert_array_equal(seg, t.pull(np.arange(t.num_rows)))
        batch = PushBatch(CommThread(enabled=False))
        one = ShardedEmbeddingCollection([ShardedEmbeddingBag(fused, batch=batch)])
        sep = ShardedEmbeddingCollection([ShardedEmbeddingBag(t, batch=batch) for t in apart])
        assert len(one) == len(sep) == 3 and one._together()
        ids = [torch.tensor([3, 3, 17, 49, 0]), torch.tensor([6, 0, 0, 1, 6]), torch.tensor([29, 29, 0, 1, 2])]
        with pytest.raises(ValueError, match="table 's1'.*id 7 out of range"):
            one([ids[0], torch.tensor([0, 1, 7, 2, 3]), ids[2]])
        with pytest.raises(ValueError, match="3 tables, got ids for 2"):
            one(ids[:2])
        with torch.no_grad():                                  # a prefetch waiting: the per-bag path
            plain = one(ids)
            one.prefetch(ids, 0)
            assert one.bags[0].prefetch_pending and not one._together()
            torch.testing.assert_close(one(ids), plain, rtol=0, atol=0)
            assert not one.bags[0].prefetch_pending                   # the forward used it
        out, out_sep = one(ids), sep(ids)
        torch.testing.assert_close(out, out_sep, rtol=0, atol=0)
        _push_one_sync_step(ctx, batch, [out, out_sep])
        for seg, t, r in zip(segments(), apart, rows):
            after = t.pull(np.arange(r))
            assert np.abs(after - hpcps.initial_rows(3, t.name, np.arange(r), D)).max() > 0
            np.testing.assert_allclose(seg, after, rtol=1e-6, atol=1e-7)
