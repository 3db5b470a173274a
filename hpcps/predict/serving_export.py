"""``hpcps ckpt export PATH --format serving --out DIR``: a model whose tables are too large for one
process, for a server: ``DIR/dense.pt``, the dense part as TorchScript, and ``DIR/tables.h5``, every
table as sorted ids and rows (:mod:`hpcps.checkpoint.serving`). A process with torch, numpy and
h5py serves it (``examples/serve.py``):

    model = torch.jit.load("DIR/dense.pt")
    ids = model.ids(categorical)               # the readers' row id of each value, per column
    rows = [lookup(tables[name], ids[c])       # a (n, dim) tensor per table: sorted ids -> rows
            for name, c in zip(model.tables, model.table_columns)]
    p = model(dense, rows)                     # click probabilities

``model.tables`` names the tables in the order the model takes their rows, ``model.table_columns``
the categorical column (of ``model.categorical_names``) whose ids each one looks up. Local.
"""

import json
from pathlib import Path
from typing import List

import torch

from .torchscript import RawColumns, checked_source, hashing, script_save, trace

__all__ = ["export_serving", "ServedDense"]


class _GivenRows(torch.nn.Module):
    """A part's lookup whose rows come with the call: ``rows[first:first + count]`` stacked into
    ``(n, count, dim)``, what the part's lookup gives in training."""

    def __init__(self, first: int, count: int):
        super().__init__()
        self.first, self.count = first, count

    def forward(self, rows: List[torch.Tensor]) -> torch.Tensor:
        return torch.stack(rows[self.first:self.first + self.count], dim=1)


class ServedDense(RawColumns):
    """``ids(categorical)`` as :class:`RawColumns`; ``forward(dense, rows)``: raw dense values and
    the looked-up rows of each table (``tables``' order) -> click probabilities."""

    tables: List[str]
    table_columns: List[int]
    column_keys: List[int]              # RawColumns' (TorchScript reads a class's own annotations)
    categorical_names: List[str]
    dense_names: List[str]

    def __init__(self, model, tables: List[str], table_columns: List[int], *hashing_args):
        super().__init__(model, *hashing_args)
        self.tables, self.table_columns = tables, table_columns

    def forward(self, dense: torch.Tensor, rows: List[torch.Tensor]) -> torch.Tensor:
        if len(rows) != len(self.tables):
            raise ValueError("expected one (n, dim) tensor of rows per table (model.tables)")
        self.check_dense(dense)
        x = dense.to(torch.float32)
        if self.dense_log:
            x = torch.log1p(torch.clamp(x, min=0.0))
        return torch.sigmoid(self.model(x, rows))


def export_serving(path, out) -> Path:
    """Checkpoint ``path`` as the directory ``out`` (``dense.pt``, ``tables.h5``, ``serving.json``:
    the tables, their rows and dims, the training input's columns and delimiter); ``out`` must not exist or be empty. Returns
    ``out``. Local."""
    import numpy as np

    from ..checkpoint.shards import read_dense
    from ..checkpoint.serving import write_sorted_tables
    from ..train.build import build_model
    from ..train.tables import table_parts
    out = Path(out)
    man, cfg, lay, shape = checked_source(path, out, "serving")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out}: exists and is not an empty directory (--format serving writes a directory)")
    lookups, names, columns, at = {}, [], [], 0
    for part, specs in table_parts(cfg, shape):
        lookups[part] = _GivenRows(at, len(specs))
        names += [name for name, *_ in specs]
        columns += list(range(len(specs)))
        at += len(specs)
    model = build_model(cfg, lookups, shape)
    dense, _, _ = read_dense(Path(path) / "dense.h5")
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in dense.items()}, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path}: its dense weights do not fit the model: missing {missing[:4]}, unexpected {unexpected[:4]}")
    model.eval()
    dims = {name: dim for _, specs in table_parts(cfg, shape) for name, _, dim, *_ in specs}
    example = (torch.zeros(3, len(lay.dense)), [torch.zeros(3, dims[n]) for n in names])
    out.mkdir(parents=True, exist_ok=True)
    script_save(ServedDense(trace(model, example), names, columns, *hashing(lay)), out / "dense.pt")
    tables = write_sorted_tables(path, out / "tables.h5", {"step": man["step"], "source": str(Path(path).resolve())})
    if [t[0] for t in tables] != names:
        raise ValueError(f"{path}: its tables {[t[0] for t in tables][:4]} are not the model's {names[:4]}")
    (out / "serving.json").write_text(json.dumps({
        "step": man["step"], "source": str(Path(path).resolve()), "kind": cfg.model.kind,
        "tables": [{"name": n, "rows": r, "dim": d, "column": lay.names[lay.categorical[c]]}
                   for (n, r, d), c in zip(tables, columns)],
        "categorical": [lay.names[c] for c in lay.categorical], "dense": [lay.names[c] for c in lay.dense],
        "columns": lay.names, "delimiter": lay.delimiter, "label": lay.names[lay.label] if lay.label >= 0 else None},
        indent=1))
    return out
