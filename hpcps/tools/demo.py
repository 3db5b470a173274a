"""``hpcps demo``: workers pull and push random embedding rows against the PS ranks.

Every worker pushes ``+1`` (as ``grad = -1`` with SGD ``lr = 1``) to each row it
touches; at the end the workers check that every row equals its initial value
plus the number of pushes it received from all workers (to within float32
rounding, far below the 1.0 a lost or doubled push would show).
"""

import logging
import time

import numpy as np
from mpi4py import MPI

from ..core import optimizers as optim
from ..sparse import EmbeddingTable, initial_rows
from ..runtime.context import init

__all__ = ["run_demo"]

logger = logging.getLogger(__name__)


def run_demo(num_rows: int, dim: int, batch: int, steps: int, num_ps: int | None,
             transport: str | None, seed: int, zipf: float) -> dict | None:
    """Run the demo; returns the summary on world rank 0's worker, else None. Collective over the world."""
    with init(num_ps=num_ps, transport=transport) as ctx:
        table = EmbeddingTable(ctx, "items", num_rows, dim, optimizer=optim.SGD(lr=1.0), seed=seed)
        if ctx.is_ps:
            ctx.serve()
            return None
        rng = np.random.default_rng([seed, ctx.worker_rank])
        counts = np.zeros(num_rows, dtype=np.int64)
        grads = -np.ones((batch, dim), dtype=np.float32)
        pull_s = push_s = 0.0
        ctx.worker_comm.Barrier()
        t_start = time.perf_counter()
        for _ in range(steps):
            if zipf > 1:
                ids = (rng.zipf(zipf, batch) - 1) % num_rows
            else:
                ids = rng.integers(0, num_rows, batch)
            t0 = time.perf_counter()
            table.pull(ids)
            t1 = time.perf_counter()
            table.push(ids, grads)
            push_s += time.perf_counter() - t1
            pull_s += t1 - t0
            np.add.at(counts, ids, 1)
        elapsed = time.perf_counter() - t_start
        ctx.worker_comm.Barrier()                          # every push is complete
        total = np.empty_like(counts)
        ctx.worker_comm.Allreduce(counts, total, op=MPI.SUM)
        mine = np.arange(ctx.worker_rank, num_rows, ctx.num_workers)   # each worker checks a slice
        expected = initial_rows(seed, "items", mine, dim, table.init_scale) + total[mine, None]
        got = table.pull(mine)
        err = float(np.abs(got - expected).max()) if mine.size else 0.0
        worst = ctx.worker_comm.allreduce(err, op=MPI.MAX)
        rows = ctx.worker_comm.allreduce(2 * steps * batch, op=MPI.SUM)
        pull_rate = ctx.worker_comm.allreduce(steps * batch / max(pull_s, 1e-9), op=MPI.SUM)
        push_rate = ctx.worker_comm.allreduce(steps * batch / max(push_s, 1e-9), op=MPI.SUM)
        summary = {
            "num_ps": ctx.num_ps, "num_workers": ctx.num_workers, "rows": num_rows, "dim": dim,
            "batch": batch, "steps": steps, "transport": table.transport,
            "shared_memory_ps": table.shared_memory_ps,
            "pull_mrows_per_s": round(pull_rate / 1e6, 3),
            "push_mrows_per_s": round(push_rate / 1e6, 3),
            "rows_moved_per_s": round(rows / elapsed, 1),
            "pushes_applied": int(total.sum()),
            "max_abs_error": worst,
            # Each push adds exactly +1; float32 rounding of the running value stays far below
            # 0.5 while counts are < 2**22, so one lost (or doubled) push shows as an error >= ~1.
            "verified": bool(worst < 0.5 and total.max() < 2 ** 22),
        }
        return summary if ctx.rank == ctx.worker_world_ranks[0] else None
