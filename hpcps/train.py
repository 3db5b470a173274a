"""The training driver behind ``hpcps train``.

Every rank builds the data source (for table sizes) and the tables; PS ranks
then serve, workers run the loop:

    step_begin(t) -> read own slice of global batch t -> forward (pulls rows)
    -> backward (autograd hooks collect the sparse gradients; dense buckets are
    all-reduced as they fill) -> push every table's gradients together
    (push_many) -> step_end(t) (with the loader's id plans, both from the
    embeddings' hook, while the bottom MLP still runs backward) -> read own
    slice of batch t+1 (from the loader process, ``pipeline.loader``) and check
    and index its ids (while the other workers finish and the PS applies step
    t) -> finish the dense all-reduce -> dense optimizer step

Each worker's loss is its share of the global-batch mean (``sum / B * W``;
the dense all-reduce averages over W workers and sparse gradients are pushed
scaled by ``1/W``), so in ``sync`` mode training equals one process training
on the whole global batch.
"""

import contextlib
import functools
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

from . import _malloc
from . import checkpoint as ckpt_mod
from .config import Config, build_sparse_optimizer, parse_permissions, resolve_switch
from .data import make_data
from .data.loader import BatchAhead, placement
from .data.loader import supported as loader_supported
from .dense import DenseSync
from .metrics import MetricsLog, auc, logloss, mae, rmse
from .models import DLRM, MatrixFactorization
from .nn import IdPlan, ShardedEmbeddingBag, ShardedEmbeddingCollection
from .sparse import EmbeddingTable
from .sparse.optimizers import LRSchedule
from .sparse.pipeline import CommThread, PushBatch, RowCache
from .sparse.control import parse_mode
from .stopping import EXIT_CHECKPOINTED, StopRequest
from .topology import init

__all__ = ["train", "total_steps", "table_specs", "fused_tables", "FUSED_TABLE", "dense_optimizer", "dense_schedule",
           "EXIT_CHECKPOINTED"]

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


_THREAD_LEVELS = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                  MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}


FUSED_TABLE = "embeddings"      # the table-batched table's name (model.fuse_tables)


def fused_tables(cfg: Config, specs) -> bool:
    """Whether the job keeps the model's tables in one table-batched table (``model.fuse_tables``,
    a DLRM whose tables share dim and initial scale). Local."""
    return (cfg.model.fuse_tables and cfg.model.kind == "dlrm" and len(specs) > 1
            and len({(dim, scale) for _, _, dim, scale in specs}) == 1)


def dense_schedule(sec, steps: int) -> LRSchedule:
    return LRSchedule(kind=sec.schedule, warmup_steps=sec.warmup_steps, step_size=sec.step_size,
                      gamma=sec.gamma, total_steps=max(steps, 1), min_factor=sec.min_factor)


def dense_optimizer(sec, params) -> torch.optim.Optimizer:
    """The torch optimizer of ``[optimizer.dense]``: torch's fused kernel (one call for every
    parameter) where torch has one for the parameters' device, else the plain one. Local."""
    name = sec.name.lower()
    if name in ("sgd", "momentum"):
        m = sec.momentum or (0.9 if name == "momentum" else 0.0)
        cls, kw = torch.optim.SGD, dict(lr=sec.lr, momentum=m, weight_decay=sec.weight_decay)
    elif name == "adagrad":
        cls, kw = torch.optim.Adagrad, dict(lr=sec.lr, weight_decay=sec.weight_decay, eps=sec.eps or 1e-10)
    elif name == "adam":
        cls, kw = torch.optim.Adam, dict(lr=sec.lr, betas=(sec.beta1, sec.beta2), eps=sec.eps or 1e-8,
                                         weight_decay=sec.weight_decay)
    else:
        raise ValueError(f"config: optimizer.dense.name = {sec.name!r}: must be sgd, momentum, adagrad or adam")
    params = list(params)
    try:
        return cls(params, fused=True, **kw)
    except (RuntimeError, ValueError):         # no fused kernel for this device or dtype
        return cls(params, **kw)


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
            rows[ids] = t.pull(ids, full=True)
        for name, first, n in t.logical:        # a table-batched table: its feature tables, apart
            arrays[f"tables/{name}"] = rows[first:first + n]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **arrays)


def train(cfg: Config) -> dict | None:
    """Run the job a config describes. Collective over ``MPI.COMM_WORLD``.

    Returns the final summary on every rank (``hpcps train`` prints it on rank 0);
    ``summary["stopped"]`` is True when a stop request ended the job after a checkpoint.
    """
    world = MPI.COMM_WORLD
    summary = None
    if cfg.model.device == "cuda" and not torch.cuda.is_available():      # checked alike on every rank
        raise ValueError("config: model.device = 'cuda' but torch sees no GPU")
    with init(num_ps=cfg.job.num_ps, transport=cfg.job.transport, mode=cfg.job.mode) as ctx:
        W = ctx.num_workers
        # torch's default (every CPU, per rank) oversubscribes a node that runs several ranks
        torch.set_num_threads(cfg.model.threads or max(1, ctx.node_cpus // ctx.node_comm.Get_size()))
        data = make_data(cfg.data, cfg.job.seed, W, max(ctx.worker_rank, 0))
        steps = total_steps(cfg, data)
        sparse_opt = build_sparse_optimizer(cfg.optimizer.sparse, steps)
        c = cfg.checkpoint
        kind, _ = parse_mode(ctx.mode)
        # a worker that reads some shard over RMA has latency to hide; shared-memory gathers do not
        remote = cfg.job.transport == "rma" or bool(world.allreduce(
            int(ctx.is_worker and any(r not in ctx.node_ranks for r in ctx.ps_world_ranks)), op=MPI.MAX))
        # auto: the communication thread only where MPI allows it (HPCPS_MPI_THREADS=multiple)
        threads = remote and MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        pipe = {"prefetch": resolve_switch(cfg.pipeline.prefetch, threads),
                "background_push": resolve_switch(cfg.pipeline.background_push, threads)}
        options = dict(optimizer=sparse_opt, seed=cfg.job.seed, transport=cfg.job.transport,
                       track_dirty=bool(c.dir) and c.full_every > 1, track_versions=pipe["prefetch"] and kind != "async",
                       pull_dtype=cfg.pipeline.pull_dtype, push_dtype=cfg.pipeline.push_dtype)
        specs = table_specs(cfg, data)
        if fused_tables(cfg, specs):
            # one table-batched table, a segment per feature table: a step's pulls, pushes and
            # optimizer apply take one pass instead of one per table (each row starts as before)
            (_, _, dim, scale) = specs[0]
            tables = [EmbeddingTable(ctx, FUSED_TABLE, sum(rows for _, rows, _, _ in specs), dim, init_scale=scale,
                                     segments=[(name, rows) for name, rows, _, _ in specs], **options)]
        else:
            tables = [EmbeddingTable(ctx, name, rows, dim, init_scale=scale, **options)
                      for name, rows, dim, scale in specs]
        stop = StopRequest(c.dir)
        ckpt, resume_from, start = None, None, 0
        if c.dir:
            dir_mode = parse_permissions(c.dir_mode, "checkpoint.dir_mode")
            file_mode = parse_permissions(c.file_mode, "checkpoint.file_mode")
            if world.Get_rank() == 0:
                Path(c.dir).mkdir(mode=dir_mode, parents=True, exist_ok=True)
            ckpt = ckpt_mod.Checkpointer(ctx, tables, c.dir, c.keep, c.compression,
                                         {"config": cfg.to_dict()}, full_every=c.full_every,
                                         dir_mode=dir_mode, file_mode=file_mode)
            ctx._resources.append(ckpt)
        if c.resume != "none" and (c.dir or c.resume != "auto"):
            found = None
            if world.Get_rank() == 0:
                try:
                    found = ckpt_mod.resolve(c.resume, c.dir)
                except ValueError as e:
                    found = e
            found = world.bcast(found, root=0)
            if isinstance(found, ValueError):
                raise found
            resume_from = found
        t_restore = time.perf_counter()
        if resume_from is not None:
            start = ckpt_mod.restore_tables(resume_from, ctx, tables)
            if world.Get_rank() == 0:
                logger.warning("hpcps: resuming from %s (step %d)", resume_from, start)
        ctx.control.set_start(start)                   # a barrier: every PS has its rows
        restore_s = time.perf_counter() - t_restore if resume_from is not None else 0.0
        log, held = None, 0
        if ctx.is_ps:
            ctx.serve()
            held = sum(t.shard().nbytes + sum(v.nbytes for v in t._state.values())
                       + (t._half.nbytes if t.pull_dtype != "float32" else 0)
                       + (t._inbox.nbytes if t._inbox is not None else 0) for t in tables)
        else:
            loader = _loader(cfg, ctx, data, start, steps, tables)
            with loader or contextlib.nullcontext():
                summary, log = _work(cfg, ctx, data, tables, steps, start, resume_from, ckpt, stop, pipe, loader)
            if summary is not None:
                summary["restore_s"] = restore_s
        first_worker = ctx.worker_world_ranks[0]
        is_ps = ctx.is_ps
    # memory: every rank's peak resident set against the table bytes (rows + optimizer state) its
    # shards hold; gathered after the PS ranks left serve()
    mem = world.gather((is_ps, _peak_rss(), held), root=first_worker)
    if summary is not None:
        summary["memory"] = {"ps_peak_rss_mb": [round(r / 1e6, 1) for p, r, _ in mem if p],
                             "ps_table_mb": [round(h / 1e6, 3) for p, _, h in mem if p],
                             "worker_peak_rss_mb": [round(r / 1e6, 1) for p, r, _ in mem if not p]}
    if log is not None:
        log.write({"final": summary})
        log.close()
    return world.bcast(summary, root=first_worker)


def _waits(embs) -> tuple[float, float]:
    return sum(e.pull_wait_s for e in embs), sum(e.push_wait_s for e in embs)


def _pipeline_rates(embs, totals: dict) -> dict:
    """Cache hit rate and the share of prefetched rows pulled again, since the last call (this
    worker's view); adds the counts to ``totals``. Local."""
    out = {}
    counts = [e.cache.take_counts() for e in embs if e.cache is not None]
    pre, again = sum(e.prefetched_rows for e in embs), sum(e.refreshed_rows for e in embs)
    for e in embs:
        e.prefetched_rows = e.refreshed_rows = 0
    for key, v in (("lookups", sum(c[0] for c in counts)), ("hits", sum(c[1] for c in counts)),
                   ("prefetched", pre), ("refreshed", again)):
        totals[key] = totals.get(key, 0) + v
    if counts:
        out["cache_hit_rate"] = sum(c[1] for c in counts) / max(sum(c[0] for c in counts), 1)
    if pre:
        out["prefetch_refreshed"] = again / pre
    return out


def _pipeline_summary(pl, pipe, comm_thread, embs, totals, loader) -> dict:
    _pipeline_rates(embs, totals)                      # counts since the last record
    out = {"prefetch": pipe["prefetch"], "background_push": comm_thread.enabled, "cache_rows": pl.cache_rows,
           "pull_dtype": pl.pull_dtype, "push_dtype": pl.push_dtype, "loader": loader is not None}
    if loader is not None:
        out["loader_wait_s"] = round(loader.wait_s, 6)
    if pl.cache_rows:
        out["cache_hit_rate"] = totals["hits"] / max(totals["lookups"], 1)
        out["cache_staleness"] = pl.cache_staleness
    if totals.get("prefetched"):
        out["prefetch_refreshed"] = totals["refreshed"] / totals["prefetched"]
    if pl.push_dtype != "float32":                     # pushes sent as float32: a PS's inbox was full
        out["push_inbox_full"] = sum(e.table.stats.inbox_full for e in embs)
    return out


def _peak_rss() -> int:
    """This process's peak resident set in bytes (Linux ru_maxrss is in KiB). Local."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _loader(cfg, ctx, data, start: int, steps: int, tables) -> BatchAhead | None:
    """This worker's :class:`BatchAhead` where ``pipeline.loader`` asks for one, else None. ``auto``:
    where each worker and each loader of this node can have a CPU of its own (the PS ranks mostly
    wait); then the worker and its loader are pinned apart (``hpcps.data.loader.placement``). For
    DLRM the loader also checks and indexes each batch's ids (:class:`hpcps.nn.IdPlan`). Local."""
    ps = set(ctx.ps_world_ranks)
    here = sorted(r for r in ctx.node_ranks if r not in ps)
    fits = 2 * len(here) <= ctx.node_cpus
    where = placement(here.index(ctx.rank), len(here)) if fits else None
    if not resolve_switch(cfg.pipeline.loader, where is not None) or steps - start < 2:
        return None
    if not loader_supported():
        logger.warning("hpcps: pipeline.loader = on needs Linux on x86-64; drawing batches in the worker")
        return None
    annex = None
    if cfg.model.kind == "dlrm":
        plan = IdPlan(tables)

        def annex(batch):
            return plan.pack(batch.sparse)
    return BatchAhead(data, start, steps, cpus=where, defer=True, annex=annex)


def _work(cfg, ctx, data, tables, steps, start=0, resume_from=None, ckpt=None, stop=None, pipe=None, loader=None):
    W, comm = ctx.num_workers, ctx.worker_comm
    lead = ctx.worker_rank == 0
    torch.manual_seed(cfg.job.seed)
    device = torch.device(cfg.model.device)
    if device.type == "cuda":
        local = comm.Split_type(MPI.COMM_TYPE_SHARED)
        device = torch.device("cuda", local.Get_rank() % torch.cuda.device_count())
        local.Free()
        torch.cuda.set_device(device)
    pl = cfg.pipeline
    kind, bound = parse_mode(ctx.mode)
    pipe = pipe or {"prefetch": False, "background_push": False}
    comm_thread = CommThread(enabled=pipe["background_push"])
    # cache_rows is per feature table: a table-batched table caches that many rows per segment
    caches = [RowCache(pl.cache_rows * len(t.logical), t.dim, pl.cache_staleness)
              if pl.cache_rows else None for t in tables]
    pushes = PushBatch(comm_thread)     # a step's pushes of every table go out together, after backward
    embs = [ShardedEmbeddingBag(t, mode="sum", grad_scale=1.0 / W, device=device, comm=comm_thread, cache=cache,
                                batch=pushes) for t, cache in zip(tables, caches)]
    # DLRM looks every table up at once (one autograd node and one hook for all of them)
    lookup = ShardedEmbeddingCollection(embs) if cfg.model.kind == "dlrm" else embs
    model = build_model(cfg, lookup, data).to(device)
    dense = DenseSync(model, comm, backend=cfg.model.dense_backend, bucket_mb=cfg.model.bucket_mb)
    opt = dense_optimizer(cfg.optimizer.dense, model.parameters())
    dense_params = [p for g in opt.param_groups for p in g["params"]]
    sched = dense_schedule(cfg.optimizer.dense, steps)
    base_lrs = [g["lr"] for g in opt.param_groups]
    if resume_from is not None:
        ckpt_mod.restore_dense(resume_from, model, opt, ctx.worker_rank)
        for g, lr in zip(opt.param_groups, base_lrs):
            g["lr"] = lr
    c = cfg.checkpoint
    last_ckpt_time, last_ckpt_step, stopped = time.time(), start, False
    delay = float(os.environ.get("HPCPS_STEP_DELAY", "0"))   # seconds per step: demos and fault tests
    log = MetricsLog(cfg.metrics.path if lead else "")
    bar = None
    if lead and cfg.metrics.progress:
        from tqdm import tqdm
        bar = tqdm(total=steps, initial=start, desc="train", unit="step", dynamic_ncols=True)
    B = cfg.data.batch_size
    # per-step time of worker 0 by phase (seconds since the last record): idle = waiting in
    # step_begin for the mode's fence; pull / push = this thread waiting for its pulls / pushes
    # (with the pipeline on, most of that work runs on the communication thread meanwhile)
    timing = dict.fromkeys(("data", "idle", "pull", "forward_backward", "push", "dense_allreduce"), 0.0)
    stale_counts = {}
    t_start = last_t = time.perf_counter()
    last_step, loss_acc, n_acc = start, 0.0, 0
    pulls0 = [(t.stats.pull_seconds, t.stats.push_seconds) for t in tables]
    next_batch, pipe_totals = None, {}
    draw = loader.train_batch if loader is not None else data.train_batch
    reported = {}                       # step -> seconds its report took, when the lookup's hook made it

    def report(step):
        # the step is done for the PS once its pushes are: report it right after them (on the
        # comm thread, if on), so the PS applies it while this worker finishes backward,
        # all-reduces and steps the dense layers
        t = time.perf_counter()
        pushes.flush()                  # inline: the step's pushes happen here
        comm_thread.post(ctx.step_end, step)
        reported[step] = time.perf_counter() - t

    def report_early(step):
        # a collection's hook has every table's gradient of the step while the layers below the
        # embeddings (DLRM's bottom MLP) still run backward: the PS's apply overlaps them
        if step not in reported:
            report(step)

    # Early only where the loader makes the ids' plans: then the worker's work after its pushes
    # (~0.25 ms in the main job at 1 PS + 1 worker) is shorter than the PS's apply (~0.5 ms), which
    # bounds the step. Where the worker's own work is longer (no loader: it draws and plans the
    # next batch there, ~0.85 ms), starting the PS earlier gains nothing, and measured 3-4% slower.
    early = isinstance(lookup, ShardedEmbeddingCollection) and loader is not None and loader.annex is not None
    for step in range(start, steps):
        t0 = time.perf_counter()
        stale = ctx.step_begin(step)
        if loader is not None:
            loader.release()                # the loader draws while this worker computes (not while the PS applies)
        t1 = time.perf_counter()
        batch = next_batch if next_batch is not None else draw(step)
        next_batch = None
        t2 = time.perf_counter()
        waits0 = _waits(embs)
        for e in embs:
            e.step = step
        loss, total = step_loss(model, batch, data.task, B, W, device)
        t_data = t_early = 0.0
        if pipe["prefetch"] and step + 1 < steps:
            # step t+1's rows are read now, while step t's pushes may still land: a row stamped
            # above t - S afterwards is pulled again at t+1 (sync: S = 0), so nothing is missed
            td = time.perf_counter()
            next_batch = draw(step + 1)
            t_data = time.perf_counter() - td
            refresh = None if kind == "async" else step - bound
            if isinstance(lookup, ShardedEmbeddingCollection):
                lookup.prefetch(next_batch.sparse, step + 1, refresh_above=refresh)
            else:
                for e, ids in zip(embs, next_batch.sparse):
                    e.prefetch(ids, step + 1, refresh_above=refresh)
        for p in dense_params:              # opt.zero_grad(set_to_none=True) without its ~50 us of wrappers
            p.grad = None
        if early:
            lookup.after_push = functools.partial(report_early, step)
        loss.backward()
        if early:
            lookup.after_push = None
        t3 = time.perf_counter()
        waits3 = _waits(embs)               # inline pulls happen inside forward/backward
        t_report = reported.pop(step, None)
        if t_report is None:                # no hook reported it (a model without a collection)
            report(step)
            t_report = reported.pop(step)
        else:
            t3 -= t_report                  # in backward, but push time
        t3p = time.perf_counter()
        if next_batch is None and step + 1 < steps:
            # draw the next batch now: it fills time this worker would spend waiting for the other
            # workers' gradients and for the PS's apply of this step (the data depend on neither)
            next_batch = draw(step + 1)
            if isinstance(lookup, ShardedEmbeddingCollection):
                # its ids checked and indexed now (by the loader, if on), not in the next forward
                made = loader.annex_of(step + 1) if loader is not None else None
                lookup.prepare(next_batch.sparse, IdPlan.unpack(made) if made else None)
            t_early = time.perf_counter() - t3p
        dense.synchronize()
        t4 = time.perf_counter()
        if cfg.optimizer.dense.clip_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.dense.clip_norm)
        f = sched.factor(step)
        for g, lr in zip(opt.param_groups, base_lrs):
            g["lr"] = lr * f
        opt.step()
        if delay:
            time.sleep(delay)
        for e in embs:
            e.wait_pushes()
        pull_s, push_s = (b - a for a, b in zip(waits0, _waits(embs)))
        in_fb = sum(b - a for a, b in zip(waits0, waits3))
        timing["idle"] += t1 - t0
        timing["data"] += t2 - t1 + t_data + t_early
        timing["pull"] += pull_s
        timing["push"] += push_s + t_report
        timing["forward_backward"] += max(t3 - t2 - t_data - in_fb, 0.0)
        timing["dense_allreduce"] += t4 - t3p - t_early
        stale_counts[stale] = stale_counts.get(stale, 0) + 1
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
                   "bytes_per_ps": [int(sum(t.stats.bytes_per_ps[p] for t in tables))
                                    for p in range(ctx.num_ps)],
                   "staleness_counts": {str(k): v for k, v in sorted(stale_counts.items())},
                   **_pipeline_rates(embs, pipe_totals),
                   "time_breakdown_s": {k: round(v, 6) for k, v in timing.items()}}
            timing = dict.fromkeys(timing, 0.0)
            stale_counts = {}
            if bar is not None:
                bar.set_postfix(loss=f"{rec['loss']:.4f}", samples_s=f"{rate:,.0f}")
            pulls0 = [(t.stats.pull_seconds, t.stats.push_seconds) for t in tables]
            last_step, last_t, loss_acc, n_acc = step + 1, now, 0.0, 0
            if cfg.job.eval_every and (step + 1) % cfg.job.eval_every == 0 and step + 1 < steps:
                ctx.fence(step + 1)
                rec["eval"] = evaluate(model, data, comm, device)
            log.write(rec)
        if ckpt is not None:
            ckpt.poll_commit()
            due = bool(c.every_steps) and (step + 1) % c.every_steps == 0
            flags = [int(stop.requested()), int(lead and c.every_seconds > 0
                                                and time.time() - last_ckpt_time >= c.every_seconds)]
            flags = comm.allreduce(flags if step + 1 < steps else [0, 0], op=MPI.MAX)
            if (due or any(flags)) and step + 1 < steps:
                ckpt.checkpoint(step + 1, model, opt)
                last_ckpt_time, last_ckpt_step = time.time(), step + 1
                log.write({"checkpoint": step + 1, "stall_s": ckpt.stall_seconds[-1]})
            if flags[0]:
                stopped = True
                ckpt.wait_commit()
                break
    for e in embs:                                     # a prefetch no step will use must still end
        e.discard_prefetch()
    comm_thread.close()
    if bar is not None:
        bar.close()
    if ckpt is not None and not stopped:
        if last_ckpt_step != steps and steps > start:       # a finished job takes no new checkpoint
            ckpt.checkpoint(steps, model, opt)
        ckpt.wait_commit()
    elapsed = time.perf_counter() - t_start
    done_steps = step + 1 if steps > start else start
    ctx.fence(done_steps)                              # every staged gradient is applied
    result = evaluate(model, data, comm, device)
    stale = ctx.control.staleness
    all_stale = comm.gather(stale, root=0)
    if cfg.job.export and lead:
        export_weights(cfg.job.export, model, tables)
    comm.Barrier()
    dense.close()
    if not lead:
        return None, None
    flat = [s for part in all_stale for s in part]
    ran = done_steps - start
    final = {**result, "steps": done_steps, "start_step": start, "stopped": stopped,
             "checkpoints": ckpt.committed if ckpt is not None else [],
             "checkpoint_timings": ckpt.timings if ckpt is not None else [],
             "checkpoint_stall_s": max(ckpt.stall_seconds) if ckpt is not None and ckpt.stall_seconds else 0.0,
             "samples_per_s": ran * B / max(elapsed, 1e-9),
             "elapsed_s": elapsed, "num_ps": ctx.num_ps, "num_workers": W, "mode": ctx.mode,
             "wait_policy": ctx.wait_policy, "node_cpus": ctx.node_cpus, "malloc": _malloc.mode(),
             "mpi_threads": _THREAD_LEVELS.get(MPI.Query_thread(), str(MPI.Query_thread())),
             "max_staleness": max(flat) if flat else 0, "data": data.stats,
             "pipeline": _pipeline_summary(pl, pipe, comm_thread, embs, pipe_totals, loader)}
    return final, log
