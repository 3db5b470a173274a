"""What makes a setting valid, read from the settings alone (no MPI, no files but the ones named).
Local, pure."""

import math
from pathlib import Path

from ..core.ids import INITS
from ..core.inputs import expand_inputs
from ..core.layout import PS_LAYOUTS
from ..core.optimizers import LRSchedule, make_optimizer
from ..core.settings import RMA_READS, ROW_DTYPES, SHARDINGS, THREAD_LEVELS, TRANSPORTS, WAIT_POLICIES, parse_mode
from .schema import AUTO_EPOCHS, FORMATS, MODELS, CheckpointConfig, Config, SparseOptimizerSection

# the metric that decides the best checkpoint: (task, higher is better)
BEST_METRICS = {"auc": ("ctr", True), "logloss": ("ctr", False), "rmse": ("ratings", False), "mae": ("ratings", False)}

__all__ = ["BEST_METRICS", "SWITCHES", "resolve_switch", "parse_permissions", "build_sparse_optimizer", "validate"]


SWITCHES = {"auto": "auto", "on": "on", "true": "on", "yes": "on", "1": "on",
            "off": "off", "false": "off", "no": "off", "0": "off"}


def resolve_switch(value: str, auto: bool) -> bool:
    """An ``auto | on | off`` setting (validated) as a bool, ``auto`` meaning ``auto``. Local."""
    v = SWITCHES[str(value).lower()]
    return auto if v == "auto" else v == "on"


def deterministic(job) -> bool:
    """``job.deterministic`` (of a config's ``[job]``) as a bool: ``auto`` is on in sync mode. Local."""
    return resolve_switch(job.deterministic, job.mode == "sync")


def parse_permissions(text, key: str) -> int:
    """An octal permission string ("0700", "750", "0o640") as an int; ``ValueError`` naming ``key``. Local."""
    try:
        mode = int(str(text).lower().removeprefix("0o"), 8)
    except ValueError:
        mode = -1
    if not 0 <= mode <= 0o777:
        raise ValueError(f"config: {key} = {text!r}: must be an octal permission like 0700")
    return mode


def _check(ok, key, value, need):
    if not ok:
        raise ValueError(f"config: {key} = {value!r}: {need}")


def build_sparse_optimizer(sec: SparseOptimizerSection, total_steps: int):
    """The ``hpcps.optim`` optimizer a config section describes. Local."""
    schedule = LRSchedule(kind=sec.schedule, warmup_steps=sec.warmup_steps, step_size=sec.step_size,
                          gamma=sec.gamma, total_steps=max(total_steps, 1), min_factor=sec.min_factor)
    kw = {"lr": sec.lr, "schedule": schedule, "clip_norm": sec.clip_norm}
    name = sec.name.lower()
    if name in ("sgd", "momentum"):
        kw.update(momentum=sec.momentum, weight_decay=sec.weight_decay)
    elif name in ("adagrad", "rowwise_adagrad"):
        if sec.eps:
            kw["eps"] = sec.eps
    elif name == "adam":
        kw["betas"] = (sec.beta1, sec.beta2)
        if sec.eps:
            kw["eps"] = sec.eps
    elif name == "ftrl":
        kw.update(l1=sec.l1, l2=sec.l2, beta=sec.ftrl_beta)
    if name != "ftrl" and (sec.l1 or sec.l2 or sec.ftrl_beta != 1.0):
        raise ValueError(f"l1, l2 and ftrl_beta are FTRL's, and the optimizer is {sec.name!r} (weight decay: "
                         f"weight_decay; for FTRL: name = \"ftrl\")")
    return make_optimizer(name, **kw)


def _check_model(cfg: Config) -> None:
    """The ``[model]`` checks of :func:`validate`."""
    j, d, m = cfg.job, cfg.data, cfg.model
    # (what each kind needs of the data and the other keys: hpcps.train.tables.check_model_kind)
    _check(m.kind in MODELS, "model.kind", m.kind, f"must be one of {', '.join(MODELS)}")
    if m.kind == "mf":                          # the ratings kind; every other is a CTR kind
        _check(d.format == "ratings", "model.kind", m.kind, "mf needs data.format = ratings")
    else:
        _check(d.format != "ratings", "model.kind", m.kind, "ratings data needs model.kind = mf")
    _check(m.dim >= 1, "model.dim", m.dim, "must be >= 1")
    _check(m.init in ("auto", *INITS), "model.init", m.init, f"must be one of auto, {', '.join(INITS)}")
    _check(m.init_scale >= 0 and math.isfinite(m.init_scale), "model.init_scale", m.init_scale,
           "must be finite and >= 0 (0: the model's default)")
    _check(m.embedding_l2 >= 0 and math.isfinite(m.embedding_l2), "model.embedding_l2", m.embedding_l2,
           "must be finite and >= 0")
    _check(0 <= m.dropout < 1, "model.dropout", m.dropout, "must be in [0, 1)")
    _check(m.cross_layers >= 0, "model.cross_layers", m.cross_layers, "must be >= 0")
    _check(m.cross_rank >= 0, "model.cross_rank", m.cross_rank, "must be >= 0 (0: full rank)")
    _check(m.interaction in ("dot", "dcn"), "model.interaction", m.interaction, "must be dot or dcn")
    _check(m.sharding in SHARDINGS, "model.sharding", m.sharding, f"must be one of {', '.join(SHARDINGS)}")
    _check(m.dynamic_capacity >= 0, "model.dynamic_capacity", m.dynamic_capacity, "must be >= 0 (0: auto)")
    _check(m.admit_min_count >= 1, "model.admit_min_count", m.admit_min_count, "must be >= 1")
    _check(m.evict in ("lru", "lfu"), "model.evict", m.evict, "must be lru or lfu")
    _check(not (m.dynamic_tables and j.export), "job.export", j.export,
           "a dynamic table's rows are exported from a checkpoint: hpcps ckpt export (model.dynamic_tables = true)")
    _check(not (m.dynamic_tables and str(cfg.pipeline.prefetch).lower() in ("on", "true", "yes", "1")),
           "pipeline.prefetch", cfg.pipeline.prefetch, "a dynamic table is pulled in its step (model.dynamic_tables)")
    _check(all(x >= 1 for x in m.bottom_mlp + m.top_mlp), "model.top_mlp", m.top_mlp, "sizes must be >= 1")
    _check(m.dense_backend in ("auto", "shm", "mpi", "gloo", "nccl"), "model.dense_backend", m.dense_backend,
           "must be auto, shm, mpi, gloo or nccl")
    _check(m.bucket_mb > 0, "model.bucket_mb", m.bucket_mb, "must be > 0")
    _check(m.threads >= 0, "model.threads", m.threads, "must be >= 0 (0: the node's CPUs / its ranks)")
    _check(m.device in ("cpu", "cuda"), "model.device", m.device, "must be cpu or cuda")
    _check(not (m.device == "cpu" and m.dense_backend == "nccl"), "model.dense_backend", m.dense_backend,
           "nccl needs model.device = cuda")
    _check(not (m.device == "cuda" and m.dense_backend in ("mpi", "shm", "gloo")), "model.dense_backend",
           m.dense_backend, f"{m.dense_backend} all-reduces CPU tensors; use auto or nccl with model.device = cuda")


def _check_monitor(cfg: Config) -> None:
    """The ``metrics.every`` and ``[monitor]`` checks of :func:`validate`."""
    mon = cfg.monitor
    _check(cfg.metrics.every >= 0 and math.isfinite(cfg.metrics.every), "metrics.every", cfg.metrics.every,
           "must be seconds >= 0 (0: no monitor)")
    for key in ("memory", "ps_busy", "ps_wait"):
        v = getattr(mon, key)
        _check(0 < v <= 1, f"monitor.{key}", v, "must be a share in (0, 1]")
    for key in ("disk_checkpoints", "straggler", "silent"):
        v = getattr(mon, key)
        _check(v > 0 and math.isfinite(v), f"monitor.{key}", v, "must be > 0")
    _check(mon.node_memory_mb >= 0, "monitor.node_memory_mb", mon.node_memory_mb, "must be >= 0 (0: the node's)")
    _check(mon.on_alert in ("log", "checkpoint_and_stop", "rebalance"), "monitor.on_alert", mon.on_alert,
           "must be log, checkpoint_and_stop or rebalance")


def _check_tune(cfg: Config) -> None:
    t = cfg.tune
    _check(t.trials >= 1, "tune.trials", t.trials, "must be >= 1")
    _check(t.ranks >= 2, "tune.ranks", t.ranks, "must be >= 2 (a PS and a worker)")
    _check(t.folds == 0 or t.folds >= 2, "tune.folds", t.folds, "must be 0 (one eval split) or >= 2")
    _check(t.folds == 0 or not cfg.data.eval_path, "tune.folds", t.folds,
           f"each fold's rows held out are its eval data: set data.eval_path = \"\" (it is {cfg.data.eval_path!r})")
    _check(t.folds == 0 or cfg.data.format != "synthetic-ctr", "tune.folds", t.folds,
           "needs file data (data.format = synthetic-ctr has no lines to cut into folds)")
    _check(not t.metric or t.metric in BEST_METRICS, "tune.metric", t.metric,
           f"must be one of {', '.join(BEST_METRICS)} (or empty: auc for CTR, rmse for ratings)")
    if t.space:
        from .schema import config_keys
        from .space import parse_space
        parse_space(t.space, config_keys())


def validate(cfg: Config) -> None:
    """Raise ``ValueError`` naming the first bad setting. Local."""
    _check(cfg.job.num_ps >= 1, "job.num_ps", cfg.job.num_ps, "must be >= 1")
    if cfg.metrics.tensorboard:
        import importlib.util
        _check(importlib.util.find_spec("tensorboard") is not None, "metrics.tensorboard", cfg.metrics.tensorboard,
               "needs the tensorboard package (pip install tensorboard, or the project's extra: pip install "
               "-e '.[tensorboard]')")
    _check_monitor(cfg)
    _check_tune(cfg)
    _check_job(cfg)
    _check_data(cfg)
    _check_model(cfg)
    _check_pipeline(cfg)
    _check_checkpoint(cfg)
    _check_optimizers(cfg)


def _check_job(cfg: Config) -> None:
    """The ``[job]`` checks of :func:`validate`."""
    j, d = cfg.job, cfg.data
    try:
        parse_mode(j.mode)
    except ValueError as e:
        raise ValueError(f"config: job.mode = {j.mode!r}: {e}") from None
    _check(j.transport in TRANSPORTS, "job.transport", j.transport, "must be auto or rma")
    _check(j.wait in WAIT_POLICIES, "job.wait", j.wait, f"must be one of {', '.join(WAIT_POLICIES)}")
    _check(j.rma_read in RMA_READS, "job.rma_read", j.rma_read, f"must be one of {', '.join(RMA_READS)}")
    _check(j.mpi_threads in THREAD_LEVELS, "job.mpi_threads", j.mpi_threads,
           f"must be one of {', '.join(THREAD_LEVELS)}")
    _check(j.step_delay >= 0, "job.step_delay", j.step_delay, "must be >= 0")
    _check(j.world_size >= 0, "job.world_size", j.world_size, "must be >= 0 (0: not checked)")
    _check(j.standby >= 0, "job.standby", j.standby, "must be >= 0 (0: none)")
    _check(j.ps_layout in PS_LAYOUTS, "job.ps_layout", j.ps_layout, f"must be one of {PS_LAYOUTS}")
    _check(str(j.deterministic).lower() in SWITCHES, "job.deterministic", j.deterministic, "must be auto, true or false")
    _check(not (SWITCHES.get(str(j.deterministic).lower()) == "on" and not str(j.mode).startswith("sync")),
           "job.deterministic", j.deterministic, f"needs job.mode = sync (the order of updates in {j.mode} depends "
           f"on timing)")
    _check(j.progress_timeout >= 0, "job.progress_timeout", j.progress_timeout, "must be >= 0 (0: wait forever)")
    _check(j.steps >= 0, "job.steps", j.steps, "must be >= 0")
    _check(j.epochs >= 0 or j.epochs == AUTO_EPOCHS, "job.epochs", "auto" if j.epochs == AUTO_EPOCHS else j.epochs,
           "must be >= 0 or \"auto\"")
    _check(j.max_epochs >= 1, "job.max_epochs", j.max_epochs, "must be >= 1")
    _check(j.log_every >= 1, "job.log_every", j.log_every, "must be >= 1")
    _check(j.eval_every >= 0, "job.eval_every", j.eval_every, "must be >= 0")
    _check(j.early_stop_patience >= 0, "job.early_stop_patience", j.early_stop_patience, "must be >= 0 (0: never)")
    _check(j.early_stop_patience == 0 or j.eval_every > 0 or (j.eval_each_epoch and d.format != "synthetic-ctr"),
           "job.early_stop_patience", j.early_stop_patience, "needs evaluations during training: set job.eval_every "
           "(or, with file data, job.eval_each_epoch = true)")
    _check(not j.export_best or (j.export and cfg.checkpoint.keep_best), "job.export_best", j.export_best,
           "needs job.export (where to) and checkpoint.keep_best (which checkpoint is best)")


def _check_data(cfg: Config) -> None:
    """The ``[data]`` checks of :func:`validate` (and the epochs they allow)."""
    j, d = cfg.job, cfg.data
    _check(d.format in FORMATS, "data.format", d.format, f"must be one of {', '.join(FORMATS)}")
    _check(d.batch_size >= 1, "data.batch_size", d.batch_size, "must be >= 1")
    _check(0 <= d.eval_fraction < 1, "data.eval_fraction", d.eval_fraction, "must be in [0, 1)")
    if d.format == "synthetic-ctr":
        _check(d.num_tables >= 1, "data.num_tables", d.num_tables, "must be >= 1")
        _check(d.rows_per_table >= 1, "data.rows_per_table", d.rows_per_table, "must be >= 1")
        _check(all(isinstance(r, int) and not isinstance(r, bool) and r >= 1 for r in d.table_rows),
               "data.table_rows", d.table_rows, "must be a list of row counts >= 1 (empty: num_tables x rows_per_table)")
        _check(d.scale > 0 and math.isfinite(d.scale), "data.scale", d.scale, "must be > 0")
        _check(d.zipf > 1, "data.zipf", d.zipf, "must be > 1")
        _check(d.eval_samples >= 1, "data.eval_samples", d.eval_samples, "must be >= 1")
        _check(j.epochs == 0, "job.epochs", "auto" if j.epochs == AUTO_EPOCHS else j.epochs,
               "synthetic data is endless, it has no epochs: set job.steps (and leave job.epochs = 0)")
        _check(j.steps > 0 and j.epochs == 0, "job.steps", j.steps,
               "synthetic data is endless: set job.steps > 0 and leave job.epochs = 0")
    else:
        _check(bool(d.path), "data.path", d.path, f"format {d.format} needs a file")
        expand_inputs(d.path, "data.path")                # a missing file, a glob matching nothing
        if d.eval_path:
            expand_inputs(d.eval_path, "data.eval_path")
        _check(j.steps > 0 or j.epochs != 0, "job.epochs", j.epochs, "set job.steps, or job.epochs > 0 or \"auto\"")
        _check(j.epochs != AUTO_EPOCHS or d.eval_fraction > 0 or bool(d.eval_path), "job.epochs", "auto",
               "stops when the evaluation stops improving, and there are no held-out lines to evaluate: set data.eval_fraction > 0 or data.eval_path")
        _check(j.early_stop_patience == 0 or d.eval_fraction > 0 or bool(d.eval_path), "job.early_stop_patience",
               j.early_stop_patience, "needs held-out lines to evaluate: set data.eval_fraction > 0 or data.eval_path")
    _check(d.hash_rows >= 1, "data.hash_rows", d.hash_rows, "must be >= 1")
    _check(d.reader in ("auto", "stream", "memory"), "data.reader", d.reader, "must be auto, stream or memory")
    _check(d.stream_split in ("shares", "batches"), "data.stream_split", d.stream_split, "must be shares or batches")
    _check(d.shuffle_buffer >= 1, "data.shuffle_buffer", d.shuffle_buffer, "must be >= 1 (lines)")
    d.delimiter = {"\\t": "\t", "tab": "\t"}.get(d.delimiter, d.delimiter)
    _check(len(d.delimiter) == 1 and d.delimiter not in "\n\r\"", "data.delimiter", d.delimiter,
           "must be one character, not a newline or a quote (write a tab as \"\\t\")")
    _check(d.header in ("auto", "true", "false", "on", "off"), "data.header", d.header, "must be auto, true or false")
    d.header = {"on": "true", "off": "false"}.get(d.header, d.header)
    _check(d.keys in ("hash", "raw"), "data.keys", d.keys, "must be hash or raw")
    _check("rest" not in d.categorical or d.categorical == ["rest"], "data.categorical", d.categorical,
           "is \"rest\" or a list of columns, not both")
    if d.format == "csv":
        _check(d.label != "", "data.label", d.label, "format csv needs the label column (a header name or a "
               "0-based number)")


def _check_pipeline(cfg: Config) -> None:
    """The ``[pipeline]`` checks of :func:`validate`."""
    j = cfg.job
    pl = cfg.pipeline
    for key in ("prefetch", "background_push", "loader"):
        v = getattr(pl, key)
        _check(str(v).lower() in SWITCHES, f"pipeline.{key}", v, "must be auto, on or off")
    _check(pl.cache_rows >= 0, "pipeline.cache_rows", pl.cache_rows, "must be >= 0")
    _check(pl.cache_staleness >= 0, "pipeline.cache_staleness", pl.cache_staleness, "must be >= 0")
    _check(pl.cache_rows == 0 or j.mode != "sync", "pipeline.cache_rows", pl.cache_rows,
           "a cache serves rows up to pipeline.cache_staleness steps old, and job.mode = sync promises "
           "fresh rows: use job.mode = async or ssp:S, or cache_rows = 0")
    _check(pl.pull_dtype in ROW_DTYPES, "pipeline.pull_dtype", pl.pull_dtype, f"must be one of {', '.join(ROW_DTYPES)}")
    _check(pl.push_dtype in ROW_DTYPES, "pipeline.push_dtype", pl.push_dtype, f"must be one of {', '.join(ROW_DTYPES)}")


def _check_checkpoint(cfg: Config) -> None:
    """The ``[checkpoint]`` checks of :func:`validate`."""
    d = cfg.data
    c = cfg.checkpoint
    _check(c.local_every >= 0, "checkpoint.local_every", c.local_every, "must be >= 0 (0: off)")
    _check(c.local_keep >= 1, "checkpoint.local_keep", c.local_keep, "must be >= 1")
    _check(c.local_full_every >= 0, "checkpoint.local_full_every", c.local_full_every, "must be >= 0 (0: auto)")
    _check(not c.local_dir or c.dir, "checkpoint.local_dir", c.local_dir,
           "needs checkpoint.dir too (the parallel filesystem level, and the job's lock)")
    _check(not c.local_every or c.local_dir, "checkpoint.local_every", c.local_every, "needs checkpoint.local_dir")
    _check(not c.local_dir or not c.dir or Path(c.local_dir).resolve() != Path(c.dir).resolve(),
           "checkpoint.local_dir", c.local_dir, "must not be checkpoint.dir")
    _check(c.every_steps >= 0 and c.every_seconds >= 0, "checkpoint.every_steps", c.every_steps, "must be >= 0")
    for key in ("every_steps", "every_seconds", "full_every"):
        _check(bool(c.dir) or getattr(c, key) == CheckpointConfig().__dict__[key], f"checkpoint.{key}",
               getattr(c, key), "needs checkpoint.dir (where would the checkpoints go?)")
    _check(not c.dir or not Path(c.dir).exists() or Path(c.dir).is_dir(), "checkpoint.dir", c.dir,
           "is a file, not a directory")
    _check(c.keep >= 0, "checkpoint.keep", c.keep, "must be >= 0")
    task = "ratings" if d.format == "ratings" else "ctr"
    good = [k for k, (t, _) in BEST_METRICS.items() if t == task]
    _check(c.keep_best in ("", *good), "checkpoint.keep_best", c.keep_best,
           f"must be {' or '.join(good)} for {task} data ('' = off)")
    _check(not c.keep_best or c.dir, "checkpoint.keep_best", c.keep_best, "needs checkpoint.dir (where would it go?)")
    _check(c.full_every >= 1, "checkpoint.full_every", c.full_every, "must be >= 1")
    _check(c.compression in ("", "gzip", "lzf"), "checkpoint.compression", c.compression, "must be '', gzip or lzf")
    parse_permissions(c.dir_mode, "checkpoint.dir_mode")
    parse_permissions(c.file_mode, "checkpoint.file_mode")
    if c.resume not in ("auto", "none"):
        _check(Path(c.resume).exists(), "checkpoint.resume", c.resume, "no such checkpoint")


def _check_optimizers(cfg: Config) -> None:
    """The ``[optimizer.*]`` checks of :func:`validate`."""
    j = cfg.job
    for sec_name in ("sparse", "wide", "dense"):
        sec = getattr(cfg.optimizer, sec_name)
        key = f"optimizer.{sec_name}"
        if sec_name == "wide" and not sec.name:
            continue                                  # as optimizer.sparse
        try:
            if sec_name in ("sparse", "wide"):
                build_sparse_optimizer(sec, max(j.steps, 1))
            else:
                _check(sec.name in ("sgd", "momentum", "adagrad", "adam"), f"{key}.name", sec.name,
                       "must be sgd, momentum, adagrad or adam")
                _check(sec.lr >= 0, f"{key}.lr", sec.lr, "must be >= 0")
                LRSchedule(kind=sec.schedule, warmup_steps=sec.warmup_steps, step_size=sec.step_size,
                           gamma=sec.gamma, total_steps=max(j.steps, 1), min_factor=sec.min_factor).check()
        except ValueError as e:
            msg = str(e)
            raise ValueError(msg if msg.startswith("config:") else f"config: {key}: {msg}") from None
