"""The loss of a step, evaluation over every worker's eval shard, and the weights' export."""

import numpy as np
import torch
from mpi4py import MPI

from ..core.metrics import auc, logloss, mae, rmse
from ..models import embedding_penalty
from .best import save_arrays

__all__ = ["step_loss", "evaluate", "export_weights"]


def _inputs(batch, device):
    dense = torch.from_numpy(batch.dense)
    if device.type != "cpu":
        dense = dense.to(device, non_blocking=True)
    return dense, [torch.from_numpy(s) for s in batch.sparse]


def step_loss(model, batch, task: str, global_batch: int, scale: float, device=torch.device("cpu"),
              embedding_l2: float = 0.0):
    """Forward one batch; returns (loss to backward, summed per-sample loss). The loss to backward
    adds ``embedding_l2`` times the looked-up rows' sum of squares (``model.embedding_l2``); the
    summed loss is the data's alone. Local."""
    out = model(*_inputs(batch, device))
    y = torch.from_numpy(batch.labels).to(device)
    if task == "ctr":
        total = torch.nn.functional.binary_cross_entropy_with_logits(out, y, reduction="sum")
    else:
        total = torch.nn.functional.mse_loss(out, y, reduction="sum")
    objective = total + embedding_l2 * embedding_penalty(model) if embedding_l2 else total
    return objective * (scale / global_batch), float(total.detach())


def evaluate(model, data, comm: MPI.Comm, device=torch.device("cpu")) -> dict:
    """Eval metrics over every worker's eval shard, on worker 0 (others get ``{}``). Collective over
    the worker communicator."""
    scores, labels, truth = [], [], []
    was_training = model.training
    model.eval()                                    # no dropout
    with torch.no_grad():
        for b in data.eval_batches():
            out = model(*_inputs(b, device))
            scores.append(out.cpu().numpy())
            labels.append(b.labels)
            if b.truth is not None:
                truth.append(b.truth)
    model.train(was_training)
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0)  # noqa: E731
    parts = comm.gather((cat(scores), cat(labels), cat(truth)), root=0)
    if comm.Get_rank() != 0:
        return {}
    s = np.concatenate([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts])
    t = np.concatenate([p[2] for p in parts])
    if not y.size:                                  # nothing held out (data.eval_fraction = 0, no eval_path)
        return {"eval_samples": 0}
    if data.task == "ctr":
        p = 1 / (1 + np.exp(-s))
        res = {"auc": auc(y, s), "logloss": logloss(y, p), "eval_samples": int(y.size)}
        if t.size:
            res["planted_auc"] = auc(y, t)
            res["planted_logloss"] = logloss(y, t)
        return res
    return {"rmse": rmse(y, s), "mae": mae(y, s), "eval_samples": int(y.size)}


def export_weights(path: str, model, tables) -> None:
    """Worker 0: dense state and every table's rows (global-id order) to one .npz. Local."""
    arrays = {f"dense/{k}": v.detach().cpu().numpy() for k, v in model.state_dict().items()}
    for t in tables:
        rows = np.empty((t.num_rows, t.dim), np.float32)
        for s in range(0, t.num_rows, 1 << 16):
            ids = np.arange(s, min(t.num_rows, s + (1 << 16)))
            rows[ids] = t.pull(ids, full=True)
        for name, first, n in t.logical:        # a table-batched table: its feature tables, apart
            arrays[f"tables/{name}"] = rows[first:first + n]
    save_arrays(path, arrays)
