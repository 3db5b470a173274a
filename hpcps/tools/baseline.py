"""The simple baseline of a config's data, trained on the same split as ``hpcps train``: hashed
logistic regression for CTR (one weight per table row and per dense feature, L2, full-batch
L-BFGS, the objective of scikit-learn's ``LogisticRegression(C)``), the biases of users and items
for ratings (Surprise's ``BaselineOnly``: alternating least squares, ``reg_u`` 15, ``reg_i`` 10,
10 passes). A model that does not beat it on eval is not worth its embedding tables. Local: one
process, no MPI."""

import logging
import time

import numpy as np
import torch

from ..data import make_data
from ..core.metrics import auc, logloss, mae, rmse

__all__ = ["run_baseline"]

logger = logging.getLogger(__name__)

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


def _columns(sparse, offsets) -> np.ndarray:
    """Each sample's global row ids over the concatenated tables, (n, tables) int64."""
    return np.stack([np.asarray(x, np.int64) + o for x, o in zip(sparse, offsets)], axis=1)


def logistic_regression(data, cfg, c: float = 0.1, iters: int = 200, chunk: int = 20) -> dict:
    """Hashed logistic regression on the training pass; eval AUC and logloss. Local.

    Only the rows the training pass uses get a weight: a row no sample has keeps weight 0 at the
    optimum of the L2-regularised objective, so the solution is the one over every row of every
    table, found in a fraction of the time (L-BFGS's vector work is over the rows used, not the
    ``hash_rows`` of every table). An eval id never trained on scores 0. Progress is logged every
    ``chunk`` iterations (one L-BFGS, resumed: the same iterates as one call)."""
    t0 = time.perf_counter()
    dense, sparse, y = _train_set(data, cfg)
    offsets = np.cumsum([0] + [rows for _, rows in data.tables])[:-1]
    used, inverse = np.unique(_columns(sparse, offsets), return_inverse=True)
    xs = torch.from_numpy(inverse.reshape(y.size, -1).astype(np.int64))
    logger.info("hpcps: baseline: %d training samples, %d of the tables' %d rows used (%.1f s); L-BFGS, C=%g, "
                "up to %d iterations", y.size, used.size, int(sum(r for _, r in data.tables)),
                time.perf_counter() - t0, c, iters)
    torch.manual_seed(cfg.job.seed)
    emb = torch.zeros(used.size + 1, requires_grad=True)       # the last: every row not trained on
    lin = torch.zeros(dense.shape[1] + 1, requires_grad=True)
    xd = torch.from_numpy(dense.astype(np.float32))
    target = torch.from_numpy(y.astype(np.float32))
    l2 = 1.0 / (c * y.size)                  # sklearn: C * sum(loss) + |w|^2 / 2, divided by C * n
    opt = torch.optim.LBFGS([emb, lin], max_iter=iters, history_size=20, line_search_fn="strong_wolfe")

    def logits(xd, xs):
        return emb[xs].sum(dim=1) + xd @ lin[:-1] + lin[-1]

    def objective():
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits(xd, xs), target)
        return loss + 0.5 * l2 * (emb.pow(2).sum() + lin[:-1].pow(2).sum())

    def closure():
        opt.zero_grad()
        loss = objective()
        loss.backward()
        return loss

    state, group, evals = opt.state[emb], opt.param_groups[0], iters * 5 // 4     # torch's max_eval of one call
    while state.get("n_iter", 0) < iters and state.get("func_evals", 0) < evals:
        before = state.get("n_iter", 0)
        group["max_iter"], group["max_eval"] = min(chunk, iters - before), evals - state.get("func_evals", 0)
        opt.step(closure)
        with torch.no_grad():
            loss = float(objective())
        logger.info("hpcps: baseline: iteration %d/%d, objective %.6f (%.1f s)", state.get("n_iter", 0), iters,
                    loss, time.perf_counter() - t0)
        if state.get("n_iter", 0) - before < group["max_iter"] and state.get("func_evals", 0) < evals:
            break                                                     # converged
    ed, es, ey = _eval_set(data)
    cols = _columns(es, offsets)
    at = np.minimum(np.searchsorted(used, cols), used.size - 1)
    eval_xs = torch.from_numpy(np.where(used[at] == cols, at, used.size))
    with torch.no_grad():
        s = logits(torch.from_numpy(ed.astype(np.float32)), eval_xs).numpy()
    return {"model": f"hashed logistic regression (L2, C={c})", "auc": auc(ey, s),
            "logloss": logloss(ey, 1 / (1 + np.exp(-s))), "train_samples": int(y.size), "eval_samples": int(ey.size),
            "iterations": int(state.get("n_iter", 0))}


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
