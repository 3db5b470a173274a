"""A job's sizes and tables from its config: steps, the model kind's tables and their optimizers,
memory checks, pipeline switches. Imports no torch: the PS ranks run from here (``hpcps.train.build``
makes the model and the dense optimizer on the workers)."""

import dataclasses

import numpy as np
from mpi4py import MPI

from ..config import AUTO_EPOCHS, Config, build_sparse_optimizer, deterministic, resolve_switch
from ..core.settings import parse_mode
from ..data.synthetic import synthetic_rows
from ..monitor.probe import mem_available
from ..models import PARTS, get_kind
from ..sparse import EmbeddingTable
from ..sparse.dynamic import DynamicEmbeddingTable
from .best import default_metric

__all__ = ["check_model_kind", "check_table_memory", "shard_bytes", "total_steps", "table_specs", "table_parts",
           "tables_by_part", "part_optimizer", "dynamic_capacity", "fused_tables", "FUSED_TABLE", "make_tables",
           "pipeline_switches", "resolve_local_full_every", "resolve_auto_epochs"]

FUSED_TABLE = PARTS["deep"]     # the deep part's table-batched table (model.fuse_tables)
# checkpoint.local_full_every = 0 (auto): every node-local checkpoint full while a PS's shard (rows
# and optimizer state) is at most this; above, a full one every AUTO_FULL_EVERY. On the main job
# (11 MB a shard) a delta held a quarter of the rows and took 0.07 s to write against a full one's
# 0.08 s, while a restart read a full one and 9 deltas in 0.13 s against one file in 0.03 s
AUTO_FULL_BYTES = 64 << 20
AUTO_FULL_EVERY = 10


def check_model_kind(cfg: Config) -> None:
    """What ``model.kind`` needs of the data and the other keys (the kind's registration says):
    ``ValueError`` naming the key. Local; alike on every rank, before any communication."""
    m, kind = cfg.model, get_kind(cfg.model.kind)
    ratings = cfg.data.format == "ratings"
    if kind.task == "ratings" and not ratings:
        raise ValueError(f"config: model.kind = {m.kind!r}: {m.kind} needs data.format = ratings")
    if kind.task != "ratings" and ratings:
        raise ValueError(f"config: model.kind = {m.kind!r}: ratings data needs model.kind = mf")
    if m.dropout and not kind.mlps:
        raise ValueError(f"config: model.dropout = {m.dropout!r}: a {m.kind} model has no MLP to drop out of")
    if m.dynamic_tables and kind.parts != ("deep",):
        raise ValueError(f"config: model.dynamic_tables = {m.dynamic_tables!r}: needs a kind of embeddings only "
                         f"(dlrm, dcn): {m.kind}'s wide part has fixed tables")


def total_steps(cfg: Config, data) -> int:
    """Steps the job runs: ``job.epochs`` passes over file data when set (``auto``: at most
    ``job.max_epochs``; early stopping ends it), else ``job.steps``. Local."""
    if cfg.job.epochs == AUTO_EPOCHS:
        return cfg.job.max_epochs * data.steps_per_epoch
    if cfg.job.epochs:
        return cfg.job.epochs * data.steps_per_epoch
    return cfg.job.steps


def table_parts(cfg: Config, data) -> list:
    """``[(part, specs)]``: the model's tables, ``specs`` as :func:`table_specs` gives them, by part
    (``hpcps.models.PARTS``: one table per categorical feature in each; a kind that lists its own
    tables, MF, has one part named ""). ``model.init`` and ``model.init_scale`` (0: the model's
    default) set the deep part's rows, ``auto`` meaning DLRM's reference initialiser, uniform in
    +-sqrt(1/rows) per table; the wide part's rows start at zero (logistic regression's start).
    Local."""
    kind = get_kind(cfg.model.kind)
    if kind.tables is not None:
        return [("", kind.tables(cfg, data))]
    init = "uniform" if cfg.model.init == "auto" else cfg.model.init
    parts = []
    for part in kind.parts:
        if part == "wide":
            parts.append((part, [(f"wide_{name}", rows, 1, "zeros", 0.0) for name, rows in data.tables]))
        else:
            parts.append((part, [(name, rows, cfg.model.dim, init, cfg.model.init_scale or float(np.sqrt(1.0 / rows)))
                                 for name, rows in data.tables]))
    return parts


def table_specs(cfg: Config, data) -> list:
    """[(name, rows, dim, init, init_scale)] of the model's tables, every part's in turn
    (:func:`table_parts`). Local."""
    return [spec for _, specs in table_parts(cfg, data) for spec in specs]


def tables_by_part(cfg: Config, data, tables: list) -> dict:
    """``{part: the hpcps tables holding it}`` of :func:`make_tables`'s ``tables`` (a part's tables
    come together, in :func:`table_parts`'s order; a fused part is one table). Local."""
    out, at = {}, 0
    for part, specs in table_parts(cfg, data):
        n = 1 if fused_tables(cfg, specs) else len(specs)
        out[part] = tables[at:at + n]
        at += n
    return out


def part_optimizer(cfg: Config, part: str, steps: int):
    """The sparse optimizer of a part's tables: ``[optimizer.wide]`` for the wide part when its
    name is set, else ``[optimizer.sparse]``. Local."""
    sec = cfg.optimizer.wide if part == "wide" and cfg.optimizer.wide.name else cfg.optimizer.sparse
    return build_sparse_optimizer(sec, steps)


def _table_sizes(cfg: Config, data) -> list:
    """``[(rows, dim, part)]`` of the job's tables (a dynamic table's capacity), from the config. Local."""
    if cfg.model.dynamic_tables:
        return [(dynamic_capacity(cfg, data), cfg.model.dim, "deep")]
    return [(rows, dim, part) for part, specs in table_parts(cfg, data) for _, rows, dim, _, _ in specs]


def shard_bytes(cfg: Config, data, steps: int, num_ps: int, in_memory: bool = False) -> int:
    """About the bytes one PS holds of rows and optimizer state (float32), from the config: the
    tables' rows (a dynamic table's capacity) over the PS ranks; what a checkpoint of it writes.
    ``in_memory``: with what the PS keeps beside them: the staged gradients of a table it applies
    (a stateful optimizer or a 16-bit ``push_dtype``/``pull_dtype``; a copy of the rows' size, none
    in deterministic sync, where pushes wait in the mailboxes) and the 16-bit copy of a 16-bit
    ``pull_dtype``. Local; alike on every rank."""
    p = cfg.pipeline
    half = in_memory and p.pull_dtype != "float32"
    staged = in_memory and not deterministic(cfg.job)
    total = 0
    for rows, dim, part in _table_sizes(cfg, data):
        opt = part_optimizer(cfg, part, steps)
        state = sum(int(np.prod(shape[1:], dtype=np.int64)) for shape in opt.state_shapes(1, dim).values())
        applies = opt.stateful or p.pull_dtype != "float32" or p.push_dtype != "float32"
        total += rows * (dim * (2 if staged and applies else 1) + state) * 4 + (rows * dim * 2 if half else 0)
    return -(-total // max(num_ps, 1))


def resolve_local_full_every(cfg: Config, data, steps: int, num_ps: int) -> Config:
    """``cfg`` with ``checkpoint.local_full_every = 0`` (auto) made a number: 1 (every node-local
    checkpoint full: a restart reads one file) while a PS's shard is at most ``AUTO_FULL_BYTES``,
    else ``AUTO_FULL_EVERY``. Local; alike on every rank."""
    c = cfg.checkpoint
    if c.local_full_every or not c.local_every:
        return cfg
    full = 1 if shard_bytes(cfg, data, steps, num_ps) <= AUTO_FULL_BYTES else AUTO_FULL_EVERY
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(c, local_full_every=full))


def resolve_auto_epochs(cfg: Config, task: str) -> Config:
    """``cfg`` with what ``job.epochs = "auto"`` implies where the config left it open: the best
    evaluation kept as a checkpoint (``checkpoint.keep_best``: AUC for CTR, RMSE for ratings)
    where there is a ``checkpoint.dir``, and ``job.export`` writing that best checkpoint's weights.
    Local; alike on every rank."""
    if cfg.job.epochs != AUTO_EPOCHS:
        return cfg
    keep = cfg.checkpoint.keep_best or (default_metric(task) if cfg.checkpoint.dir else "")
    job = dataclasses.replace(cfg.job, export_best=cfg.job.export_best or bool(cfg.job.export and keep))
    return dataclasses.replace(cfg, job=job, checkpoint=dataclasses.replace(cfg.checkpoint, keep_best=keep))


def fused_tables(cfg: Config, specs) -> bool:
    """Whether the job keeps a part's tables ``specs`` in one table-batched table
    (``model.fuse_tables``, a CTR kind's part of several tables that share dim and initialiser kind;
    each keeps its own scale). Local."""
    return (cfg.model.fuse_tables and get_kind(cfg.model.kind).tables is None and len(specs) > 1
            and len({(dim, kind) for _, _, dim, kind, _ in specs}) == 1)


def pipeline_switches(cfg: Config, ctx) -> dict:
    """``{"prefetch": bool, "background_push": bool}`` as ``[pipeline]`` and the layout decide:
    ``auto`` turns them on only where a worker reads some shard over RMA (latency to hide) and MPI
    allows a communication thread (``job.mpi_threads = multiple``). Collective over the world."""
    remote = cfg.job.transport == "rma" or bool(ctx.world.allreduce(
        int(ctx.is_worker and any(r not in ctx.node_ranks for r in ctx.ps_world_ranks)), op=MPI.MAX))
    threads = remote and MPI.Query_thread() >= MPI.THREAD_MULTIPLE
    if cfg.model.dynamic_tables:    # a dynamic table's rows carry no version stamps to refresh a prefetch by
        return {"prefetch": False, "background_push": resolve_switch(cfg.pipeline.background_push, threads)}
    return {"prefetch": resolve_switch(cfg.pipeline.prefetch, threads),
            "background_push": resolve_switch(cfg.pipeline.background_push, threads)}


def dynamic_capacity(cfg: Config, data) -> int:
    """``model.dynamic_capacity``, 0 meaning the rows the fixed tables would have: the synthetic
    tables' rows, or the feature columns times ``data.hash_rows``. Local."""
    if cfg.model.dynamic_capacity:
        return cfg.model.dynamic_capacity
    if cfg.data.format == "synthetic-ctr":
        return sum(synthetic_rows(cfg.data))
    return len(data.tables) * _column_rows(cfg)


def _column_rows(cfg: Config) -> int:
    """The rows a fixed table of one feature column has: the synthetic tables' mean (rounded up)
    or ``data.hash_rows``. Local."""
    if cfg.data.format == "synthetic-ctr":
        rows = synthetic_rows(cfg.data)
        return -(-sum(rows) // len(rows))
    return cfg.data.hash_rows


def _gib(n: float) -> str:
    return f"{n / 2**40:.1f} TiB" if n >= 2**40 else f"{n / 2**30:.1f} GiB"


def check_table_memory(cfg: Config, ctx, data, steps: int) -> None:
    """What the tables take on each PS rank (rows, optimizer state, the staging copy of a PS that
    applies, a 16-bit copy: ``shard_bytes(in_memory=True)``) times this node's PS ranks, against
    the memory the node has available: a ``ValueError`` saying both, before anything is
    allocated. Local (alike on a node's ranks)."""
    avail = mem_available()
    ps_here = len(set(ctx.node_ranks) & set(ctx.ps_world_ranks))
    if avail is None or not ps_here:
        return
    per_ps = shard_bytes(cfg, data, steps, ctx.num_ps, in_memory=True)
    if per_ps * ps_here > avail:
        raise ValueError(f"config: the tables need {_gib(per_ps * ps_here)} of memory on this host ({ps_here} PS "
                         f"rank(s) x {_gib(per_ps)}: rows, optimizer state, staging) and it has {_gib(avail)} available: "
                         f"add PS ranks on more nodes (job.num_ps), or lower model.dim or the table rows "
                         f"(data.hash_rows)")


def make_tables(cfg: Config, ctx, data, steps: int, pipe: dict, fill: bool = True) -> list:
    """The job's embedding tables: one table-batched table (a segment per feature table: a step's
    pulls, pushes and optimizer apply take one pass instead of one per table; each row starts as
    before) where :func:`fused_tables` says so, else one per feature table; with
    ``model.dynamic_tables`` one :class:`DynamicEmbeddingTable` for every feature column (the
    data's keys are salted per column). ``fill=False``: the fixed tables' rows are written by a
    restore or ``fill_initial`` (``EmbeddingTable``'s ``fill``). Collective over the world."""
    check_table_memory(cfg, ctx, data, steps)
    if cfg.model.dynamic_tables:
        m = cfg.model
        capacity = dynamic_capacity(cfg, data)
        init = "uniform" if m.init == "auto" else m.init
        # as the fixed tables' (whatever the capacity: a restart with another keeps new rows alike)
        scale = m.init_scale or float(np.sqrt(1.0 / _column_rows(cfg)))
        return [DynamicEmbeddingTable(ctx, FUSED_TABLE, m.dim, capacity, build_sparse_optimizer(cfg.optimizer.sparse, steps),
                                      seed=cfg.job.seed, admit_min_count=m.admit_min_count, evict=m.evict, init=init,
                                      scale=scale)]
    kind, _ = parse_mode(ctx.mode)
    c = cfg.checkpoint
    options = dict(seed=cfg.job.seed, transport=cfg.job.transport,
                   track_dirty=bool(c.dir) and (c.full_every > 1 or bool(c.local_every) and c.local_full_every > 1),
                   track_versions=pipe["prefetch"] and kind != "async", pull_dtype=cfg.pipeline.pull_dtype,
                   push_dtype=cfg.pipeline.push_dtype, sharding=cfg.model.sharding, fill=fill)
    tables = []
    for part, specs in table_parts(cfg, data):
        opt = part_optimizer(cfg, part, steps)
        if fused_tables(cfg, specs):
            (_, _, dim, init, _) = specs[0]
            tables.append(EmbeddingTable(ctx, PARTS[part], sum(s[1] for s in specs), dim, init=init, optimizer=opt,
                                         init_scale=[s[4] for s in specs], segments=[(s[0], s[1]) for s in specs],
                                         **options))
        else:
            tables += [EmbeddingTable(ctx, name, rows, dim, init=init, init_scale=scale, optimizer=opt, **options)
                       for name, rows, dim, init, scale in specs]
    return tables
