"""Criteo display-ads format: ``label \\t I1..I13 \\t C1..C26`` per line.

Lines with fewer than 40 fields (trailing empty fields stripped, as in some
copies of the data set) are padded with empty fields. Integer features may
be empty (0) and are log-transformed (``log1p(max(x, 0))``);
categorical features are hex strings (or empty) hashed into each table's
rows: ``splitmix64(value ^ column key) % rows``.
"""

import re

import numpy as np

from ..core.ids import splitmix64
from .files import read_lines

__all__ = ["parse_criteo", "load_criteo", "NUM_INT", "NUM_CAT"]

NUM_INT, NUM_CAT = 13, 26
_EMPTY = 0xFFFF_FFFF_FFFF  # the hash input of an empty categorical field
_HEX = re.compile(r"[0-9a-fA-F]{1,16}")


def parse_criteo(line: str):
    """One line -> (label, ints[13], cat values[26] as ints). Raises ValueError. Local."""
    f = line.split("\t")
    if not 2 <= len(f) <= 1 + NUM_INT + NUM_CAT:
        raise ValueError(f"expected {1 + NUM_INT + NUM_CAT} tab-separated fields, got {len(f)}")
    f += [""] * (1 + NUM_INT + NUM_CAT - len(f))
    if f[0] not in ("0", "1"):
        raise ValueError(f"label must be 0 or 1, got {f[0]!r}")
    ints = []
    for k, x in enumerate(f[1:1 + NUM_INT]):
        try:
            ints.append(int(x) if x else 0)
        except ValueError:
            raise ValueError(f"integer feature I{k + 1} is not an integer: {x!r}") from None
    cats = []
    for k, x in enumerate(f[1 + NUM_INT:]):
        if x and not _HEX.fullmatch(x):
            raise ValueError(f"categorical feature C{k + 1} is not a hex value of at most 64 bits "
                             f"(1-16 hex digits): {x[:40]!r}")
        cats.append(int(x, 16) if x else _EMPTY)
    return int(f[0]), ints, cats


def hash_categoricals(cats: np.ndarray, rows: int) -> list:
    """(n, 26) raw values -> [ids (n,) per column] in ``[0, rows)``. Local."""
    out = []
    for c in range(cats.shape[1]):
        key = np.uint64((c + 1) * 0x9E3779B97F4A7C15 % (1 << 64))
        h = splitmix64(cats[:, c].astype(np.uint64) ^ key)
        out.append((h % np.uint64(rows)).astype(np.int64))
    return out


def _arrays(records, rows):
    if not records:
        return np.zeros((0, NUM_INT), np.float32), [np.zeros(0, np.int64)] * NUM_CAT, np.zeros(0, np.float32)
    labels = np.array([r[0] for r in records], np.float32)
    ints = np.array([r[1] for r in records], np.float64)
    dense = np.log1p(np.maximum(ints, 0)).astype(np.float32)
    cats = np.array([r[2] for r in records], np.uint64)
    return dense, hash_categoricals(cats, rows), labels


def load_criteo(path, eval_path, eval_fraction, rows, skip_bad, stats):
    """Train and eval arrays ``(dense, sparse, labels)``. Local."""
    train = read_lines(path, parse_criteo, skip_bad, stats)
    if eval_path:
        evaluation = read_lines(eval_path, parse_criteo, skip_bad, stats, key="data.eval_path")
    else:
        cut = len(train) - int(round(len(train) * eval_fraction))
        train, evaluation = train[:cut], train[cut:]
    return _arrays(train, rows), _arrays(evaluation, rows)
