"""Score raw lines with a model exported by ``hpcps ckpt export CKPT --format serving --out DIR``,
in a process with torch, numpy and h5py alone (no hpcps, no MPI): what a server does.

    python examples/serve.py DIR data.csv[.gz|.bz2] [--batch 4096]   # prints one probability per line

``DIR/tables.h5`` is mapped, not read: each table's sorted ``ids`` and its ``rows`` are contiguous
datasets, so ``numpy.memmap`` at the dataset's file offset reads only the pages a lookup touches
(a table larger than memory serves from the page cache). ``DIR/dense.pt`` hashes the raw values
(``model.ids``) and runs the dense part on the rows (``model(dense, rows)``). The input is read by
``hpcps predict``'s rule: a header naming the training columns in any order (the label may be
missing), or the training input's columns in training's order; the model refuses the values predict
refuses (NaN, non-hex Criteo values, ...), and each refusal is one line naming the column, exit 2.
"""

import argparse
import bz2
import csv
import gzip
import json
import sys
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


def fail(message: str):
    """One line on stderr, exit 2: what hpcps predict does with the same input."""
    print(f"serve.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def read_lines(path: Path, info: dict):
    """The file's lines as dicts by column name, by predict's rule: a header naming the training
    columns (any order; the label may be missing), else lines of the training columns in training's
    order (the label may be left out). Anything else is an error naming what is missing."""
    opener = {".gz": gzip.open, ".bz2": bz2.open}.get(path.suffix, open)
    try:
        with opener(path, "rt", newline="") as f:
            lines = list(csv.reader(f, delimiter=info["delimiter"]))
    except (OSError, EOFError, UnicodeDecodeError) as e:
        fail(f"{path}: cannot read it ({e})")
    names, needed = info["columns"], info["categorical"] + info["dense"]
    if lines and set(lines[0]) & set(names):                        # a header line
        missing = [n for n in needed if n not in lines[0]]
        if missing:
            fail(f"{path}: its header has no column {', '.join(missing[:6])} (the model reads "
                 f"{len(needed)} columns by name: {', '.join(needed[:6])}, ...)")
        names, lines = lines[0], lines[1:]
    elif lines and len(lines[0]) == len(names) - 1 and info["label"] is not None:
        names = [n for n in names if n != info["label"]]            # lines without the label
    elif lines and len(lines[0]) != len(names):
        fail(f"{path}: no header line, and {len(lines[0])} fields a line where training read {len(names)} "
             f"({', '.join(names[:6])}, ...): give a header naming the columns, or training's columns in its order")
    bad = next((i for i, x in enumerate(lines) if len(x) != len(names)), None)
    if bad is not None:
        fail(f"{path}: data line {bad + 1} has {len(lines[bad])} fields, not {len(names)}")
    return [dict(zip(names, x)) for x in lines]


def number(x: str, name: str, line: int) -> float:
    try:
        return float(x or 0)                                        # missing: 0, as the readers
    except ValueError:
        fail(f"data line {line + 1}: column {name} is not a number: {x[:40]!r}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path, help="the directory --format serving wrote")
    ap.add_argument("data", type=Path, help="a file of raw lines (csv or criteo; .gz and .bz2 allowed)")
    ap.add_argument("--batch", type=int, default=4096, help="lines a call (>= 1)")
    a = ap.parse_args()
    if a.batch < 1:
        fail(f"--batch {a.batch}: must be >= 1")
    info = json.loads((a.model / "serving.json").read_text())
    model = torch.jit.load(str(a.model / "dense.pt"))
    tables = Tables(a.model / "tables.h5")
    lines = read_lines(a.data, info)
    for s in range(0, len(lines), a.batch):
        batch = lines[s:s + a.batch]
        dense = torch.tensor([[number(x[n], n, s + i) for n in info["dense"]] for i, x in enumerate(batch)],
                             dtype=torch.float64).reshape(len(batch), -1)
        try:                                  # the model refuses what predict refuses, naming the column
            ids = model.ids([[x[n] for x in batch] for n in info["categorical"]])
            rows = [tables.lookup(name, ids[c].numpy()) for name, c in zip(model.tables, model.table_columns)]
            with torch.no_grad():
                p = model(dense, rows)
        except torch.jit.Error as e:
            fail(f"lines {s + 1}-{s + len(batch)}: {str(e).strip().splitlines()[-1].split('Error: ', 1)[-1]}")
        print("\n".join(repr(x) for x in p.tolist()))


if __name__ == "__main__":
    main()
