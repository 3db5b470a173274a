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
from ..context import init
from ..data.textfiles import LineReader
from ..nn import ShardedEmbeddingBag
from ..train.build import build_model, make_lookups, make_tables
from .inputs import Shape, check_tables, index_inputs, input_layout, part_size, plan_parts, read_part
from .output import Output
from .serving import torch_scores

__all__ = ["predict", "scoring_job", "ScoringModel"]

BATCH = 4096                # samples per forward


class ScoringModel:
    """A worker's model over the job's tables with the checkpoint's dense weights: ``scores(dense,
    keys)`` gives probabilities (CTR). Made on a worker (local; its lookups pull from the PS ranks)."""

    def __init__(self, cfg, tables, shape, path):
        embs = [ShardedEmbeddingBag(t, mode="sum") for t in tables]
        _, lookups = make_lookups(cfg, shape, tables, embs, False)
        self.model = build_model(cfg, lookups, shape)
        load_dense_model(path, self.model)
        self.model.eval()

    def scores(self, dense: np.ndarray, keys: np.ndarray) -> np.ndarray:
        out = [torch_scores(self.model, dense[a:a + BATCH], keys[a:a + BATCH]) for a in range(0, dense.shape[0], BATCH)]
        return np.concatenate(out) if out else np.zeros(0, np.float32)


def scoring_job(cfg, path, labelled: str, work):
    """The job both ``predict`` and ``evaluate`` run: every rank indexes the input and makes the
    tables; the PS ranks load the checkpoint's shards (:func:`restore_tables`, any number of PS)
    and serve; each worker gets ``work(ctx, model, files, layout, id column)``'s answer. Returns
    the first worker's answer on every rank. Collective over ``MPI.COMM_WORLD``."""
    world = MPI.COMM_WORLD
    manifest = read_manifest(path)
    j = cfg.job
    answer = None
    with init(num_ps=j.num_ps, transport=j.transport, mode="async", wait=j.wait, rma_read=j.rma_read,
              progress_timeout=j.progress_timeout, ps_layout=j.ps_layout, deterministic=False) as ctx:
        torch.set_num_threads(1 if ctx.is_ps else max(1, ctx.node_cpus // ctx.node_comm.Get_size()))
        files = index_inputs(cfg.data, world)
        lay, id_col = input_layout(cfg.data, files, labelled, manifest.get("layout"))
        shape = Shape(lay)
        check_tables(cfg, shape, manifest, path)                   # alike on every rank
        tables = make_tables(cfg, ctx, shape, 1, {"prefetch": False, "background_push": False})
        start = restore_tables(path, ctx, tables)
        ctx.control.set_start(start)
        if ctx.is_ps:
            ctx.serve()
        else:
            answer = work(ctx, ScoringModel(cfg, tables, shape, path), files, lay, id_col)
        first = ctx.worker_world_ranks[0]
    return world.bcast(answer, root=first)


def predict(cfg, path, out: Output, labelled: str = "auto", part_lines: int = 0) -> dict:
    """Score ``cfg.data.path`` with checkpoint ``path`` into ``out``; returns the summary (rows,
    parts written, seconds) on every rank. Collective over ``MPI.COMM_WORLD``."""
    t0 = time.perf_counter()

    def work(ctx, model, files, lay, id_col):
        parts = plan_parts(files, part_lines)
        starts = np.cumsum([0] + [f.lines for f in files])
        W, w, comm = ctx.num_workers, ctx.worker_rank, ctx.worker_comm
        out.begin({"checkpoint": str(path.resolve()), "inputs": [[f.path, f.lines] for f in files],
                   "part_lines": part_size(files, part_lines), "format": out.fmt}, w == 0)
        comm.Barrier()
        reader, stats = LineReader(files), {"skipped_lines": 0}
        rows, written, t_parts = {}, 0, time.perf_counter()
        for i in range(w, len(parts), W):
            if out.done(i):
                rows[i] = out.rows(i)
                continue
            rows[i] = out.write(i, _score_part(model, reader, files, parts[i], lay, id_col, starts, cfg, stats))
            written += 1
        reader.close()
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


def _score_part(model, reader, files, part, lay, id_col, starts, cfg, stats) -> dict:
    """One part's output columns: ``line`` (the sample's data line in the whole input, 0-based),
    ``id`` (``data.id``'s value, where the input has it), ``label`` (where it has one) and
    ``probability``. Local."""
    cols = {"line": [], "id": [], "label": [], "probability": []}
    for dense, keys, labels, lines, ids in read_part(reader, files, part, lay, id_col, cfg.data.skip_bad_lines, stats):
        cols["line"].append(lines + starts[part[0]])
        cols["id"] += ids or []
        if labels is not None:
            cols["label"].append(labels.astype(np.int8))
        cols["probability"].append(model.scores(dense, keys))
    cat = lambda xs, dtype: np.concatenate(xs) if xs else np.zeros(0, dtype)   # noqa: E731
    table = {"line": cat(cols["line"], np.int64)}
    if id_col is not None:
        table["id"] = cols["id"]
    if lay.label >= 0:
        table["label"] = cat(cols["label"], np.int8)
    table["probability"] = cat(cols["probability"], np.float32)
    return table
