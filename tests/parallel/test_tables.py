"""Table tests written once and run at several world sizes with pytest-mpi.

Launched by tests/test_parallel.py as ``mpiexec -n N python -m pytest --with-mpi``
under a timeout; not collected by the serial run.
"""

import numpy as np
import pytest

import hpcps


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("transport", ["auto", "rma"])
def test_round_trip_at_any_size(transport):
    with hpcps.init(num_ps=1, transport=transport) as ctx:
        t = hpcps.EmbeddingTable(ctx, "emb", 97, 5, optimizer=hpcps.optim.SGD(lr=0.5), seed=3)
        if ctx.is_ps:
            ctx.serve()
            return
        ids = np.arange(ctx.worker_rank, 97, ctx.num_workers)           # disjoint per worker
        start = t.pull(ids)
        np.testing.assert_array_equal(start, hpcps.initial_rows(3, "emb", ids, 5))
        t.push(ids, np.full((ids.size, 5), 2.0, np.float32))            # w -= 0.5 * 2
        ctx.worker_comm.Barrier()
        np.testing.assert_allclose(t.pull(ids), start - 1.0, rtol=0, atol=1e-6)


@pytest.mark.mpi(min_size=3)
def test_two_ps_sum_duplicates_across_workers():
    with hpcps.init(num_ps=2) as ctx:
        t = hpcps.EmbeddingTable(ctx, "dup", 10, 2, optimizer=hpcps.optim.SGD(lr=1.0), init_scale=0.0)
        if ctx.is_ps:
            ctx.serve()
            return
        t.push([3, 3, 4], -np.ones((3, 2), np.float32))
        ctx.worker_comm.Barrier()
        got = t.pull([3, 4, 5])
        W = ctx.num_workers
        np.testing.assert_array_equal(got, [[2 * W] * 2, [W] * 2, [0, 0]])
