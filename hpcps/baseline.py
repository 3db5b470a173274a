"""The simple baseline of a config's data, trained on the same split as ``hpcps train``: hashed
logistic regression for CTR (one weight per table row and per dense feature, L2, full-batch
L-BFGS, the objective of scikit-learn's ``LogisticRegression(C)``), the biases of users and items
for ratings (Surprise's ``BaselineOnly``: alternating least squares, ``reg_u`` 15, ``reg_i`` 10,
10 passes). A model that does not beat it on eval is not worth its embedding tables. Local: one
process, no MPI."""

import time

import numpy as np
import torch

from .data import make_data
from .metrics import auc, logloss, mae, rmse

__all__ = ["run_baseline"]

SYNTHETIC_BATCHES = 200          # synthetic data is endless: the baseline trains on this many global batches


def _train_set(data, cfg):
    """Every training sample once (file data: what an epoch of ``hpcps train`` visits)."""
    if hasattr(data, "train_pass"):
        b = data.train_pass()
        return b.dense, b.sparse, b.labels
    n = data.steps_per_epoch or min(SYNTHETIC_BATCHES, cfg.job.steps)
    parts = [data.train_batch(s) for s in range(n)]
    return (np.concatenate([b.dense for b in parts]), [np.concatenate(x) for x in zip(*(b.sparse for b in parts))],
            np.concatenate([b.labels for b in parts]))


def _eval_set(data):
    parts = list(data.eval_batches())
    return (np.concatenate([b.dense for b in parts]), [np.concatenate(x) for x in zip(*(b.sparse for b in parts))],
            np.concatenate([b.labels for b in parts]))


def logistic_regression(data, cfg, c: float = 0.1, iters: int = 200) -> dict:
    """Hashed logistic regression on the training pass; eval AUC and logloss. Local."""
    dense, sparse, y = _train_set(data, cfg)
    offsets = np.cumsum([0] + [rows for _, rows in data.tables])[:-1]

    def features(dense, sparse):
        ids = torch.from_numpy(np.stack([s + o for s, o in zip(sparse, offsets)], axis=1))
        return torch.from_numpy(dense.astype(np.float32)), ids

    total = int(sum(rows for _, rows in data.tables))
    torch.manual_seed(cfg.job.seed)
    emb = torch.zeros(total, requires_grad=True)
    lin = torch.zeros(dense.shape[1] + 1, requires_grad=True)
    xd, xs = features(dense, sparse)
    target = torch.from_numpy(y.astype(np.float32))
    l2 = 1.0 / (c * y.size)                  # sklearn: C * sum(loss) + |w|^2 / 2, divided by C * n
    opt = torch.optim.LBFGS([emb, lin], max_iter=iters, history_size=20, line_search_fn="strong_wolfe")

    def logits(xd, xs):
        return emb[xs].sum(dim=1) + xd @ lin[:-1] + lin[-1]

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits(xd, xs), target)
        loss = loss + 0.5 * l2 * (emb.pow(2).sum() + lin[:-1].pow(2).sum())
        loss.backward()
        return loss

    opt.step(closure)
    ed, es, ey = _eval_set(data)
    with torch.no_grad():
        s = logits(*features(ed, es)).numpy()
    return {"model": f"hashed logistic regression (L2, C={c})", "auc": auc(ey, s),
            "logloss": logloss(ey, 1 / (1 + np.exp(-s))), "train_samples": int(y.size), "eval_samples": int(ey.size)}


def biases(data, cfg, reg_u: float = 15.0, reg_i: float = 10.0, passes: int = 10) -> dict:
    """Global mean plus user and item biases by alternating least squares; eval RMSE and MAE. Local."""
    _, (users, items), r = _train_set(data, cfg)
    (_, nu), (_, ni) = data.tables
    mu = float(r.mean())
    bu, bi = np.zeros(nu), np.zeros(ni)
    n_u, n_i = np.bincount(users, minlength=nu), np.bincount(items, minlength=ni)
    for _ in range(passes):
        bi = np.bincount(items, r - mu - bu[users], minlength=ni) / (reg_i + n_i)
        bu = np.bincount(users, r - mu - bi[items], minlength=nu) / (reg_u + n_u)
    _, (eu, ei), ey = _eval_set(data)
    pred = mu + bu[eu] + bi[ei]
    return {"model": f"biases (ALS, reg_u={reg_u:g}, reg_i={reg_i:g})", "rmse": rmse(ey, pred),
            "mae": mae(ey, pred), "train_samples": int(r.size), "eval_samples": int(ey.size)}


def run_baseline(cfg, c: float = 0.1) -> dict:
    """The baseline of ``cfg``'s data and split. Local."""
    t0 = time.perf_counter()
    data = make_data(cfg.data, cfg.job.seed, 1, 0)
    res = logistic_regression(data, cfg, c) if data.task == "ctr" else biases(data, cfg)
    return {**res, "data": cfg.data.format, "seconds": round(time.perf_counter() - t0, 2)}
