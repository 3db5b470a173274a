"""The training driver behind ``hpcps train``.

Every rank builds the data source (for table sizes) and the tables; PS ranks
then serve, workers run the loop:

    step_begin(t) -> read own slice of global batch t -> forward (pulls rows)
    -> backward (pushes sparse gradients from autograd hooks; dense buckets
    all-reduced as they fill) -> dense optimizer step -> step_end(t)

Each worker's loss is its share of the global-batch mean (``sum / B * W``;
the dense all-reduce averages over W workers and sparse gradients are pushed
scaled by ``1/W``), so in ``sync`` mode training equals one process training
on the whole global batch.
"""

import logging
import time

import numpy as np
import torch
from mpi4py import MPI

from .config import Config, build_sparse_optimizer
from .data import make_data
from .dense import DenseSync
from .metrics import MetricsLog, auc, logloss, mae, rmse
from .models import DLRM, MatrixFactorization
from .nn import ShardedEmbeddingBag
from .sparse import EmbeddingTable
from .sparse.optimizers import LRSchedule
from .topology import init

__all__ = ["train", "total_steps", "table_specs", "dense_optimizer", "dense_schedule"]

logger = logging.getLogger(__name__)


def total_steps(cfg: Config, data) -> int:
    """Steps the job runs: ``job.epochs`` passes over file data when set, else ``job.steps``. Local."""
    if cfg.job.epochs:
        return cfg.job.epochs * data.steps_per_epoch
    return cfg.job.steps


def table_specs(cfg: Config, data) -> list:
    """[(name, rows, dim, init_scale)] of the model's tables. Local."""
    dim = cfg.model.dim
    if cfg.model.kind == "mf":
        (_, nu), (_, ni) = data.tables
        return [("users", nu, dim, None), ("items", ni, dim, None), ("user_bias", nu, 1, 0.0),
                ("item_bias", ni, 1, 0.0)]
    return [(name, rows, dim, None) for name, rows in data.tables]


def dense_schedule(sec, steps: int) -> LRSchedule:
    return LRSchedule(kind=sec.schedule, warmup_steps=sec.warmup_steps, step_size=sec.step_size,
                      gamma=sec.gamma, total_steps=max(steps, 1), min_factor=sec.min_factor)


def dense_optimizer(sec, params) -> torch.optim.Optimizer:
    """The torch optimizer of ``[optimizer.dense]``. Local."""
    name = sec.name.lower()
    if name in ("sgd", "momentum"):
        m = sec.momentum or (0.9 if name == "momentum" else 0.0)
        return torch.optim.SGD(params, lr=sec.lr, momentum=m, weight_decay=sec.weight_decay)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=sec.lr, weight_decay=sec.weight_decay, eps=sec.eps or 1e-10)
    if name == "adam":
        return torch.optim.Adam(params, lr=sec.lr, betas=(sec.beta1, sec.beta2), eps=sec.eps or 1e-8,
                                weight_decay=sec.weight_decay)
    raise ValueError(f"config: optimizer.dense.name = {sec.name!r}: must be sgd, momentum, adagrad or adam")


def build_model(cfg: Config, embeddings, data) -> torch.nn.Module:
    """The model over the given embedding modules (hpcps or torch). Local."""
    if cfg.model.kind == "mf":
        return MatrixFactorization(embeddings, global_bias=getattr(data, "mean_rating", 0.0))
    return DLRM(embeddings, data.num_dense, cfg.model.dim, cfg.model.bottom_mlp, cfg.model.top_mlp)


def _inputs(batch, device):
    dense = torch.from_numpy(batch.dense)
    if device.type != "cpu":
        dense = dense.to(device, non_blocking=True)
    return dense, [torch.from_numpy(s) for s in batch.sparse]


def step_loss(model, batch, task: str, global_batch: int, scale: float, device=torch.device("cpu")):
    """Forward one batch; returns (loss to backward, summed per-sample loss). Local."""
    out = model(*_inputs(batch, device))
    y = torch.from_numpy(batch.labels).to(device)
    if task == "ctr":
        total = torch.nn.functional.binary_cross_entropy_with_logits(out, y, reduction="sum")
    else:
        total = torch.nn.functional.mse_loss(out, y, reduction="sum")
    return total * (scale / global_batch), float(total.detach())


def evaluate(model, data, comm: MPI.Comm, device=torch.device("cpu")) -> dict:
    """Eval metrics over every worker's eval shard. Collective over the worker communicator."""
    scores, labels, truth = [], [], []
    with torch.no_grad():
        for b in data.eval_batches():
            out = model(*_inputs(b, device))
            scores.append(out.cpu().numpy())
            labels.append(b.labels)
            if b.truth is not None:
                truth.append(b.truth)
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0)  # noqa: E731
    parts = comm.gather((cat(scores), cat(labels), cat(truth)), root=0)
    if comm.Get_rank() != 0:
        return {}
    s = np.concatenate([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts])
    t = np.concatenate([p[2] for p in parts])
    if data.task == "ctr":
        p = 1 / (1 + np.exp(-s))
        res = {"auc": auc(y, s), "logloss": logloss(y, p), "eval_samples": int(y.size)}
        if t.size:
            res["planted_auc"] = auc(y, t)
            res["planted_logloss"] = logloss(y, t)
        return res
    return {"rmse": rmse(y, s), "mae": mae(y, s), "eval_samples": int(y.size)}


def export_weights(path: str, model, tables) -> None:
    """Worker 0: dense state and every table's rows (global-id order) to one .npz. Local."""
    arrays = {f"dense/{k}": v.detach().cpu().numpy() for k, v in model.state_dict().items()}
    for t in tables:
        rows = np.empty((t.num_rows, t.dim), np.float32)
        for s in range(0, t.num_rows, 1 << 16):
            ids = np.arange(s, min(t.num_rows, s + (1 << 16)))
            rows[ids] = t.pull(ids)
        arrays[f"tables/{t.name}"] = rows
    np.savez(path, **arrays)


def train(cfg: Config) -> dict | None:
    """Run the job a config describes. Collective over ``MPI.COMM_WORLD``.

    Returns the final summary on world rank 0 (also printed by ``hpcps train``), None elsewhere.
    """
    world = MPI.COMM_WORLD
    summary = None
    if cfg.model.device == "cuda" and not torch.cuda.is_available():      # checked alike on every rank
        raise ValueError("config: model.device = 'cuda' but torch sees no GPU")
    with init(num_ps=cfg.job.num_ps, transport=cfg.job.transport, mode=cfg.job.mode) as ctx:
        W = ctx.num_workers
        data = make_data(cfg.data, cfg.job.seed, W, max(ctx.worker_rank, 0))
        steps = total_steps(cfg, data)
        sparse_opt = build_sparse_optimizer(cfg.optimizer.sparse, steps)
        tables = [EmbeddingTable(ctx, name, rows, dim, optimizer=sparse_opt, seed=cfg.job.seed,
                                 init_scale=scale, transport=cfg.job.transport)
                  for name, rows, dim, scale in table_specs(cfg, data)]
        if ctx.is_ps:
            ctx.serve()
        else:
            summary = _work(cfg, ctx, data, tables, steps)
        first_worker = ctx.worker_world_ranks[0]
    summary = world.bcast(summary, root=first_worker)
    return summary if world.Get_rank() == 0 else None


def _work(cfg, ctx, data, tables, steps):
    W, comm = ctx.num_workers, ctx.worker_comm
    lead = ctx.worker_rank == 0
    torch.manual_seed(cfg.job.seed)
    device = torch.device(cfg.model.device)
    if device.type == "cuda":
        local = comm.Split_type(MPI.COMM_TYPE_SHARED)
        device = torch.device("cuda", local.Get_rank() % torch.cuda.device_count())
        local.Free()
        torch.cuda.set_device(device)
    embs = [ShardedEmbeddingBag(t, mode="sum", grad_scale=1.0 / W, device=device) for t in tables]
    model = build_model(cfg, embs, data).to(device)
    dense = DenseSync(model, comm, backend=cfg.model.dense_backend, bucket_mb=cfg.model.bucket_mb)
    opt = dense_optimizer(cfg.optimizer.dense, model.parameters())
    sched = dense_schedule(cfg.optimizer.dense, steps)
    base_lrs = [g["lr"] for g in opt.param_groups]
    log = MetricsLog(cfg.metrics.path if lead else "")
    bar = None
    if lead and cfg.metrics.progress:
        from tqdm import tqdm
        bar = tqdm(total=steps, desc="train", unit="step", dynamic_ncols=True)
    B = cfg.data.batch_size
    timing = dict.fromkeys(("data", "wait", "compute", "dense_wait"), 0.0)
    t_start = last_t = time.perf_counter()
    last_step, loss_acc, n_acc = 0, 0.0, 0
    pulls0 = [(t.stats.pull_seconds, t.stats.push_seconds) for t in tables]
    for step in range(steps):
        t0 = time.perf_counter()
        stale = ctx.step_begin(step)
        t1 = time.perf_counter()
        batch = data.train_batch(step)
        t2 = time.perf_counter()
        loss, total = step_loss(model, batch, data.task, B, W, device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        t3 = time.perf_counter()
        dense.synchronize()
        t4 = time.perf_counter()
        if cfg.optimizer.dense.clip_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.dense.clip_norm)
        f = sched.factor(step)
        for g, lr in zip(opt.param_groups, base_lrs):
            g["lr"] = lr * f
        opt.step()
        ctx.step_end(step)
        timing["wait"] += t1 - t0
        timing["data"] += t2 - t1
        timing["compute"] += t3 - t2
        timing["dense_wait"] += t4 - t3
        loss_acc += total
        n_acc += len(batch)
        if bar is not None:
            bar.update(1)
        if (step + 1) % cfg.job.log_every == 0 or step + 1 == steps:
            now = time.perf_counter()
            rate = (step + 1 - last_step) * B / max(now - last_t, 1e-9)
            rec = {"step": step + 1, "loss": loss_acc / max(n_acc, 1), "samples_per_s": rate,
                   "staleness": stale,
                   "pull_ms": 1e3 * sum(t.stats.pull_seconds - p[0] for t, p in zip(tables, pulls0)) /
                   max(step + 1 - last_step, 1),
                   "push_ms": 1e3 * sum(t.stats.push_seconds - p[1] for t, p in zip(tables, pulls0)) /
                   max(step + 1 - last_step, 1),
                   "rows_per_ps": [int(sum(t.stats.rows_per_ps[p] for t in tables)) for p in range(ctx.num_ps)],
                   "time_breakdown_s": {k: round(v, 4) for k, v in timing.items()}}
            if bar is not None:
                bar.set_postfix(loss=f"{rec['loss']:.4f}", samples_s=f"{rate:,.0f}")
            pulls0 = [(t.stats.pull_seconds, t.stats.push_seconds) for t in tables]
            last_step, last_t, loss_acc, n_acc = step + 1, now, 0.0, 0
            if cfg.job.eval_every and (step + 1) % cfg.job.eval_every == 0 and step + 1 < steps:
                ctx.fence(step + 1)
                rec["eval"] = evaluate(model, data, comm, device)
            log.write(rec)
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - t_start
    ctx.fence(steps)                                   # every staged gradient is applied
    result = evaluate(model, data, comm, device)
    stale = ctx.control.staleness
    all_stale = comm.gather(stale, root=0)
    if cfg.job.export and lead:
        export_weights(cfg.job.export, model, tables)
    comm.Barrier()
    dense.close()
    if not lead:
        return None
    flat = [s for part in all_stale for s in part]
    final = {**result, "steps": steps, "samples_per_s": steps * B / max(elapsed, 1e-9),
             "elapsed_s": elapsed, "num_ps": ctx.num_ps, "num_workers": W, "mode": ctx.mode,
             "max_staleness": max(flat) if flat else 0, "data": data.stats}
    log.write({"final": final})
    log.close()
    return final
