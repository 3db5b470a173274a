"""The settings' dataclasses and their dotted keys. Local, pure."""

import dataclasses
from dataclasses import dataclass, field, fields

__all__ = ["Config", "config_keys", "FORMATS", "MODELS", "AUTO_EPOCHS", "ENV_ALIASES"]

FORMATS = ("synthetic-ctr", "criteo", "csv", "ratings")
MODELS = ("lr", "wide_deep", "deepfm", "dcn", "dlrm", "mf")    # hpcps.models registers each
AUTO_EPOCHS = -1               # job.epochs = "auto", as the int it is kept as
# short environment names, kept from before these settings were config keys
ENV_ALIASES = {"HPCPS_NUM_PS": "job.num_ps", "HPCPS_MODE": "job.mode", "HPCPS_TRANSPORT": "job.transport",
               "HPCPS_WAIT": "job.wait", "HPCPS_RMA_READ": "job.rma_read", "HPCPS_MPI_THREADS": "job.mpi_threads",
               "HPCPS_MALLOC_TUNE": "job.malloc_tune", "HPCPS_STEP_DELAY": "job.step_delay",
               "HPCPS_WORLD_SIZE": "job.world_size", "HPCPS_NCCL_HOST": "model.nccl_host",
               "HPCPS_PROGRESS_TIMEOUT": "job.progress_timeout", "HPCPS_PS_LAYOUT": "job.ps_layout",
               "HPCPS_DETERMINISTIC": "job.deterministic"}


@dataclass
class JobConfig:
    num_ps: int = 1             # PS ranks
    mode: str = "sync"          # sync | async | ssp:S
    steps: int = 3000           # training steps (used when epochs = 0)
    epochs: int = 0             # passes over file data; > 0 overrides steps; "auto": until eval stops improving
    max_epochs: int = 20        # epochs = "auto": at most this many passes
    seed: int = 0
    transport: str = "auto"     # auto | rma
    log_every: int = 20         # steps between metrics records
    eval_every: int = 0         # steps between evaluations (0: only at the end)
    eval_each_epoch: bool = True  # file data: also evaluate at each epoch's end
    early_stop_patience: int = 0  # stop after this many evaluations without a better metric (0: never)
    export: str = ""            # .npz of the final weights written by worker 0 ("" = none)
    export_best: bool = False   # job.export writes the best checkpoint's weights (checkpoint.keep_best)
    restore_best: bool = True   # at the end, the model becomes the best evaluation's (its checkpoint.keep_best checkpoint)
    wait: str = "auto"          # how waiting ranks wait: auto | yield | sleep (auto: sleep if the node is oversubscribed)
    rma_read: str = "auto"   # pulls from other nodes: auto | get_accumulate (atomic per element) | get | messages (the PS answers)
    mpi_threads: str = "serialized"   # MPI thread level: single | funneled | serialized | multiple
    malloc_tune: bool = True    # restart with glibc's tcache off, trim the heap, keep freed pages (hpcps.core.malloc)
    step_delay: float = 0.0     # seconds each worker sleeps per step (demos and fault tests)
    world_size: int = 0         # when > 0, the MPI world must have exactly this many ranks
    standby: int = 0            # ranks held back to take a lost rank's place live (needs ULFM: hpcps.train.failover)
    progress_timeout: float = 600.0  # seconds a wait may see no progress before the job ends (0: never)
    ps_layout: str = "spread"   # which ranks are PS: spread (round robin over nodes) | last (highest ranks)
    deterministic: str = "auto"  # sync: sum pushes in worker order, bit-equal reruns: auto (on in sync) | true | false


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
    table_rows: list = field(default_factory=list)  # synthetic-ctr: each table's rows (instead of the two above)
    scale: float = 1.0          # synthetic-ctr: every table's rows times this (rounded up)
    num_dense: int = 13
    zipf: float = 1.2
    eval_samples: int = 50_000
    signal: float = 1.0
    hash_rows: int = 100_000    # criteo, csv: rows per categorical table
    reader: str = "auto"        # criteo, csv: auto | stream | memory (auto: stream above 256 MB of text)
    shuffle_buffer: int = 65536  # stream: lines per shuffle window (also the read and parse unit)
    shuffle_files: bool = True  # stream: the files' order is drawn anew (seeded) each epoch
    stream_split: str = "shares"  # stream: shares (each worker reads its share) | batches (all read all)
    delimiter: str = ","        # csv: the field separator ("\t" for TSV)
    header: str = "auto"        # csv: auto | true | false (a first line of column names in every file)
    label: str = ""             # csv: the label column (0/1): a header name or a 0-based number
    id: str = ""                # csv: a column that names each line (a name or a number): never a feature;
    #                             hpcps predict copies it beside each score
    categorical: list = field(default_factory=lambda: ["rest"])   # csv: names/numbers, or "rest"
    dense: list = field(default_factory=list)    # csv: numeric feature columns (missing: 0)
    dense_log: bool = False     # csv: dense values become log(1 + max(x, 0))
    drop: list = field(default_factory=list)     # csv: columns to ignore
    trace: str = ""             # a path prefix: worker w appends "step x x ..." (each sample's first dense
    #                             feature) to <trace>.<w> for every batch it trains (tests count samples)
    keys: str = "hash"          # csv: categorical values hashed per column | raw (decimal ids < hash_rows)


@dataclass
class ModelConfig:
    kind: str = "dlrm"          # lr | wide_deep | deepfm | dcn | dlrm (CTR) | mf (ratings)
    dim: int = 16
    bottom_mlp: list = field(default_factory=lambda: [64])
    top_mlp: list = field(default_factory=lambda: [64, 32])   # dlrm: over the interactions; wide_deep,
    #                             deepfm, dcn: the deep part's hidden layers
    cross_layers: int = 3       # dcn, dlrm with interaction = dcn: cross layers before the MLP
    cross_rank: int = 0         # their rank (0: full; MLPerf's DLRM-DCNv2: 512)
    interaction: str = "dot"    # dlrm: dot (pairwise dot products) | dcn (cross layers: DLRM-DCNv2)
    device: str = "cpu"         # cpu | cuda (dense layers; tables stay on the PS ranks)
    dense_backend: str = "auto"  # auto: nccl for cuda; cpu: shm if the workers share a node, else mpi | shm | mpi | gloo | nccl
    #                             (gloo: hosts joined by TCP alone, where MPI's all-reduce moves only while polled)
    bucket_mb: float = 4.0
    threads: int = 0            # torch threads per rank; 0: this node's CPUs / its ranks (at least 1)
    fuse_tables: bool = True    # dlrm: every table in one table-batched hpcps table (one pull, push, apply per step)
    sharding: str = "modulo"    # row placement over the PS ranks: modulo (id % P) | range (contiguous)
    nccl_host: str = ""         # address worker 0 offers for the NCCL or gloo bootstrap ("" = its hostname's)
    init: str = "auto"          # embedding rows' initialiser: auto | uniform | normal | zeros (MF biases: zeros)
    init_scale: float = 0.0     # uniform half-width / normal std; 0: auto (DLRM sqrt(1/rows), MF 0.1)
    embedding_l2: float = 0.0   # per-occurrence L2 on the looked-up rows, in the loss (0: off)
    dropout: float = 0.0        # dlrm: dropout after each hidden MLP layer
    dynamic_tables: bool = False  # dlrm: one dynamic table keyed by 64-bit feature keys (no modulo, salted per column)
    dynamic_capacity: int = 0   # dynamic table: rows over all PS ranks (0: what the fixed tables would hold)
    admit_min_count: int = 1    # dynamic table: a key gets a row at its admit_min_count-th sighting
    evict: str = "lru"          # dynamic table, when full: lru | lfu


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
class SparseOptimizerSection(OptimizerSection):
    l1: float = 0.0             # ftrl: L1 strength (entries within it are exactly 0)
    l2: float = 0.0             # ftrl: L2 strength
    ftrl_beta: float = 1.0      # ftrl: the paper's beta (learning-rate smoothing)


@dataclass
class DenseOptimizerSection(OptimizerSection):
    linear_lr: float = 0.0      # the linear part's dense-feature weights and bias (lr, wide_deep, deepfm); 0: lr


@dataclass
class OptimizerConfig:
    sparse: SparseOptimizerSection = field(default_factory=lambda: SparseOptimizerSection(name="adagrad", lr=0.15))
    # the wide (one-dim, linear) tables of lr, wide_deep and deepfm; name "" = as [optimizer.sparse]
    wide: SparseOptimizerSection = field(default_factory=lambda: SparseOptimizerSection(name=""))
    dense: DenseOptimizerSection = field(default_factory=lambda: DenseOptimizerSection(name="adam", lr=0.001))


@dataclass
class CheckpointConfig:
    dir: str = ""               # checkpoint directory ("" = no checkpoints)
    every_steps: int = 0        # 0: off
    every_seconds: float = 0.0  # 0: off
    keep: int = 3               # newest committed checkpoints kept (0 = all), the best one (keep_best) besides
    keep_best: str = ""         # "" | auc | logloss | rmse | mae: keep the best-evaluated checkpoint too
    resume: str = "auto"        # auto (newest verified in dir) | none (an empty dir) | PATH
    compression: str = ""       # "" | gzip | lzf
    full_every: int = 1         # a full checkpoint every K; the ones between hold only changed rows
    dir_mode: str = "0700"      # permissions of checkpoint directories (octal)
    file_mode: str = "0600"     # permissions of checkpoint files (octal)
    local_dir: str = ""         # node-local level (/dev/shm/..., a local SSD) on every host ("" = off)
    local_every: int = 0        # steps between node-local checkpoints (0: off)
    local_keep: int = 2         # node-local checkpoints kept on each host (with the ones they build on)
    local_full_every: int = 0   # a full node-local checkpoint every K; the ones between hold only changed rows
    #                             0: auto (every one full while a PS's shard is at most 64 MiB, else 10)


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
    progress: bool = True       # worker 0: a tqdm bar on a terminal, a line every 5% in a batch log
    tensorboard: str = ""       # a directory: the records' figures as TensorBoard scalars (needs tensorboard)
    every: float = 10.0         # seconds between the monitor's samples of every rank (0: no monitor)


@dataclass
class MonitorConfig:
    # the alert rules (hpcps.monitor), judged every metrics.every seconds on the first worker
    memory: float = 0.9         # a host's memory in use over this share of what it has
    node_memory_mb: int = 0     # what a host has for the job (0: the cgroup's limit, else the node's memory)
    disk_checkpoints: float = 2.0  # free space under this many checkpoints' worth
    ps_wait: float = 0.3        # the workers wait on a PS over this share of their step ...
    ps_busy: float = 0.8        # ... and it is busy for at least this share of that wait
    straggler: float = 1.5      # a host's own work per step over this many times the median host's
    silent: float = 3.0         # a rank that has not reported for this many metrics.every
    on_alert: str = "log"       # log | checkpoint_and_stop (exit 85, for a restart with the suggested layout)
    #                             | rebalance (an overloaded PS: standbys become PS, no exit; job.standby)


@dataclass
class TuneConfig:
    # hpcps tune: a search over [tune.space] with Optuna (docs/tuning.md)
    trials: int = 20            # finished trials (complete or pruned) after which the study stops, over every search process
    metric: str = ""            # the eval metric to optimise ("": auc for CTR, rmse for ratings)
    study: str = "results/tune"  # directory: journal.log (Optuna's journal: resumed, shared by jobs), trials.md, best.toml, tune.png
    ranks: int = 3              # MPI ranks of each trial (1 PS + the rest workers unless the space or config says)
    launcher: str = ""          # runs a trial's ranks ("": the mpiexec beside python); {ranks} is replaced, e.g. "srun -n {ranks}"
    pruning: bool = True        # stop a trial whose n-th evaluation falls below the median of earlier trials' n-th
    folds: int = 0              # 2 or more: each trial trains this many times, each fold of data.path held out once (data.eval_path empty), judged by the mean
    space: dict = field(default_factory=dict)  # config key -> [choices] or {low, high, log}: [tune.space] in a TOML file


@dataclass
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    tune: TuneConfig = field(default_factory=TuneConfig)

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
