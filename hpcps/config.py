"""Typed training configuration: file < ``HPCPS_*`` environment < ``--set``.

Keys are dotted ``section.key`` (``optimizer.sparse.lr``); the environment
name of a key is ``HPCPS_`` + the key upper-cased with dots as underscores
(``HPCPS_OPTIMIZER_SPARSE_LR``), and ``HPCPS_NUM_PS``, ``HPCPS_MODE``,
``HPCPS_TRANSPORT`` set ``job.num_ps``, ``job.mode``, ``job.transport``.
Unknown keys and bad values raise ``ValueError`` naming the key and where it
came from.
"""

import dataclasses
import difflib
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:                                    # pragma: no cover
    import tomli as tomllib

from .core.layout import PS_LAYOUTS
from .core.optimizers import LRSchedule, make_optimizer
from .core.settings import RMA_READS, ROW_DTYPES, SHARDINGS, THREAD_LEVELS, TRANSPORTS, WAIT_POLICIES, parse_mode

__all__ = ["Config", "load_config", "config_keys", "build_sparse_optimizer", "parse_permissions", "FORMATS", "MODELS"]

FORMATS = ("synthetic-ctr", "criteo", "ratings")
MODELS = ("dlrm", "mf")
# short environment names, kept from before these settings were config keys
ENV_ALIASES = {"HPCPS_NUM_PS": "job.num_ps", "HPCPS_MODE": "job.mode", "HPCPS_TRANSPORT": "job.transport",
               "HPCPS_WAIT": "job.wait", "HPCPS_RMA_READ": "job.rma_read", "HPCPS_MPI_THREADS": "job.mpi_threads",
               "HPCPS_MALLOC_TUNE": "job.malloc_tune", "HPCPS_STEP_DELAY": "job.step_delay",
               "HPCPS_WORLD_SIZE": "job.world_size", "HPCPS_NCCL_HOST": "model.nccl_host",
               "HPCPS_PROGRESS_TIMEOUT": "job.progress_timeout", "HPCPS_PS_LAYOUT": "job.ps_layout"}


@dataclass
class JobConfig:
    num_ps: int = 1             # PS ranks
    mode: str = "sync"          # sync | async | ssp:S
    steps: int = 3000           # training steps (used when epochs = 0)
    epochs: int = 0             # passes over file data; > 0 overrides steps
    seed: int = 0
    transport: str = "auto"     # auto | rma
    log_every: int = 20         # steps between metrics records
    eval_every: int = 0         # steps between evaluations (0: only at the end)
    export: str = ""            # .npz of the final weights written by worker 0 ("" = none)
    wait: str = "auto"          # how waiting ranks wait: auto | yield | sleep (auto: sleep if the node is oversubscribed)
    rma_read: str = "get_accumulate"  # remote pulls: get_accumulate (atomic per element) | get (faster)
    mpi_threads: str = "serialized"   # MPI thread level: single | funneled | serialized | multiple
    malloc_tune: bool = True    # restart with glibc's tcache off, trim the heap (hpcps.core.malloc)
    step_delay: float = 0.0     # seconds each worker sleeps per step (demos and fault tests)
    world_size: int = 0         # when > 0, the MPI world must have exactly this many ranks
    progress_timeout: float = 600.0  # seconds a wait may see no progress before the job ends (0: never)
    ps_layout: str = "spread"   # which ranks are PS: spread (round robin over nodes) | last (highest ranks)


@dataclass
class DataConfig:
    format: str = "synthetic-ctr"
    path: str = ""
    eval_path: str = ""
    batch_size: int = 1024      # global batch, split over the workers
    eval_fraction: float = 0.1  # held out from `path` when there is no eval_path
    skip_bad_lines: bool = False
    num_tables: int = 8         # synthetic-ctr
    rows_per_table: int = 10_000
    num_dense: int = 13
    zipf: float = 1.2
    eval_samples: int = 50_000
    signal: float = 1.0
    hash_rows: int = 100_000    # criteo: rows per categorical table


@dataclass
class ModelConfig:
    kind: str = "dlrm"          # dlrm | mf
    dim: int = 16
    bottom_mlp: list = field(default_factory=lambda: [64])
    top_mlp: list = field(default_factory=lambda: [64, 32])
    device: str = "cpu"         # cpu | cuda (dense layers; tables stay on the PS ranks)
    dense_backend: str = "auto"  # auto: nccl for cuda; cpu: shm if the workers share a node, else mpi | shm | mpi | nccl
    bucket_mb: float = 4.0
    threads: int = 0            # torch threads per rank; 0: this node's CPUs / its ranks (at least 1)
    fuse_tables: bool = True    # dlrm: every table in one table-batched hpcps table (one pull, push, apply per step)
    sharding: str = "modulo"    # row placement over the PS ranks: modulo (id % P) | range (contiguous)
    nccl_host: str = ""         # address worker 0 offers for the NCCL bootstrap ("" = its hostname's)


@dataclass
class OptimizerSection:
    name: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    eps: float = 0.0            # 0: the optimizer's default
    beta1: float = 0.9
    beta2: float = 0.999
    schedule: str = "constant"  # constant | step | cosine
    warmup_steps: int = 0
    step_size: int = 1000
    gamma: float = 0.1
    min_factor: float = 0.0
    clip_norm: float = 0.0


@dataclass
class OptimizerConfig:
    sparse: OptimizerSection = field(default_factory=lambda: OptimizerSection(name="adagrad", lr=0.15))
    dense: OptimizerSection = field(default_factory=lambda: OptimizerSection(name="adam", lr=0.001))


@dataclass
class CheckpointConfig:
    dir: str = ""               # checkpoint directory ("" = no checkpoints)
    every_steps: int = 0        # 0: off
    every_seconds: float = 0.0  # 0: off
    keep: int = 3               # committed checkpoints kept (0 = all)
    resume: str = "auto"        # auto (newest verified in dir) | none | PATH
    compression: str = ""       # "" | gzip | lzf
    full_every: int = 1         # a full checkpoint every K; the ones between hold only changed rows
    dir_mode: str = "0700"      # permissions of checkpoint directories (octal)
    file_mode: str = "0600"     # permissions of checkpoint files (octal)


@dataclass
class PipelineConfig:
    # off | on | auto; auto: on when a worker reads some shard over RMA (a PS on another node, or
    # job.transport = rma), off when every shard is a shared-memory gather (nothing to hide).
    # Off by default: on the one machine measured (2 cores) the pipeline cost throughput
    prefetch: str = "off"       # pull step t+1's rows while step t computes (exact in sync mode)
    background_push: str = "off"  # pushes and prefetches run on a communication thread
    # a child process per worker draws its training batches ahead (hpcps.data.loader); auto: on where
    # the node has a CPU for each worker and one for each loader (the PS ranks mostly wait)
    loader: str = "auto"
    cache_rows: int = 0         # worker-side cache of hot rows per table (0 = off; async or ssp only)
    cache_staleness: int = 2    # a cached row older than this many steps is pulled again
    pull_dtype: str = "float32"  # float32 | bfloat16 | float16: rows travel to workers in 16 bits
    push_dtype: str = "float32"  # float32 | bfloat16 | float16: per-row gradient sums rounded to 16 bits


@dataclass
class MetricsConfig:
    path: str = ""              # JSONL file ("" = none)
    progress: bool = True       # tqdm bar on worker 0


@dataclass
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _leaves(obj, prefix=""):
    for f in fields(obj):
        v = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(v):
            yield from _leaves(v, key + ".")
        else:
            yield key, f


def config_keys() -> dict:
    """Dotted key -> dataclass field of every setting. Local."""
    return dict(_leaves(Config()))


def _coerce(key, value, default, source):
    """``value`` as the type of ``default``. Text is converted only where every value is text
    (environment, ``--set``): in a TOML file a number or list written as a string is an error,
    as is Python's ``1_000`` or a float where an integer belongs. Local."""
    kind = type(default)
    where = f"config: {key} = {value!r} ({source})"
    from_text = not source.startswith("file ")
    if isinstance(value, str) and kind is not str and from_text:
        text = value.strip()
        try:
            if "_" in text:
                raise ValueError
            if kind is bool:
                low = text.lower()
                if low not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                    raise ValueError
                return low in ("true", "1", "yes", "on")
            if kind is int:
                return int(text)
            if kind is float:
                return float(text)
            if kind is list:
                text = text.strip("[]")
                return [int(x) for x in text.replace(",", " ").split()] if text else []
        except ValueError:
            raise ValueError(f"{where}: expected {kind.__name__}") from None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is list and isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        return list(value)
    if kind is str and isinstance(value, bool):          # a switch written as a TOML boolean
        return "on" if value else "off"
    if type(value) is not kind:
        got = "a string" if isinstance(value, str) else type(value).__name__
        raise ValueError(f"{where}: expected {kind.__name__}, got {got}"
                         + (" (write it without quotes)" if isinstance(value, str) else ""))
    return value


def _flatten(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flatten(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _set(cfg, key, value, source, keys):
    if key not in keys:
        near = difflib.get_close_matches(key, keys, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ValueError(f"config: unknown key {key!r} ({source}){hint}")
    *path, last = key.split(".")
    obj = cfg
    for p in path:
        obj = getattr(obj, p)
    setattr(obj, last, _coerce(key, value, getattr(obj, last), source))


def load_config(path=None, overrides=(), environ=None) -> Config:
    """Merge defaults < TOML file < environment < ``overrides`` ("key=value"), then validate. Local."""
    cfg = Config()
    keys = config_keys()
    if path:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as e:
            raise ValueError(f"config: cannot read {path}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"config: {path} is not valid TOML: {e}") from None
        for key, value in _flatten(data):
            _set(cfg, key, value, f"file {path}", keys)
    env = os.environ if environ is None else environ
    for key in keys:
        name = "HPCPS_" + key.upper().replace(".", "_")
        if name in env:
            _set(cfg, key, env[name], f"environment {name}", keys)
    for name, key in ENV_ALIASES.items():
        if name in env:
            _set(cfg, key, env[name], f"environment {name}", keys)
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"config: --set takes key=value, got {item!r}")
        key, value = item.split("=", 1)
        _set(cfg, key.strip(), value, "--set", keys)
    validate(cfg)
    return cfg


SWITCHES = {"auto": "auto", "on": "on", "true": "on", "yes": "on", "1": "on",
            "off": "off", "false": "off", "no": "off", "0": "off"}


def resolve_switch(value: str, auto: bool) -> bool:
    """An ``auto | on | off`` setting (validated) as a bool, ``auto`` meaning ``auto``. Local."""
    v = SWITCHES[str(value).lower()]
    return auto if v == "auto" else v == "on"


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


def build_sparse_optimizer(sec: OptimizerSection, total_steps: int):
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
    return make_optimizer(name, **kw)


def validate(cfg: Config) -> None:
    """Raise ``ValueError`` naming the first bad setting. Local."""
    j, d, m = cfg.job, cfg.data, cfg.model
    _check(j.num_ps >= 1, "job.num_ps", j.num_ps, "must be >= 1")
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
    _check(j.ps_layout in PS_LAYOUTS, "job.ps_layout", j.ps_layout, f"must be one of {PS_LAYOUTS}")
    _check(j.progress_timeout >= 0, "job.progress_timeout", j.progress_timeout, "must be >= 0 (0: wait forever)")
    _check(j.steps >= 0 and j.epochs >= 0, "job.steps", j.steps, "steps and epochs must be >= 0")
    _check(j.log_every >= 1, "job.log_every", j.log_every, "must be >= 1")
    _check(j.eval_every >= 0, "job.eval_every", j.eval_every, "must be >= 0")
    _check(d.format in FORMATS, "data.format", d.format, f"must be one of {', '.join(FORMATS)}")
    _check(d.batch_size >= 1, "data.batch_size", d.batch_size, "must be >= 1")
    _check(0 <= d.eval_fraction < 1, "data.eval_fraction", d.eval_fraction, "must be in [0, 1)")
    if d.format == "synthetic-ctr":
        _check(d.num_tables >= 1, "data.num_tables", d.num_tables, "must be >= 1")
        _check(d.rows_per_table >= 1, "data.rows_per_table", d.rows_per_table, "must be >= 1")
        _check(d.zipf > 1, "data.zipf", d.zipf, "must be > 1")
        _check(d.eval_samples >= 1, "data.eval_samples", d.eval_samples, "must be >= 1")
        _check(j.steps > 0 and j.epochs == 0, "job.steps", j.steps,
               "synthetic data is endless: set job.steps > 0 and leave job.epochs = 0")
    else:
        _check(bool(d.path), "data.path", d.path, f"format {d.format} needs a file")
        _check(Path(d.path).is_file(), "data.path", d.path, "no such file")
        if d.eval_path:
            _check(Path(d.eval_path).is_file(), "data.eval_path", d.eval_path, "no such file")
        _check(j.steps > 0 or j.epochs > 0, "job.epochs", j.epochs, "set job.steps or job.epochs > 0")
    _check(d.hash_rows >= 1, "data.hash_rows", d.hash_rows, "must be >= 1")
    _check(m.kind in MODELS, "model.kind", m.kind, f"must be one of {', '.join(MODELS)}")
    if m.kind == "mf":
        _check(d.format == "ratings", "model.kind", m.kind, "mf needs data.format = ratings")
    else:
        _check(d.format != "ratings", "model.kind", m.kind, "ratings data needs model.kind = mf")
    _check(m.dim >= 1, "model.dim", m.dim, "must be >= 1")
    _check(m.sharding in SHARDINGS, "model.sharding", m.sharding, f"must be one of {', '.join(SHARDINGS)}")
    _check(all(x >= 1 for x in m.bottom_mlp + m.top_mlp), "model.top_mlp", m.top_mlp, "sizes must be >= 1")
    _check(m.dense_backend in ("auto", "shm", "mpi", "nccl"), "model.dense_backend", m.dense_backend,
           "must be auto, shm, mpi or nccl")
    _check(m.bucket_mb > 0, "model.bucket_mb", m.bucket_mb, "must be > 0")
    _check(m.threads >= 0, "model.threads", m.threads, "must be >= 0 (0: the node's CPUs / its ranks)")
    _check(m.device in ("cpu", "cuda"), "model.device", m.device, "must be cpu or cuda")
    _check(not (m.device == "cpu" and m.dense_backend == "nccl"), "model.dense_backend", m.dense_backend,
           "nccl needs model.device = cuda")
    _check(not (m.device == "cuda" and m.dense_backend in ("mpi", "shm")), "model.dense_backend",
           m.dense_backend, f"{m.dense_backend} all-reduces CPU tensors; use auto or nccl with model.device = cuda")
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
    c = cfg.checkpoint
    _check(c.every_steps >= 0 and c.every_seconds >= 0, "checkpoint.every_steps", c.every_steps, "must be >= 0")
    for key in ("every_steps", "every_seconds", "full_every"):
        _check(bool(c.dir) or getattr(c, key) == CheckpointConfig().__dict__[key], f"checkpoint.{key}",
               getattr(c, key), "needs checkpoint.dir (where would the checkpoints go?)")
    _check(not c.dir or not Path(c.dir).exists() or Path(c.dir).is_dir(), "checkpoint.dir", c.dir,
           "is a file, not a directory")
    _check(c.keep >= 0, "checkpoint.keep", c.keep, "must be >= 0")
    _check(c.full_every >= 1, "checkpoint.full_every", c.full_every, "must be >= 1")
    _check(c.compression in ("", "gzip", "lzf"), "checkpoint.compression", c.compression, "must be '', gzip or lzf")
    parse_permissions(c.dir_mode, "checkpoint.dir_mode")
    parse_permissions(c.file_mode, "checkpoint.file_mode")
    if c.resume not in ("auto", "none"):
        _check(Path(c.resume).exists(), "checkpoint.resume", c.resume, "no such checkpoint")
    for sec_name in ("sparse", "dense"):
        sec = getattr(cfg.optimizer, sec_name)
        key = f"optimizer.{sec_name}"
        try:
            if sec_name == "sparse":
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
