"""``hpcps evaluate``: metrics of checkpoints on labelled files, as an MPI job (one scoring job per
checkpoint, :func:`hpcps.predict.job.scoring_job`)."""

import time

import numpy as np

from ..checkpoint import read_manifest
from ..core.metrics import auc, logloss, mae, rmse
from .inputs import plan_parts, tail_parts
from .reading import read_parts

__all__ = ["evaluate_checkpoint", "calibration", "metrics"]


def calibration(y: np.ndarray, p: np.ndarray) -> float:
    """Mean prediction over the mean label (the observed click rate; the mean rating): 1 is
    calibrated. Local."""
    rate = float(np.mean(y)) if y.size else float("nan")
    return float(np.mean(p)) / rate if rate > 0 else float("nan")


def metrics(y: np.ndarray, p: np.ndarray, task: str) -> dict:
    """CTR: AUC, logloss, RMSE and MAE of the probabilities, calibration; ratings: RMSE, MAE and
    calibration (mean predicted over mean observed rating). Local."""
    if not y.size:
        raise ValueError("no labelled samples to evaluate")
    out = {"rmse": rmse(y, p), "mae": mae(y, p), "calibration": calibration(y, p)}
    out = {"auc": auc(y, p), "logloss": logloss(y, p), **out} if task == "ctr" else out
    undefined = [k for k, v in out.items() if not np.isfinite(v)]
    if undefined:                       # strict JSON: null, and why
        rate = float(np.mean(y))
        why = (f"every label is {rate:g}: AUC needs both classes" if task == "ctr" and rate in (0.0, 1.0)
               else "the mean label is 0" if rate == 0 else "not finite")
        out = {**{k: (None if k in undefined else v) for k, v in out.items()}, "undefined": {k: why for k in undefined}}
    return out


def evaluate_checkpoint(cfg, path, part_lines: int = 0, tail: float = 0.0) -> dict:
    """:func:`metrics` of checkpoint ``path`` on ``cfg.data.path`` (which must have the label
    column), or on its last ``tail`` of lines (the held-out split: :func:`hpcps.predict.inputs.held_out`);
    on every rank. Collective over ``MPI.COMM_WORLD``."""
    from .job import scoring_job
    t0 = time.perf_counter()

    def work(ctx, model, files, lay, id_col, child):
        parts = plan_parts(files, part_lines)
        if tail:
            parts = tail_parts(files, parts, tail)
        w, W = ctx.worker_rank, ctx.num_workers
        stats, ys, ps = {"skipped_lines": 0}, [], []
        for _, block in read_parts(files, parts, range(w, len(parts), W), lay, None, cfg.data.skip_bad_lines, stats, child):
            if block is not None:
                ys.append(block[2])
                ps.append(model.scores(block[0], block[1]))
        cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.float32)    # noqa: E731
        got = ctx.worker_comm.gather((cat(ys), cat(ps), stats["skipped_lines"]), root=0)
        if w != 0:
            return None
        y = np.concatenate([g[0] for g in got]).astype(np.float64)
        p = np.concatenate([g[1] for g in got]).astype(np.float64)
        return {**metrics(y, p, model.task), "samples": int(y.size), "skipped_lines": sum(g[2] for g in got)}

    res = scoring_job(cfg, path, "yes", work)
    return {"checkpoint": str(path), "step": int(read_manifest(path)["step"]), **res, "data": cfg.data.path,
            "split": f"the last {tail:g} (held out)" if tail else "all", "seconds": round(time.perf_counter() - t0, 3)}
