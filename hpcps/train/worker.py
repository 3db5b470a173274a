"""The worker's training loop.

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
import math
import time

import torch
from mpi4py import MPI

from .. import checkpoint as ckpt_mod
from ..checkpoint.store import step_dir
from ..config import AUTO_EPOCHS
from ..core import counts, malloc
from ..core.settings import parse_mode
from ..dense import DenseSync
from ..core.metrics import MetricsLog
from ..models import get_kind
from ..models.linear import linear_params
from ..nn import IdPlan, ShardedEmbeddingBag, ShardedEmbeddingCollection
from ..nn.dynamic import DynamicEmbeddingCollection
from ..nn.parts import ShardedEmbeddingParts
from ..sparse.pipeline import CommThread, PushBatch, RowCache
from .best import Evaluations
from .build import build_model, dense_optimizer, dense_schedule, make_lookups
from .evaluation import evaluate, export_weights, step_loss
from .failover import note_step
from .recovery import CheckpointTrigger
from .telemetry import EpochBar, Telemetry, pipeline_summary, progress_bar, thread_level_name, waits

__all__ = ["Worker"]

logger = logging.getLogger(__name__)

COLLECTIONS = (ShardedEmbeddingCollection, ShardedEmbeddingParts)    # lookups of every table at once


def _device(cfg, comm: MPI.Comm) -> torch.device:
    device = torch.device(cfg.model.device)
    if device.type == "cuda":
        local = comm.Split_type(MPI.COMM_TYPE_SHARED)
        device = torch.device("cuda", local.Get_rank() % torch.cuda.device_count())
        local.Free()
        torch.cuda.set_device(device)
    return device


class Worker:
    """One worker's model, optimizers and loop. Made and run collectively over the worker communicator."""

    def __init__(self, cfg, ctx, data, tables, steps: int, start: int = 0, resume_from=None, ckpt=None,
                 stop=None, pipe=None, loader=None, monitor=None):
        self.cfg, self.ctx, self.data, self.tables = cfg, ctx, data, tables
        self.steps, self.start, self.loader = steps, start, loader
        self.W, self.comm = ctx.num_workers, ctx.worker_comm
        self.lead = ctx.worker_rank == 0
        torch.manual_seed(cfg.job.seed)
        self.device = _device(cfg, self.comm)
        pl = cfg.pipeline
        self.kind, self.bound = parse_mode(ctx.mode)
        self.pipe = pipe or {"prefetch": False, "background_push": False}
        self.comm_thread = CommThread(enabled=self.pipe["background_push"], say=ctx.worker_rank == 0)
        # cache_rows is per feature table: a table-batched table caches that many rows per segment
        caches = [RowCache(pl.cache_rows * len(t.logical), t.dim, pl.cache_staleness)
                  if pl.cache_rows else None for t in tables]
        self.pushes = PushBatch(self.comm_thread)   # a step's pushes of every table go out together
        dynamic = cfg.model.dynamic_tables           # one dynamic table: its own one push a step, no cache
        self.embs = [ShardedEmbeddingBag(t, mode="sum", grad_scale=1.0 / self.W, device=self.device,
                                         comm=self.comm_thread, cache=None if dynamic else cache,
                                         batch=None if dynamic else self.pushes)
                     for t, cache in zip(tables, caches)]
        self.lookup, lookups = make_lookups(cfg, data, tables, self.embs, dynamic)
        self.model = build_model(cfg, lookups, data).to(self.device)
        self.dense = DenseSync(self.model, self.comm, backend=cfg.model.dense_backend, bucket_mb=cfg.model.bucket_mb,
                               nccl_host=cfg.model.nccl_host or None)
        self.opt = dense_optimizer(cfg.optimizer.dense, self.model.parameters(), linear_params(self.model))
        self.dense_params = [p for g in self.opt.param_groups for p in g["params"]]
        self.sched = dense_schedule(cfg.optimizer.dense, steps)
        self.base_lrs = [g["lr"] for g in self.opt.param_groups]
        if resume_from is not None:
            ckpt_mod.restore_dense(resume_from, self.model, self.opt, ctx.worker_rank)
            for g, lr in zip(self.opt.param_groups, self.base_lrs):
                g["lr"] = lr
        self.trigger = CheckpointTrigger(cfg, ckpt, stop, self.comm, self.lead, start, ctx.control)
        manifest = ckpt_mod.read_manifest(resume_from) if resume_from is not None else None
        self.evals = Evaluations(cfg, data.task, self.comm, self.lead, ckpt, manifest)
        # the reading plan of a streamed epoch (hpcps.data.plan): a restart continues where it stopped
        plan = getattr(data, "state", lambda step: None)
        self.trigger.meta = lambda step: {"evaluations": self.evals.state(), "data_plan": plan(step)}
        epoch = data.steps_per_epoch if cfg.job.eval_each_epoch or cfg.job.epochs == AUTO_EPOCHS else None
        self.eval_every = [k for k in (cfg.job.eval_every, epoch) if k]
        self.eval_post = {}                                # worker 0: the last evaluation, on the bar
        self.log = MetricsLog(cfg.metrics.path if self.lead else "", cfg.metrics.tensorboard if self.lead else "")
        self.bar = None
        if self.lead and cfg.metrics.progress:        # a tqdm bar on a terminal, plain lines in a log
            self.bar = (EpochBar(data.steps_per_epoch, cfg.job.max_epochs, start) if cfg.job.epochs == AUTO_EPOCHS
                        else progress_bar(steps, start))
        self.telemetry = Telemetry(tables, self.embs, ctx.num_ps, cfg.data.batch_size, start)
        self.draw = loader.train_batch if loader is not None else data.train_batch
        self.monitor = monitor
        if monitor is not None:
            monitor.figures = lambda: self.telemetry.monitor_figures(self._done, ctx.control)
            if self.lead:
                monitor.attach(self.log, self._on_alert, ckpt)
        self._done = start
        # data.trace (a testing aid): the first dense feature of every batch this worker trains
        self.trace = open(f"{cfg.data.trace}.{ctx.worker_rank}", "a") if cfg.data.trace else None
        self.next_batch = None
        self.restored = None        # the step whose best evaluation's model the run ends with (job.restore_best)
        self.reported = {}          # step -> seconds its report took, when the lookup's hook made it
        # Early only where the loader makes the ids' plans: then the worker's work after its pushes
        # (~0.25 ms in the main job at 1 PS + 1 worker) is shorter than the PS's apply (~0.5 ms), which
        # bounds the step. Where the worker's own work is longer (no loader: it draws and plans the
        # next batch there, ~0.85 ms), starting the PS earlier gains nothing, and measured 3-4% slower.
        self.early = (isinstance(self.lookup, COLLECTIONS) and loader is not None
                      and loader.annex is not None)

    # ------------------------------------------------------------ reporting a step done
    def _report(self, step: int) -> None:
        # the step is done for the PS once its pushes are: report it right after them (on the comm
        # thread, if on), so the PS applies it while this worker finishes backward, all-reduces and
        # steps the dense layers
        t = time.perf_counter()
        self.pushes.flush()             # inline: the step's pushes happen here
        self.comm_thread.post(self.ctx.step_end, step)
        self.reported[step] = time.perf_counter() - t

    def _report_early(self, step: int) -> None:
        # a collection's hook has every table's gradient of the step while the layers below the
        # embeddings (DLRM's bottom MLP) still run backward: the PS's apply overlaps them
        if step not in self.reported:
            self._report(step)

    # ------------------------------------------------------------ one step
    def _prefetch_next(self, step: int) -> float:
        """Step t+1's rows are read now, while step t's pushes may still land: a row stamped above
        t - S afterwards is pulled again at t+1 (sync: S = 0), so nothing is missed. Returns the
        seconds spent drawing the batch."""
        td = time.perf_counter()
        self.next_batch = self.draw(step + 1)
        t_data = time.perf_counter() - td
        refresh = None if self.kind == "async" else step - self.bound
        if isinstance(self.lookup, COLLECTIONS):
            self.lookup.prefetch(self.next_batch.sparse, step + 1, refresh_above=refresh)
        else:
            for e, ids in zip(self.embs, self.next_batch.sparse):
                e.prefetch(ids, step + 1, refresh_above=refresh)
        return t_data

    def _draw_next(self, step: int) -> None:
        """Draw the next batch now: it fills time this worker would spend waiting for the other
        workers' gradients and for the PS's apply of this step (the data depend on neither)."""
        self.next_batch = self.draw(step + 1)
        if isinstance(self.lookup, COLLECTIONS):
            # its ids checked and indexed now (by the loader, if on), not in the next forward
            made = self.loader.annex_of(step + 1) if self.loader is not None else None
            self.lookup.prepare(self.next_batch.sparse, IdPlan.unpack(made) if made else None)
        elif isinstance(self.lookup, DynamicEmbeddingCollection):
            self.lookup.prepare(self.next_batch.sparse)          # its distinct keys found now

    def _dense_step(self, step: int) -> None:
        cfg = self.cfg
        if cfg.optimizer.dense.clip_norm:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optimizer.dense.clip_norm)
        f = self.sched.factor(step)
        for g, lr in zip(self.opt.param_groups, self.base_lrs):
            g["lr"] = lr * f
        self.opt.step()

    def step(self, step: int) -> None:
        """Train step ``step``: pulls, forward, backward, pushes, dense all-reduce and optimizer step.
        Collective over the worker communicator (the dense all-reduce)."""
        embs, steps = self.embs, self.steps
        t0 = time.perf_counter()
        stale = self.ctx.step_begin(step)
        if self.loader is not None:
            self.loader.release()           # the loader draws while this worker computes (not while the PS applies)
        t1 = time.perf_counter()
        batch = self.next_batch if self.next_batch is not None else self.draw(step)
        self.next_batch = None
        if self.trace is not None:
            self.trace.write(f"{step} " + " ".join(f"{x:.9g}" for x in batch.dense[:, 0]) + "\n")
            self.trace.flush()
        t2 = time.perf_counter()
        waits0 = waits(embs)
        for e in embs:
            e.step = step
        loss, total = step_loss(self.model, batch, self.data.task, self.cfg.data.batch_size, self.W, self.device,
                                self.cfg.model.embedding_l2)
        if not math.isfinite(total):
            raise ValueError(f"step {step}: the loss is {total} (not finite) on worker {self.ctx.worker_rank}: the "
                             f"model diverged (lower optimizer.sparse.lr / optimizer.dense.lr, or look for huge values "
                             f"in the input's dense columns)")
        t_data = t_early = 0.0
        if self.pipe["prefetch"] and step + 1 < steps:
            t_data = self._prefetch_next(step)
        for p in self.dense_params:         # opt.zero_grad(set_to_none=True) without its ~50 us of wrappers
            p.grad = None
        if self.early:
            self.lookup.after_push = functools.partial(self._report_early, step)
        loss.backward()
        if self.early:
            self.lookup.after_push = None
        t3 = time.perf_counter()
        waits3 = waits(embs)                # inline pulls happen inside forward/backward
        t_report = self.reported.pop(step, None)
        if t_report is None:                # no hook reported it (a model without a collection)
            self._report(step)
            t_report = self.reported.pop(step)
        else:
            t3 -= t_report                  # in backward, but push time
        t3p = time.perf_counter()
        if self.next_batch is None and step + 1 < steps:
            self._draw_next(step)
            t_early = time.perf_counter() - t3p
        self.dense.synchronize()
        t4 = time.perf_counter()
        self._dense_step(step)
        if self.cfg.job.step_delay:
            time.sleep(self.cfg.job.step_delay)
        for e in embs:
            e.wait_pushes()
        pull_s, push_s = (b - a for a, b in zip(waits0, waits(embs)))
        in_fb = sum(b - a for a, b in zip(waits0, waits3))
        self.telemetry.add({"idle": t1 - t0, "data": t2 - t1 + t_data + t_early, "pull": pull_s,
                            "push": push_s + t_report,
                            "forward_backward": max(t3 - t2 - t_data - in_fb, 0.0),
                            "dense_allreduce": t4 - t3p - t_early}, stale, total, len(batch))
        self._stale = stale

    def _after_step(self, step: int) -> bool:
        """Progress, metrics and evaluations (``job.eval_every``, each epoch's end), the best
        checkpoint, early stopping, checkpoints; True when training ends early (a stop request
        or early stopping). Collective over the worker communicator."""
        cfg, steps, done = self.cfg, self.steps, step + 1
        if self.bar is not None:
            self.bar.update(1)
        evaluate_now = done < steps and any(done % k == 0 for k in self.eval_every)
        if not (done % cfg.job.log_every == 0 or done == steps or evaluate_now):
            return self.trigger.after_step(step, steps, self.model, self.opt, self.log)
        rec = self.telemetry.record(done, self._stale)
        post = {"loss": f"{rec['loss']:.4f}", "samples_s": f"{rec['samples_per_s']:,.0f}"}
        improved = early = False
        if evaluate_now:
            self.ctx.fence(done)
            rec["eval"] = evaluate(self.model, self.data, self.comm, self.device)
            improved, early = self.evals.observe(done, rec["eval"])
            if self.lead:
                self.eval_post = {f"eval_{k}": f"{v:.4f}" for k, v in rec["eval"].items()
                                  if k in ("auc", "logloss", "rmse", "mae")}
                logger.info("hpcps: evaluation after step %d: %s%s", done, ", ".join(
                    f"{k[5:]} {v}" for k, v in self.eval_post.items()), " (the best so far)" if improved else "")
        if self.bar is not None:
            self.bar.set_postfix({**post, **self.eval_post, **(self.monitor.post if self.monitor else {})},
                                 refresh=False)
        self.log.write(rec)
        if improved and self.evals.keep:                  # the best so far: kept as a checkpoint
            self.trigger.save(done, self.model, self.opt, self.log)
            self.trigger.ckpt.wait_commit()
            self.evals.mark(done)
        if early:
            return True
        return self.trigger.after_step(step, steps, self.model, self.opt, self.log, taken=improved and self.evals.keep)

    # ------------------------------------------------------------ the run
    def run(self):
        """Train steps ``start..steps-1``; returns ``(final summary, metrics log)`` on worker 0 and
        ``(None, None)`` elsewhere. Collective over the worker communicator."""
        steps, start = self.steps, self.start
        t_start = time.perf_counter()
        step = start
        # this process's log lines above the bar, not on its line
        from tqdm.contrib.logging import logging_redirect_tqdm
        on_bar = self.bar is not None and getattr(self.bar, "disp", None) is not None   # tqdm, not LineProgress
        counts.mark("first_step")
        with logging_redirect_tqdm() if on_bar else contextlib.nullcontext():
            for step in range(start, steps):
                self.step(step)
                note_step(step)
                self._done = step + 1
                if self.monitor is not None:
                    self.monitor.tick(step + 1)
                if self._after_step(step):
                    break
        counts.mark("last_step")
        if self.monitor is not None:
            self.monitor.finish()
        for e in self.embs:                                # a prefetch no step will use must still end
            e.discard_prefetch()
        self.comm_thread.close()
        if self.bar is not None:
            self.bar.close()
        done_steps = step + 1 if steps > start else start
        elapsed = time.perf_counter() - t_start
        self.ctx.fence(done_steps)                         # every staged gradient is applied
        result = evaluate(self.model, self.data, self.comm, self.device)
        improved, _ = self.evals.observe(done_steps, result, final=True)
        self.restored = self._restore_best(done_steps)
        if self.restored is not None:                      # the final line tells the model it ends with
            result = evaluate(self.model, self.data, self.comm, self.device)
        # the final checkpoint: the model the run ends with (the best evaluation's, if restored)
        self.trigger.finish(done_steps if self.evals.stopped_early else steps, start, self.model, self.opt)
        ckpt = self.trigger.ckpt
        if improved and self.evals.keep and ckpt is not None and done_steps in ckpt.committed:
            self.evals.mark(done_steps)
        self.trigger.release()
        all_stale = self.comm.gather(self.ctx.control.staleness, root=0)
        # a dynamic table's size and counters (worker 0 asks the PS ranks, which still serve)
        self.table_stats = self.tables[0].stats() if self.cfg.model.dynamic_tables and self.lead else None
        exported = {}
        if self.cfg.job.export and self.lead:
            if self.cfg.job.export_best:
                name = self.evals.export_best(self.cfg.job.export)
                logger.info("hpcps: exported %s (the best %s) to %s", name, self.evals.metric, self.cfg.job.export)
                exported = {"path": self.cfg.job.export, "step": int(name.split("-")[1]), "best": True}
            else:
                export_weights(self.cfg.job.export, self.model, self.tables)
                exported = {"path": self.cfg.job.export, "step": done_steps, "best": False}
        self.comm.Barrier()
        self.dense.close()
        if not self.lead:
            return None, None
        return {**self._summary(result, done_steps, elapsed, all_stale), "exported": exported}, self.log

    def _restore_best(self, done_steps: int) -> int | None:
        """At the end of a run (not a stopped one) whose best evaluation came before its last step
        (``job.restore_best``): every PS loads that evaluation's checkpoint and every worker its
        dense part, so what the run leaves (final line, export, final checkpoint) is the best model.
        Returns the step restored, or None. Collective over the worker communicator."""
        best, ckpt = self.evals.best, self.trigger.ckpt
        if not self.cfg.job.restore_best or best is None or best["step"] == done_steps or self.trigger.stopped:
            return None
        if not self.evals.keep or self.cfg.model.dynamic_tables:
            if self.lead:
                why = ("model.dynamic_tables" if self.cfg.model.dynamic_tables
                       else "no checkpoint.dir and checkpoint.keep_best to keep it in")
                logger.info("hpcps: the best evaluation was step %d, the final model is step %d's (%s)",
                            best["step"], done_steps, why)
            return None
        step = best["step"]
        path = step_dir(ckpt.root, step)
        if not (path / "dense.h5").exists():    # alike on every worker (a shared checkpoint.dir)
            if self.lead:
                logger.warning("hpcps: the best evaluation's checkpoint %s is gone: the final model is step %d's",
                               path, done_steps)
            return None
        ckpt.load(step)
        ckpt_mod.restore_dense(path, self.model, self.opt, self.ctx.worker_rank)
        for e in self.embs:                      # rows read before are the last step's
            if e.cache is not None:
                e.cache.clear()
        meta = self.trigger.meta                 # the final checkpoint says whose model it holds
        self.trigger.meta = lambda at: {**meta(at), "restored_best": step}
        if self.lead:
            logger.info("hpcps: restored the best evaluation, step %d (%s %.5g); the final model is that one",
                        step, self.evals.metric, best["value"])
        return step

    def _on_alert(self, alert: dict) -> None:
        # monitor.on_alert = checkpoint_and_stop: the workers agree on it as on a stop request
        if self.trigger.alert is None:
            self.trigger.alert = alert

    def _summary(self, result: dict, done_steps: int, elapsed: float, all_stale) -> dict:
        ctx = self.ctx
        flat = [s for part in all_stale for s in part]
        ran = done_steps - self.start
        stop = {"stopped": self.trigger.stopped}           # and, after a stop, whether it checkpointed first
        if self.trigger.stopped:
            stop["saved"] = self.trigger.ckpt is not None
            if self.trigger.alert is not None:
                stop["stopped_by_alert"] = self.trigger.alert["rule"]
            if self.trigger.rebalance_to is not None:       # hpcps.train.failover goes on with more PS
                stop["rebalance"] = self.trigger.rebalance_to
        return {**result, "steps": done_steps, "start_step": self.start, **stop,
                **self.trigger.summary(),
                "samples_per_s": ran * self.cfg.data.batch_size / max(elapsed, 1e-9),
                "elapsed_s": elapsed, "num_ps": ctx.num_ps, "num_workers": self.W, "mode": ctx.mode,
                "wait_policy": ctx.wait_policy, "node_cpus": ctx.node_cpus, "malloc": malloc.mode(),
                "mpi_threads": thread_level_name(), "sharding": self.tables[0].sharding.name,
                "max_staleness": max(flat) if flat else 0, "data": self.data.stats,
                "best": self.evals.summary(), "evaluations": self.evals.count, "restored_best": self.restored,
                **({"dynamic_table": self.table_stats} if self.table_stats is not None else {}),
                "early_stopped": self.evals.stopped_early,
                **({"alerts": self.monitor.raised} if self.monitor is not None else {}),
                "pipeline": pipeline_summary(self.cfg.pipeline, self.pipe, self.comm_thread, self.embs,
                                             self.telemetry.totals, self.loader)}
