"""Score raw lines with a model exported by ``hpcps ckpt export CKPT --format serving --out DIR``,
in a process with torch, numpy and h5py alone (no hpcps, no MPI): what a server does.

    python examples/serve.py DIR data.csv[.gz] [--batch 4096]   # prints one probability per line

``DIR/tables.h5`` is mapped, not read: each table's sorted ``ids`` and its ``rows`` are contiguous
datasets, so ``numpy.memmap`` at the dataset's file offset reads only the pages a lookup touches
(a table larger than memory serves from the page cache). ``DIR/dense.pt`` hashes the raw values
(``model.ids``) and runs the dense part on the rows (``model(dense, rows)``). The input has a header
naming the training columns (the label may be missing), or the training input's columns in order.
"""

import argparse
import csv
import gzip
import json
from pathlib import Path

import h5py
import numpy as np
import torch


class Tables:
    """Every table of ``tables.h5`` mapped read-only; :meth:`lookup` gives the rows of some ids."""

    def __init__(self, path):
        self.maps = {}
        with h5py.File(path, "r") as f:
            for name, g in f["tables"].items():
                self.maps[name] = [np.memmap(path, g[k].dtype, "r", g[k].id.get_offset(), g[k].shape)
                                   for k in ("ids", "rows")]

    def lookup(self, name: str, ids: np.ndarray) -> torch.Tensor:
        keys, rows = self.maps[name]
        pos = np.minimum(np.searchsorted(keys, ids), len(keys) - 1)
        found = keys[pos] == ids                       # an id the table lacks looks up zeros
        out = np.zeros((len(ids), rows.shape[1]), np.float32)
        out[found] = rows[pos[found]]
        return torch.from_numpy(out)


def read_lines(path: Path, info: dict):
    """The file's lines as dicts by column name: by its header, else by the training columns."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", newline="") as f:
        lines = list(csv.reader(f, delimiter=info["delimiter"]))
    names = info["columns"]
    if lines and set(info["categorical"]) <= set(lines[0]):
        names, lines = lines[0], lines[1:]
    elif lines and len(lines[0]) == len(names) - 1 and info["label"] is not None:
        names = [n for n in names if n != info["label"]]            # lines without the label
    return [dict(zip(names, x)) for x in lines]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path, help="the directory --format serving wrote")
    ap.add_argument("data", type=Path, help="a file of raw lines (csv or criteo, .gz allowed)")
    ap.add_argument("--batch", type=int, default=4096)
    a = ap.parse_args()
    info = json.loads((a.model / "serving.json").read_text())
    model = torch.jit.load(str(a.model / "dense.pt"))
    tables = Tables(a.model / "tables.h5")
    lines = read_lines(a.data, info)
    for s in range(0, len(lines), a.batch):
        batch = lines[s:s + a.batch]
        dense = torch.tensor([[float(x.get(n) or 0) for n in info["dense"]] for x in batch]).reshape(len(batch), -1)
        ids = model.ids([[x.get(n, "") for x in batch] for n in info["categorical"]])
        rows = [tables.lookup(name, ids[c].numpy()) for name, c in zip(model.tables, model.table_columns)]
        with torch.no_grad():
            print("\n".join(repr(p) for p in model(dense, rows).tolist()))


if __name__ == "__main__":
    main()
