"""A parameter server on PyTorch's own RPC framework (torch.distributed.rpc), the pattern of
PyTorch's parameter-server tutorial, for the end-to-end benchmark (scripts/bench_e2e.py).

The last rank is the PS: it holds every embedding table (the same initial rows as hpcps) and
applies Adagrad to the rows pushed to it, under a lock. The other ranks are workers: per step,
one ``rpc_sync`` pulls the unique rows of every table, the same DLRM runs forward and backward,
dense gradients are all-reduced over a gloo group of the workers, and one ``rpc_async`` pushes
the row gradients; a barrier ends the step, so steps are synchronous like hpcps ``sync`` mode.
"""

import os
import threading
import time

import numpy as np
import torch

_PS = {}


def ps_pull(ids_per_table):
    return [torch.index_select(t, 0, ids) for t, ids in zip(_PS["tables"], ids_per_table)]


def ps_push(ids_per_table, grads_per_table):
    lr, eps = _PS["lr"], _PS["eps"]
    with _PS["lock"]:
        for t, s, ids, g in zip(_PS["tables"], _PS["state"], ids_per_table, grads_per_table):
            acc = s.index_select(0, ids).add_(g * g)
            s.index_copy_(0, ids, acc)
            t.index_add_(0, ids, -lr * g / (acc.sqrt() + eps))
    return True


class _Pulled(torch.nn.Module):
    """Looks ids up in the rows pulled for this step (a leaf tensor that collects their grads)."""

    def __init__(self):
        super().__init__()
        self.rows, self.inverse = None, None

    def forward(self, ids):
        return self.rows[self.inverse].view(ids.shape[0], -1, self.rows.shape[1]).sum(1)


def run(rank: int, world: int, config: str, steps: int, warmup: int, port: int, result, master: str = "127.0.0.1"):
    """One process of the baseline (torch.multiprocessing.spawn target; ``master``: rank 0's address)."""
    torch.set_num_threads(1)
    import torch.distributed as dist
    import torch.distributed.rpc as rpc

    from hpcps.config import build_sparse_optimizer, load_config
    from hpcps.data import make_data
    from hpcps.core.ids import initial_rows
    from hpcps.train import build_model, dense_optimizer, table_specs

    cfg = load_config(config, [f"job.steps={steps}"], environ={})
    W = world - 1
    is_ps = rank == W
    data = make_data(cfg.data, cfg.job.seed, W, 0 if is_ps else rank)
    specs = table_specs(cfg, data)
    if is_ps:
        opt = build_sparse_optimizer(cfg.optimizer.sparse, steps)
        if type(opt).__name__ != "Adagrad" or opt.rowwise:
            raise ValueError("the RPC baseline implements element-wise Adagrad only")
        _PS.update(tables=[torch.from_numpy(initial_rows(cfg.job.seed, n, np.arange(r), d, s, kind=k))
                           for n, r, d, k, s in specs],
                   lock=threading.Lock(), lr=opt.lr, eps=opt.eps)
        _PS["state"] = [torch.full_like(t, opt.initial_accumulator_value) for t in _PS["tables"]]
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, init_method=f"tcp://{master}:{port}",
                                           rpc_timeout=600)
    rpc.init_rpc("ps" if is_ps else f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    if not is_ps:
        dist.init_process_group("gloo", init_method=f"tcp://{master}:{port + 1}", rank=rank, world_size=W)
        torch.manual_seed(cfg.job.seed)
        embs = [_Pulled() for _ in specs]
        model = build_model(cfg, embs, data)
        dense = list(model.parameters())
        dopt = dense_optimizer(cfg.optimizer.dense, dense)
        B = cfg.data.batch_size
        t0 = None
        for step in range(steps):
            if step == warmup:
                dist.barrier()
                t0 = time.perf_counter()
            b = data.train_batch(step)
            uniq = [np.unique(s, return_inverse=True) for s in b.sparse]
            rows = rpc.rpc_sync("ps", ps_pull, args=([torch.from_numpy(u) for u, _ in uniq],))
            for e, r, (_, inv) in zip(embs, rows, uniq):
                e.rows, e.inverse = r.requires_grad_(), torch.from_numpy(inv)
            out = model(torch.from_numpy(b.dense), [torch.from_numpy(s) for s in b.sparse])
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                out, torch.from_numpy(b.labels), reduction="sum") / B
            dopt.zero_grad(set_to_none=True)
            loss.backward()
            flat = torch.cat([p.grad.reshape(-1) for p in dense])
            dist.all_reduce(flat)
            i = 0
            for p in dense:
                p.grad.copy_(flat[i:i + p.numel()].view_as(p))
                i += p.numel()
            dopt.step()
            fut = rpc.rpc_async("ps", ps_push, args=([torch.from_numpy(u) for u, _ in uniq],
                                                     [e.rows.grad for e in embs]))
            fut.wait()
            dist.barrier()          # every push of this step is applied before the next pull
        elapsed = time.perf_counter() - t0
        if rank == 0 and result is not None:
            result.put({"samples_per_s": (steps - warmup) * B / elapsed, "elapsed_s": elapsed,
                        "steps": steps - warmup, "loss_last": float(loss.detach()) * W})
        dist.destroy_process_group()
    rpc.shutdown()


def main(config: str, steps: int, warmup: int, ranks: int, port: int = 29611) -> dict:
    """Run the baseline with ``ranks`` processes (1 PS + ranks-1 workers); returns rank 0's figures."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(run, args=(ranks, config, steps, warmup, port, q), nprocs=ranks, join=True,
                       start_method="spawn")
    return q.get()


class _Print:
    def put(self, figures):
        print(json.dumps({"rpc": figures}), flush=True)


if __name__ == "__main__":
    # one process per rank, started by an MPI launcher (only for its rank and size: no MPI is used),
    # e.g. across pretend hosts: scripts/cluster.sh mpiexec h0:2,h1:1 -n 3 python scripts/rpc_ps_baseline.py
    #   CONFIG STEPS WARMUP MASTER  (MASTER: rank 0's host; the last rank is the PS; rank 0 prints JSON)
    import json
    import sys
    env = os.environ
    rank = int(env.get("PMI_RANK", env.get("OMPI_COMM_WORLD_RANK", "0")))
    world = int(env.get("PMI_SIZE", env.get("OMPI_COMM_WORLD_SIZE", "1")))
    config, steps, warmup, master = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    run(rank, world, config, steps, warmup, 29611, _Print(), master)
