"""Evaluation metrics and the JSONL metrics log."""

import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

__all__ = ["auc", "logloss", "rmse", "mae", "MetricsLog", "tensorboard_scalars"]


def auc(labels, scores) -> float:
    """Area under the ROC curve, ties counted half (Mann-Whitney). Local."""
    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    n1 = float((y == 1).sum())
    n0 = float(y.size - n1)
    if n1 == 0 or n0 == 0:
        return float("nan")
    uniq, inv, counts = np.unique(s, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    avg_rank = ends - (counts - 1) / 2.0                 # 1-based average rank of each tie group
    ranks = avg_rank[inv]
    return float((ranks[y == 1].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def logloss(labels, probs, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy. Local."""
    y = np.asarray(labels, dtype=np.float64)
    p = np.clip(np.asarray(probs, dtype=np.float64), eps, 1 - eps)
    return float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean())


def rmse(y, pred) -> float:
    return float(math.sqrt(np.mean((np.asarray(y, np.float64) - np.asarray(pred, np.float64)) ** 2)))


def mae(y, pred) -> float:
    return float(np.mean(np.abs(np.asarray(y, np.float64) - np.asarray(pred, np.float64))))


def _command() -> str:
    """This process's command line, ``hpcps ...`` for ``python -m hpcps`` (whose argv[0] is a path)."""
    argv = list(sys.argv)
    if argv and argv[0].endswith(("hpcps/__main__.py", "/hpcps")):
        argv[0] = "hpcps"
    return " ".join(argv)


class MetricsLog:
    """Append one JSON object per line to ``path`` (no-op when empty) and, with ``tensorboard`` (a
    directory: ``metrics.tensorboard``), the same figures as TensorBoard scalars through the
    ``tensorboard`` package's writer (``torch.utils.tensorboard``). Local (worker 0)."""

    def __init__(self, path: str, tensorboard: str = ""):
        self._f = None
        self.t0 = time.time()
        # each record names its run: several runs (a resume, another data set) may append to one file
        self.run = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime(self.t0))}-{os.getpid()}"
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._f = open(path, "a", buffering=1)
            self._f.write(json.dumps({"start": {
                "run": self.run, "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.t0)), "unix": round(self.t0, 4),
                "command": _command(), "slurm_job": os.environ.get("SLURM_JOB_ID")}}) + "\n")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(log_dir=tensorboard)

    def write(self, record: dict) -> None:
        if self._f:
            self._f.write(json.dumps({"time": round(time.time() - self.t0, 4), "run": self.run, **record}) + "\n")
        if self._tb is not None:
            for tag, value, step in tensorboard_scalars(record):
                self._tb.add_scalar(tag, value, step)

    def close(self) -> None:
        if self._f:
            self._f.close()
            self._f = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def tensorboard_scalars(record: dict) -> list:
    """``[(tag, value, step)]`` of a metrics record: a step's ``train/...`` figures, time per phase,
    rows and bytes per PS, its evaluation's ``eval/...``; a checkpoint's stall; a monitor record's
    host CPU and memory and PS busy share; the final line's metrics. Local."""
    out = []
    if "final" in record:
        f = record["final"]
        return [(f"final/{k}", float(f[k]), int(f.get("steps", 0))) for k in
                ("auc", "logloss", "rmse", "mae", "samples_per_s") if isinstance(f.get(k), (int, float))]
    if "alert" in record:
        return out
    if "monitor" in record:                          # one host's system figures (hpcps.monitor)
        step, host = int(record["monitor"]), record["host"]
        out = [(f"host/{host}/{k}", float(record[k]), step) for k in ("cpus_used", "mem_used_mb", "rss_max_mb")
               if isinstance(record.get(k), (int, float))]
        return out + [(f"ps{p['ps']}/{k}", float(p[k]), step) for p in record["ps"] for k in ("busy", "mb_s")
                      if p.get(k) is not None]
    if "checkpoint" in record:
        return [(f"checkpoint/{record.get('level', 'pfs')}_stall_s", float(record["stall_s"]), int(record["checkpoint"]))]
    step = record.get("step")
    if step is None:
        return out
    for k in ("loss", "samples_per_s", "pull_ms", "push_ms", "cache_hit_rate"):
        if isinstance(record.get(k), (int, float)):
            out.append((f"train/{k}", float(record[k]), step))
    for k, v in (record.get("time_breakdown_s") or {}).items():
        out.append((f"time_s/{k}", float(v), step))
    for key in ("rows_per_ps", "bytes_per_ps"):
        for p, v in enumerate(record.get(key) or []):
            out.append((f"ps{p}/{key[:-7]}", float(v), step))
    for k, v in (record.get("eval") or {}).items():
        if isinstance(v, (int, float)):
            out.append((f"eval/{k}", float(v), step))
    return out
