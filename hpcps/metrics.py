"""Evaluation metrics and the JSONL metrics log."""

import json
import math
import time
from pathlib import Path

import numpy as np

__all__ = ["auc", "logloss", "rmse", "mae", "MetricsLog"]


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


class MetricsLog:
    """Append one JSON object per line to ``path`` (no-op when empty). Local (worker 0)."""

    def __init__(self, path: str):
        self._f = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._f = open(path, "a", buffering=1)
        self.t0 = time.time()

    def write(self, record: dict) -> None:
        if self._f:
            self._f.write(json.dumps({"time": round(time.time() - self.t0, 4), **record}) + "\n")

    def close(self) -> None:
        if self._f:
            self._f.close()
            self._f = None
