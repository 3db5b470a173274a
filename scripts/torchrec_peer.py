"""TorchRec as the peer of hpcps (scripts/bench_peers.py): the same model, data, optimizers and
initial rows on TorchRec's DistributedModelParallel (gloo, CPU), one sharding type for every table.

Every rank is a trainer (TorchRec has no PS ranks): it draws its share of each global batch as an
hpcps worker of as many workers would (hpcps.data), looks its ids up in the sharded
EmbeddingBagCollection (the sparse optimizer fused into its backward: apply_optimizer_in_backward),
and runs hpcps's own dense model (hpcps.train.build_model) on the pooled rows; DMP all-reduces
the dense gradients (DDP). The loss is hpcps's: the batch's summed loss over the global batch, so
the rows' gradients are hpcps's; DDP averages the dense gradients, so they are scaled back by
the ranks. Initial rows are hpcps's (hpcps.core.ids.initial_rows), copied into each rank's shards.

Launched by an MPI launcher, one process per rank (MPI gives the rank, size and evaluation gather):
    mpiexec -n N python -m mpi4py scripts/torchrec_peer.py CONFIG SHARDING STEPS WARMUP [--set K=V ...]
Rank 0 prints one line {"torchrec": {"samples_per_s", "auc", ...}}. Needs the optional peers
(`scripts/run setup --peers`: torchrec 1.8.0, fbgemm-gpu-cpu 1.8.0).
"""

import json
import os
import sys
import time

import numpy as np
import torch

SHARDINGS = ("table_wise", "column_wise", "table_column_wise", "data_parallel")   # on CPU (row_wise: not)


class _Pooled(torch.nn.Module):
    """One table's lookup in hpcps's model: the pooled rows TorchRec computed for this batch."""

    def __init__(self):
        super().__init__()
        self.out = None

    def forward(self, ids):
        return self.out


class Peer(torch.nn.Module):
    """The sharded lookups, then hpcps's dense model over them."""

    def __init__(self, ebc, dense, pooled):
        super().__init__()
        self.ebc, self.dense, self.pooled = ebc, dense, pooled

    def forward(self, dense, sparse):
        from torchrec import KeyedJaggedTensor
        B = dense.shape[0]
        ids = [s.reshape(B, -1) for s in sparse]
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{i}" for i in range(len(ids))], values=torch.cat([x.reshape(-1) for x in ids]),
            lengths=torch.cat([torch.full((B,), x.shape[1], dtype=torch.int64) for x in ids]))
        kt = self.ebc(kjt)
        d = kt.to_dict()
        for i, p in enumerate(self.pooled):
            p.out = d[f"f{i}"]
        return self.dense(dense, sparse)


def _load_rows(model, full: dict) -> None:
    """Copy each table's full initial rows into this rank's shards of it."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    with torch.no_grad():
        for key, t in model.state_dict().items():
            name = next((n for n in full if key.endswith(f"embedding_bags.{n}.weight")), None)
            if name is None:
                continue
            src = full[name]
            if isinstance(t, ShardedTensor):
                for shard in t.local_shards():
                    (r0, c0), (r, c) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                    shard.tensor.copy_(src[r0:r0 + r, c0:c0 + c])
            else:
                t.copy_(src)


def build(cfg, data, sharding: str, world: int):
    import torch.distributed as dist
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from hpcps.config import build_sparse_optimizer
    from hpcps.core.ids import initial_rows
    from hpcps.train import build_model, dense_optimizer, table_specs

    specs = table_specs(cfg, data)
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=d, num_embeddings=n, feature_names=[f"f{i}"])
              for i, (_, n, d, _, _) in enumerate(specs)]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    sparse = build_sparse_optimizer(cfg.optimizer.sparse, cfg.job.steps)
    if type(sparse).__name__ != "Adagrad" or sparse.rowwise or sparse.initial_accumulator_value:
        raise ValueError("the TorchRec peer runs element-wise Adagrad from a zero accumulator on the rows only")
    apply_optimizer_in_backward(torch.optim.Adagrad, ebc.parameters(), {"lr": sparse.lr, "eps": sparse.eps})
    torch.manual_seed(cfg.job.seed)
    pooled = [_Pooled() for _ in specs]
    dense = build_model(cfg, pooled, data)
    dopt = dense_optimizer(cfg.optimizer.dense, list(dense.parameters()))
    cons = {t.name: ParameterConstraints(sharding_types=[sharding]) for t in tables}
    peer = Peer(ebc, dense, pooled)
    plan = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu"),
                                    constraints=cons).collective_plan(peer, None, dist.GroupMember.WORLD)
    model = DistributedModelParallel(peer, device=torch.device("cpu"), plan=plan)
    _load_rows(model, {f"t{i}": torch.from_numpy(initial_rows(cfg.job.seed, n, np.arange(r), d, s, kind=k))
                       for i, (n, r, d, k, s) in enumerate(specs)})
    return model, dense, dopt


def main(argv) -> None:
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    config, sharding, steps, warmup = argv[0], argv[1], int(argv[2]), int(argv[3])
    sets = argv[5:] if len(argv) > 4 and argv[4] == "--set" else []
    if sharding not in SHARDINGS:
        raise SystemExit(f"torchrec_peer.py: sharding must be one of {SHARDINGS}, got {sharding!r}")
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // node.Get_size()))   # as hpcps: the node's CPUs
    import socket
    here = (socket.gethostbyname(socket.gethostname()), 29700 + os.getpid() % 200) if rank == 0 else None
    addr, port = comm.bcast(here, root=0)           # rank 0's address: across hosts too
    os.environ.setdefault("MASTER_ADDR", addr)
    os.environ.setdefault("MASTER_PORT", str(port))
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=rank, world_size=world)

    from hpcps.config import load_config
    from hpcps.data import make_data
    from hpcps.train.evaluation import evaluate

    cfg = load_config(config, [f"job.steps={steps}", *sets], environ={})
    data = make_data(cfg.data, cfg.job.seed, world, rank)
    model, dense, dopt = build(cfg, data, sharding, world)
    B = cfg.data.batch_size
    t0 = None
    for step in range(steps):
        if step == warmup:
            dist.barrier()
            t0 = time.perf_counter()
        b = data.train_batch(step)
        out = model(torch.from_numpy(b.dense), [torch.from_numpy(s) for s in b.sparse])
        loss = torch.nn.functional.binary_cross_entropy_with_logits(out, torch.from_numpy(b.labels),
                                                                    reduction="sum") / B
        dopt.zero_grad(set_to_none=True)
        loss.backward()                       # the rows' Adagrad runs in here (fused)
        for p in dense.parameters():          # DDP averaged them: hpcps sums the workers'
            if p.grad is not None:
                p.grad.mul_(world)
        dopt.step()
    dist.barrier()
    elapsed = time.perf_counter() - t0
    res = evaluate(model, data, comm)
    if rank == 0:
        print(json.dumps({"torchrec": {"sharding": sharding, "ranks": world, "samples_per_s": (steps - warmup) * B / elapsed,
                                       "elapsed_s": elapsed, "steps": steps - warmup, **res}}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
