"""``train(cfg)``: the job behind ``hpcps train``.

Every rank builds the data source (for table sizes) and the tables; the job
resumes from a checkpoint if one is asked for; PS ranks then serve, workers run
the loop (:class:`hpcps.train.worker.Worker`).
"""

import contextlib
import logging
import time

from mpi4py import MPI

from .. import checkpoint as ckpt_mod
from ..config import Config, deterministic, resolve_switch
from ..runtime.context import init
from ..core import counts
from ..core.layout import check_standby
from ..data import make_data
from ..data.loader import BatchAhead, placement
from ..data.loader import fits as loader_fits
from ..data.loader import supported as loader_supported
from ..models import get_kind
from ..monitor.monitor import Monitor
from ..runtime.stopping import StopRequest
from .best import stopped_early
from .tables import check_model_kind, make_tables, shard_bytes, pipeline_switches, resolve_auto_epochs, resolve_local_full_every, total_steps
from .layout import backend_name, gather_layout, layout_line
from .recovery import load_level, open_checkpointer, record_start
from .telemetry import peak_rss
from . import failover

__all__ = ["train"]

logger = logging.getLogger(__name__)


def train(cfg: Config) -> dict | None:
    """Run the job a config describes. Collective over ``MPI.COMM_WORLD``.

    Returns the final summary on every rank (``hpcps train`` prints it where
    :func:`hpcps.train.failover.prints_summary`); ``summary["stopped"]`` is True when a stop request
    ended the job; then ``summary["saved"]`` says whether it took a checkpoint first (absent after a
    run that was not stopped). Launched under ULFM, or with standbys, the job runs through
    :func:`hpcps.train.failover.run` (live failover; rebalancing onto standbys).
    """
    if cfg.job.standby:                              # alike on every rank, before any communication
        check_standby(cfg.job.standby, cfg.job.num_ps, MPI.COMM_WORLD.Get_size())
    if failover.live(cfg):
        return failover.run(cfg, _train)
    return _train(cfg, MPI.COMM_WORLD)


def _train(cfg: Config, world: MPI.Comm) -> dict | None:
    """:func:`train` over ``world``. Collective over ``world``."""
    summary = None
    check_model_kind(cfg)                                                 # alike on every rank
    # torch on every rank, before any collective: a PS that imported it at its first stateful table
    # did so while the workers spun in a barrier (the suite's train tests 10% slower on 2 cores)
    import torch
    if cfg.model.device == "cuda" and not torch.cuda.is_available():      # checked alike on every rank
        raise ValueError("config: model.device = 'cuda' but torch sees no GPU")
    j = cfg.job
    workers = world.Get_size() - j.num_ps            # checked alike on every rank, before any communication
    if 0 < workers and cfg.data.batch_size < workers:
        raise ValueError(f"config: data.batch_size = {cfg.data.batch_size}: smaller than the {workers} workers "
                         f"(each worker takes a slice of the global batch): use at least {workers}")
    with init(num_ps=j.num_ps, comm=world, transport=j.transport, mode=j.mode, wait=j.wait, rma_read=j.rma_read,
              world_size=j.world_size or None, progress_timeout=j.progress_timeout,
              ps_layout=j.ps_layout, deterministic=deterministic(j)) as ctx:
        # torch's default (every CPU, per rank) oversubscribes a node that runs several ranks: a PS
        # applies on one thread (more, spun idle: across pretend hosts sharing CPUs, a PS's adds
        # took 3x as long)
        torch.set_num_threads(1 if ctx.is_ps else
                              cfg.model.threads or max(1, ctx.node_cpus // ctx.node_comm.Get_size()))
        if world.Get_rank() == 0 and cfg.data.format != "synthetic-ctr":     # a large input takes a while
            logger.info("hpcps: reading %s (counting lines, then parsing)", cfg.data.path)
        data = make_data(cfg.data, j.seed, ctx.num_workers, max(ctx.worker_rank, 0), world, not ctx.is_ps,
                         raw_keys=cfg.model.dynamic_tables)
        steps = total_steps(cfg, data)
        cfg = resolve_local_full_every(resolve_auto_epochs(cfg, data.task), data, steps, ctx.num_ps)
        pipe = pipeline_switches(cfg, ctx)
        restorable = bool(cfg.checkpoint.dir) and cfg.checkpoint.resume != "none"
        tables = make_tables(cfg, ctx, data, steps, pipe, fill=not restorable)   # a restore writes every row
        layout = gather_layout(ctx, tables)            # on the first worker
        monitor = None
        if cfg.metrics.every > 0:                      # collective: the board's window
            monitor = Monitor(cfg, ctx, ctx.num_ps * shard_bytes(cfg, data, steps, ctx.num_ps))
        stop = StopRequest(cfg.checkpoint.dir)
        if ctx.is_ps:                                  # a signal to a PS alone: the workers see it
            ctx.add_service_hook(lambda: stop.flag and ctx.control.note_stop())
        ckpt = open_checkpointer(cfg, ctx, tables, getattr(data, "lay", None), getattr(data, "ids", None))
        record_start(cfg, world)
        t_restore = time.perf_counter()
        resume_from, level, start = load_level(cfg, ctx, tables)
        for t in tables:                               # PS: rows no checkpoint wrote (a fresh start)
            getattr(t, "fill_initial", lambda: None)()
        if resume_from is not None:
            if ckpt is not None:
                ckpt.resumed_step = start
            if world.Get_rank() == 0:
                logger.info("hpcps: resuming from %s (step %d), the %s level", resume_from, start,
                               "node-local" if level == "local" else "filesystem")
            manifest = ckpt_mod.read_manifest(resume_from)
            if hasattr(data, "resume"):                # a streamed epoch goes on where it stopped
                data.resume(manifest.get("data_plan"), start)
            if stopped_early(manifest):   # that run is over: evaluate only
                if world.Get_rank() == 0:
                    logger.info("hpcps: that run stopped early at step %d (job.early_stop_patience): "
                                   "nothing left to train", start)
                steps = start                          # the summary's steps: where it stopped
        ctx.control.set_start(start)                   # a barrier: every PS has its rows
        failover.note_start(start)
        restore_s = time.perf_counter() - t_restore if resume_from is not None else 0.0
        log, held = None, 0
        if ctx.is_ps:
            ctx.serve()
            held = sum(t.held_bytes() for t in tables)
            counts.note("rows_applied", ctx.rows_applied)
        else:
            from .worker import Worker                 # here: importing the driver costs no torch
            loader = _loader(cfg, ctx, data, start, steps, tables)
            with loader or contextlib.nullcontext():
                worker = Worker(cfg, ctx, data, tables, steps, start, resume_from, ckpt, stop, pipe, loader, monitor)
                if layout is not None:
                    layout["dense"] = backend_name(worker.dense)
                    layout["failover"] = failover.describe()
                    logger.info("hpcps: layout: %s", layout_line(layout))
                summary, log = worker.run()
            if summary is not None:
                summary["restore_s"] = restore_s
                summary["restored_from"] = level
                summary["layout"] = layout
                summary["run"] = log.run                # the metrics records' run id
        first_worker = ctx.worker_world_ranks[0]
        is_ps = ctx.is_ps
    # memory: every rank's peak resident set against the table bytes (rows + optimizer state) its
    # shards hold; gathered after the PS ranks left serve()
    mem = world.gather((is_ps, peak_rss(), held, counts.report()), root=first_worker)
    if summary is not None:
        summary["memory"] = {"ps_peak_rss_mb": [round(r / 1e6, 1) for p, r, _, _ in mem if p],
                             "ps_table_mb": [round(h / 1e6, 3) for p, _, h, _ in mem if p],
                             "worker_peak_rss_mb": [round(r / 1e6, 1) for p, r, _, _ in mem if not p]}
        if counts.ENABLED:                  # HPCPS_COUNT_MPI=1: each world rank's (scripts/bench_scale.py)
            summary["counts"] = [dict(c, ps=p) for p, _, _, c in mem]
    if log is not None:
        log.write({"final": summary})
        log.close()
    return world.bcast(summary, root=first_worker)


def _loader(cfg, ctx, data, start: int, steps: int, tables) -> BatchAhead | None:
    """This worker's :class:`BatchAhead` where ``pipeline.loader`` asks for one, else None. ``auto``:
    where each worker and each loader of this node can have a CPU of its own (the PS ranks mostly
    wait); then the worker and its loader are pinned apart (``hpcps.data.loader.placement``). For
    a kind of one part (DLRM, LR) the loader also checks and indexes each batch's ids (:class:`hpcps.nn.IdPlan`). Local."""
    ps = set(ctx.ps_world_ranks)
    here = sorted(r for r in ctx.node_ranks if r not in ps)
    where = placement(here.index(ctx.rank), len(here)) if loader_fits(len(here), ctx.node_cpus) else None
    if not resolve_switch(cfg.pipeline.loader, where is not None) or steps - start < 2:
        return None
    if not loader_supported():
        logger.warning("hpcps: pipeline.loader = on needs Linux on x86-64; drawing batches in the worker")
        return None
    annex = None
    # one part's collection of every table (a dynamic table's keys are not rows; several parts plan their own)
    if len(get_kind(cfg.model.kind).parts) == 1 and not cfg.model.dynamic_tables:
        from ..nn import IdPlan
        plan = IdPlan(tables)

        def annex(batch):
            return plan.pack(batch.sparse)
    return BatchAhead(data, start, steps, cpus=where, defer=True, annex=annex)
