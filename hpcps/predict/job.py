"""``hpcps predict``: score input files with a checkpoint, as an MPI job.

The PS ranks load their shards from the checkpoint (any number of PS and workers, as a restart
does) and serve; the workers share the input's parts (part ``i`` to worker ``i mod W``), read each
with training's readers, look the rows up and run the model forward (no backward, no push), and
write one row per sample (``hpcps.predict.output``). Memory holds one block of lines at a time.
"""

import time

import numpy as np
import torch
from mpi4py import MPI

from ..checkpoint import load_dense_model, read_manifest, restore_tables
from ..config import resolve_switch
from ..runtime.context import init
from ..nn import ShardedEmbeddingBag
from ..train.build import build_model, make_lookups
from ..train.tables import make_tables
from .inputs import Shape, check_tables, index_inputs, layout_of, part_size, plan_parts
from .output import Output
from .reading import read_parts, warm_up
from .serving import torch_scores

__all__ = ["predict", "scoring_job", "ScoringModel"]

BATCH = 4096                # samples per forward


class ScoringModel:
    """A worker's model over the job's tables with the checkpoint's dense weights: ``scores(dense,
    keys)`` gives probabilities (CTR) or ratings. Made on a worker (local; its lookups pull from the
    PS ranks)."""

    def __init__(self, cfg, tables, shape, path):
        embs = [ShardedEmbeddingBag(t, mode="sum") for t in tables]
        _, lookups = make_lookups(cfg, shape, tables, embs, False)
        self.model = build_model(cfg, lookups, shape)
        load_dense_model(path, self.model)
        self.model.eval()
        self.task = shape.task

    def scores(self, dense: np.ndarray, keys: np.ndarray) -> np.ndarray:
        out = [torch_scores(self.model, dense[a:a + BATCH], keys[a:a + BATCH], self.task) for a in range(0, dense.shape[0], BATCH)]
        return np.concatenate(out) if out else np.zeros(0, np.float32)


def scoring_job(cfg, path, labelled: str, work):
    """The job both ``predict`` and ``evaluate`` run: every rank indexes the input and makes the
    tables; the PS ranks load the checkpoint's shards (:func:`restore_tables`, any number of PS)
    and serve; each worker gets ``work(ctx, model, files, layout, id column, parse in a child?)``'s
    answer. Returns the first worker's answer on every rank. Collective over ``MPI.COMM_WORLD``."""
    world = MPI.COMM_WORLD
    manifest = read_manifest(path)
    j = cfg.job
    answer = None
    wait = "sleep" if j.wait == "auto" else j.wait          # the PS ranks apply nothing: leave the CPUs to the workers
    with init(num_ps=j.num_ps, transport=j.transport, mode="async", wait=wait, rma_read=j.rma_read,
              progress_timeout=j.progress_timeout, ps_layout=j.ps_layout, deterministic=False) as ctx:
        torch.set_num_threads(1 if ctx.is_ps else max(1, ctx.node_cpus // ctx.node_comm.Get_size()))
        files = index_inputs(cfg.data, world, manifest.get("layout"))
        lay, id_col = layout_of(cfg.data, files, labelled, manifest, path)
        shape = Shape(lay)
        check_tables(cfg, shape, manifest, path)                   # alike on every rank
        tables = make_tables(cfg, ctx, shape, 1, {"prefetch": False, "background_push": False})
        start = restore_tables(path, ctx, tables)
        ctx.control.set_start(start)
        if ctx.is_ps:
            ctx.serve()
        else:
            warm_up(files, lay)
            answer = work(ctx, ScoringModel(cfg, tables, shape, path), files, lay, id_col, _parse_child(cfg, ctx))
        first = ctx.worker_world_ranks[0]
    return world.bcast(answer, root=first)


def _parse_child(cfg, ctx) -> bool:
    """Whether this worker parses in a child process (``hpcps.predict.reading``): ``pipeline.loader``,
    ``auto`` where the node has a CPU for each worker and one for each child (the PS ranks sleep). Local."""
    ps = set(ctx.ps_world_ranks)
    workers = sum(r not in ps for r in ctx.node_ranks)
    return resolve_switch(cfg.pipeline.loader, 2 * workers <= ctx.node_cpus)


def predict(cfg, path, out: Output, labelled: str = "auto", part_lines: int = 0) -> dict:
    """Score ``cfg.data.path`` with checkpoint ``path`` into ``out``; returns the summary (rows,
    parts written, seconds) on every rank. Collective over ``MPI.COMM_WORLD``."""
    t0 = time.perf_counter()

    def work(ctx, model, files, lay, id_col, child):
        parts = plan_parts(files, part_lines)
        starts = np.cumsum([0] + [f.lines for f in files])
        W, w, comm = ctx.num_workers, ctx.worker_rank, ctx.worker_comm
        out.begin({"checkpoint": str(path.resolve()), "inputs": [[f.path, f.lines] for f in files],
                   "part_lines": part_size(files, part_lines), "format": out.fmt}, w == 0)
        comm.Barrier()
        stats, rows, written, t_parts = {"skipped_lines": 0}, {}, 0, time.perf_counter()
        mine = [i for i in range(w, len(parts), W) if not out.done(i)]
        rows.update({i: out.rows(i) for i in range(w, len(parts), W) if i not in mine})
        cols = _Columns(lay, id_col)
        for i, block in read_parts(files, parts, mine, lay, id_col, cfg.data.skip_bad_lines, stats, child):
            if block is None:
                rows[i] = out.write(i, cols.table())
                written, cols = written + 1, _Columns(lay, id_col)
            else:
                cols.add(model, block, starts[parts[i][0]])
        busy = time.perf_counter() - t_parts
        gathered = comm.gather((rows, written, stats["skipped_lines"], busy), root=0)
        if w != 0:
            return None
        every = {k: v for r, *_ in gathered for k, v in r.items()}
        summary = {"rows": int(sum(every.values())), "parts": len(parts), "num_ps": ctx.num_ps, "num_workers": W,
                   "parts_written": sum(g[1] for g in gathered), "skipped_lines": sum(g[2] for g in gathered),
                   "labelled": lay.label >= 0, "id_column": lay.names[id_col] if id_col is not None else None,
                   "score_seconds": round(max(g[3] for g in gathered), 3)}      # reading, scoring, writing
        out.finish([every[i] for i in range(len(parts))],
                   [(int(starts[k] + lo), int(starts[k] + hi)) for k, lo, hi in parts], summary)
        return summary

    summary = scoring_job(cfg, path, labelled, work)
    return {**summary, "out": str(out.out), "format": out.fmt, "checkpoint": str(path),
            "seconds": round(time.perf_counter() - t0, 3)}


class _Columns:
    """One part's output columns, block by block: ``line`` (the sample's data line in the whole
    input, 0-based), ``id`` (``data.id``'s value, where the input has it), ``label`` (where it has
    one: the click, or the observed rating) and ``probability`` (CTR) or ``rating``. Local."""

    def __init__(self, lay, id_col):
        self.lay, self.id_col = lay, id_col
        self.ratings = getattr(lay, "task", "ctr") == "ratings"
        self.cols = {"line": [], "id": [], "label": [], "probability": []}

    def add(self, model, block, first_line: int) -> None:
        dense, keys, labels, lines, ids = block
        self.cols["line"].append(lines + first_line)
        if ids is not None:
            self.cols["id"].append(ids)
        if labels is not None:
            self.cols["label"].append(labels.astype(np.float32 if self.ratings else np.int8))
        self.cols["probability"].append(model.scores(dense, keys))

    def table(self) -> dict:
        cat = lambda xs, dtype: np.concatenate(xs) if xs else np.zeros(0, dtype)   # noqa: E731
        table = {"line": cat(self.cols["line"], np.int64)}
        if self.id_col is not None:
            import pyarrow as pa
            table["id"] = pa.chunked_array(self.cols["id"], pa.string())
        if self.lay.label >= 0:
            table["label"] = cat(self.cols["label"], np.float32 if self.ratings else np.int8)
        table["rating" if self.ratings else "probability"] = cat(self.cols["probability"], np.float32)
        return table
