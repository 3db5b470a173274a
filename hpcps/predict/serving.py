"""A trained model in one process with torch alone: the model of a config over plain
``torch.nn.EmbeddingBag`` tables holding exported rows (``job.export``, ``hpcps ckpt export``).
Local; imports no MPI."""

import numpy as np
import torch

from ..train.build import build_model
from ..train.tables import table_specs

__all__ = ["torch_model", "torch_scores"]


def torch_model(cfg, shape, arrays) -> torch.nn.Module:
    """The model ``cfg`` describes over ``shape``'s tables, its rows and dense weights from
    ``arrays`` (``{"tables/NAME": rows, "dense/KEY": array}``, an export's). Local."""
    embs = []
    for name, rows, dim, *_ in table_specs(cfg, shape):
        w = np.asarray(arrays[f"tables/{name}"], np.float32)
        if w.shape != (rows, dim):
            raise ValueError(f"table {name}: {w.shape} in the export, ({rows}, {dim}) in the config")
        embs.append(torch.nn.EmbeddingBag.from_pretrained(torch.from_numpy(w.copy()), freeze=True, mode="sum"))
    model = build_model(cfg, embs, shape)
    dense = {k[len("dense/"):]: torch.from_numpy(np.asarray(arrays[k])) for k in arrays if k.startswith("dense/")}
    missing, unexpected = model.load_state_dict(dense, strict=False)
    tables = {n for n, p in model.named_parameters() if any(p is e.weight for e in embs)}
    if unexpected or set(missing) - tables:
        raise ValueError(f"the export's dense weights do not fit the config's model: missing "
                         f"{sorted(set(missing) - tables)[:4]}, unexpected {sorted(unexpected)[:4]}")
    return model.eval()


def torch_scores(model, dense: np.ndarray, keys: np.ndarray, task: str = "ctr") -> np.ndarray:
    """Click probabilities (``task`` ctr) or ratings of parsed samples (``keys``: (n, tables) row
    ids). Local."""
    with torch.no_grad():
        out = model(torch.from_numpy(dense), [torch.from_numpy(np.ascontiguousarray(keys[:, t]))
                                             for t in range(keys.shape[1])])
    return (out if task == "ratings" else torch.sigmoid(out)).numpy()
