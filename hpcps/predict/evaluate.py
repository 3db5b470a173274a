"""``hpcps evaluate``: metrics of checkpoints on labelled files, as an MPI job (one scoring job per
checkpoint, :func:`hpcps.predict.job.scoring_job`)."""

import time

import numpy as np

from ..checkpoint import read_manifest
from ..data.textfiles import LineReader
from ..metrics import auc, logloss
from .inputs import plan_parts, read_part

__all__ = ["evaluate_checkpoint", "calibration"]


def calibration(y: np.ndarray, p: np.ndarray) -> float:
    """Mean predicted probability over the observed click rate (1: calibrated). Local."""
    rate = float(np.mean(y)) if y.size else float("nan")
    return float(np.mean(p)) / rate if rate > 0 else float("nan")


def evaluate_checkpoint(cfg, path, part_lines: int = 0) -> dict:
    """AUC, logloss and calibration of checkpoint ``path`` on ``cfg.data.path`` (which must have
    the label column); on every rank. Collective over ``MPI.COMM_WORLD``."""
    from .job import scoring_job
    t0 = time.perf_counter()

    def work(ctx, model, files, lay, id_col):
        parts = plan_parts(files, part_lines)
        w, W = ctx.worker_rank, ctx.num_workers
        reader, stats, ys, ps = LineReader(files), {"skipped_lines": 0}, [], []
        for i in range(w, len(parts), W):
            for dense, keys, labels, _, _ in read_part(reader, files, parts[i], lay, None, cfg.data.skip_bad_lines, stats):
                ys.append(labels)
                ps.append(model.scores(dense, keys))
        reader.close()
        cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.float32)    # noqa: E731
        got = ctx.worker_comm.gather((cat(ys), cat(ps), stats["skipped_lines"]), root=0)
        if w != 0:
            return None
        y = np.concatenate([g[0] for g in got]).astype(np.float64)
        p = np.concatenate([g[1] for g in got]).astype(np.float64)
        return {"auc": auc(y, p), "logloss": logloss(y, p), "calibration": calibration(y, p),
                "samples": int(y.size), "skipped_lines": sum(g[2] for g in got)}

    res = scoring_job(cfg, path, "yes", work)
    return {"checkpoint": str(path), "step": int(read_manifest(path)["step"]), **res,
            "seconds": round(time.perf_counter() - t0, 3)}
