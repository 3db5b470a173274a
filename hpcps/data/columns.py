"""Delimited text (CSV, TSV, Criteo) to training arrays: which column is what, and parsing a block of
lines. Local, pure (no MPI).

A block is parsed by pyarrow's CSV reader (one thread: a worker's reader shares its node with
training) and the categorical columns become keys without Python per value
(:mod:`hpcps.data.hashing`). Where the block holds a bad line, a per-line check in Python finds it,
names its file and line, and either raises (quoting the first few) or drops it
(``data.skip_bad_lines``); the rest is parsed again. Fields are split at every delimiter: quoting is
not supported (a field cannot hold the delimiter).
"""

import math
from dataclasses import dataclass

import numpy as np

from .files import BadLine
from ..core.ids import splitmix64
from .hashing import binary_buffers, column_key, decimal_keys, hash_keys, hex_keys, salted_keys

__all__ = ["Layout", "resolve_layout", "criteo_layout", "parse_block", "BadLine", "SHOW_BAD"]

SHOW_BAD = 3                  # bad lines quoted in an error
_LARGEST = 3e38               # a dense value must fit a float32


@dataclass
class Layout:
    """How a line's fields become a sample. Column indices are 0-based."""

    delimiter: str
    ncols: int
    names: list
    label: int                # -1: no label column (input to score)
    dense: list
    categorical: list
    dense_log: bool = False
    keys: str = "hash"        # hash | raw (decimal ids, must be < rows) | hex (Criteo)
    pad: bool = False         # lines with fewer fields get empty ones (Criteo copies strip them)
    rows: int = 1             # keys mod rows; 0: 64-bit keys, salted per column (dynamic tables)
    key_columns: list | None = None   # per categorical, the column number its hash key mixes in (default:
    #                                   where it is; scoring input laid out otherwise keeps training's)

    @property
    def tables(self) -> list:
        return [(self.names[c], self.rows) for c in self.categorical]


# A Criteo copy that strips trailing empty fields still keeps the label, I1-I13 and C1 (never empty
# in Criteo's logs): a line of fewer fields is cut short, a bad line
PAD_MIN = 15


def _pad_min(lay: Layout) -> int:
    return PAD_MIN - (lay.label < 0)                      # lines to score may lack the label


def criteo_layout(rows: int) -> Layout:
    """Criteo's ``label \\t I1..I13 \\t C1..C26``: 13 log-transformed integers, 26 hex
    categoricals. Local."""
    names = ["label"] + [f"I{k}" for k in range(1, 14)] + [f"C{k}" for k in range(1, 27)]
    return Layout("\t", 40, names, 0, list(range(1, 14)), list(range(14, 40)), dense_log=True, keys="hex",
                  pad=True, rows=rows)


def _index(item, names, ncols, key, where):
    if isinstance(item, int) or (isinstance(item, str) and item.strip().isdigit()):
        i = int(item)
        if not 0 <= i < ncols:
            raise ValueError(f"config: {key}: column {i} is out of range: {where} has {ncols} columns (0-based)")
        return i
    if item not in names:
        if names == [str(c) for c in range(ncols)]:
            raise ValueError(f"config: {key}: {item!r} names a column, but {where} has no header line "
                             f"(use 0-based column numbers, or data.header = true)")
        raise ValueError(f"config: {key}: no column {item!r} in the header of {where} "
                         f"(columns: {', '.join(names[:12])}{' ...' if len(names) > 12 else ''})")
    return names.index(item)


def resolve_layout(d, header_fields, ncols: int, where: str) -> Layout:
    """The layout of ``data.format = "csv"`` from the settings ``d`` (a ``DataConfig``) and the
    first file's header fields (None: no header) or column count. ``where`` names that file in
    errors. Local."""
    names = list(header_fields) if header_fields is not None else [str(c) for c in range(ncols)]
    if header_fields is not None and len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"{where}: the header names a column twice: {', '.join(dup)}")
    if str(d.label) == "":
        raise ValueError("config: data.label: data.format = 'csv' needs the label column (a name or a 0-based number)")
    label = _index(d.label, names, ncols, "data.label", where)
    dense = [_index(x, names, ncols, "data.dense", where) for x in d.dense]
    drop = [_index(x, names, ncols, "data.drop", where) for x in d.drop]
    ident = str(getattr(d, "id", ""))
    if ident and (ident in names or (ident.isdigit() and int(ident) < ncols)):   # never a feature
        drop.append(_index(ident, names, ncols, "data.id", where))
    used = {label, *dense, *drop}
    if list(d.categorical) == ["rest"]:
        cats = [c for c in range(ncols) if c not in used]
    else:
        cats = [_index(x, names, ncols, "data.categorical", where) for x in d.categorical]
    seen = [label] + dense + cats
    for c in set(seen):
        if seen.count(c) > 1 or c in drop:
            raise ValueError(f"config: column {names[c]!r} is given two roles (data.label, data.dense, "
                             f"data.categorical, data.drop)")
    if not cats and not dense:
        raise ValueError(f"config: data.categorical and data.dense leave no feature column in {where}")
    names = names if header_fields is not None else [f"c{c}" for c in range(ncols)]
    return Layout(d.delimiter, ncols, names, label, dense, cats, dense_log=d.dense_log, keys=d.keys,
                  rows=d.hash_rows)


# -- the fast path: pyarrow on a whole block ------------------------------------------------------
class _Slow(Exception):
    """The block holds something the fast path does not take: check it line by line."""


def _read(block: bytes, lay: Layout):
    import pyarrow as pa
    import pyarrow.csv as pacsv
    names = [f"f{c}" for c in range(lay.ncols)]
    labelled = [names[lay.label]] if lay.label >= 0 else []
    types = {n: pa.float64() for n in labelled}
    types.update({names[c]: pa.float64() for c in lay.dense})
    types.update({names[c]: pa.binary() for c in lay.categorical})
    keep = labelled + [names[c] for c in lay.dense] + [names[c] for c in lay.categorical]
    try:
        return pacsv.read_csv(
            pa.py_buffer(block),
            read_options=pacsv.ReadOptions(column_names=names, use_threads=False),
            parse_options=pacsv.ParseOptions(delimiter=lay.delimiter, quote_char=False, double_quote=False,
                                             ignore_empty_lines=False),
            convert_options=pacsv.ConvertOptions(column_types=types, include_columns=keep, strings_can_be_null=False,
                                                 null_values=[""], quoted_strings_can_be_null=False))
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise _Slow(str(e)) from None


def _fast(block: bytes, n: int, lay: Layout):
    tab = _read(block, lay)
    if tab.num_rows != n:
        raise _Slow("row count")
    first = int(lay.label >= 0)                           # no label column (scoring): labels NaN
    label = tab.column(0).to_numpy(zero_copy_only=False) if first else np.full(n, np.nan)
    if first and not ((label == 0) | (label == 1)).all():
        raise _Slow("label")
    dense = np.empty((n, len(lay.dense)), np.float32)     # a column at a time in float64
    for k in range(len(lay.dense)):
        col = tab.column(first + k)
        x = col.fill_null(0.0).to_numpy(zero_copy_only=False) if col.null_count else col.to_numpy()
        if not (np.abs(x) <= _LARGEST).all():           # also false for nan and inf
            raise _Slow("dense")
        dense[:, k] = np.log1p(np.maximum(x, 0)) if lay.dense_log else x
    keys = np.empty((n, len(lay.categorical)), np.uint64)
    for k, c in enumerate(lay.categorical):
        off, data = binary_buffers(tab.column(first + len(lay.dense) + k).combine_chunks())
        if lay.keys == "hex":
            v, bad = hex_keys(off, data)
            v ^= column_key(k)
        elif lay.keys == "raw":
            v, bad = decimal_keys(off, data)
            if lay.rows:
                bad |= v >= np.uint64(lay.rows)
            else:                                   # any value: salted, so that columns differ
                v = salted_keys(v.view(np.int64), k).view(np.uint64)
        else:
            v, bad = hash_keys(off, data, column_key(c if lay.key_columns is None else lay.key_columns[k])), None
        if bad is not None and bad.any():
            raise _Slow("categorical")
        keys[:, k] = v
    if lay.keys == "hex":
        keys = splitmix64(keys)
    if lay.keys != "raw" and lay.rows:
        keys %= np.uint64(lay.rows)
    return dense, keys.view(np.int64), label.astype(np.float32)          # keys < rows < 2^63, or any int64


# -- the slow path: one line at a time, to name what is wrong --------------------------------------
def _number(x: str):
    v = float(x)
    if not math.isfinite(v) or abs(v) > _LARGEST:
        raise ValueError
    return v


def _check_line(fields: list, lay: Layout) -> str | None:
    """Why ``fields`` is not a sample of ``lay``, or None. Pads short Criteo lines in place."""
    if len(fields) != lay.ncols:
        if not (lay.pad and _pad_min(lay) <= len(fields) < lay.ncols):
            return f"{len(fields)} fields, expected {lay.ncols} (split at {lay.delimiter!r})"
        fields += [""] * (lay.ncols - len(fields))
    if lay.label >= 0 and fields[lay.label].strip() not in ("0", "1", "0.0", "1.0"):
        return f"label (column {lay.names[lay.label]}) must be 0 or 1, got {fields[lay.label][:40]!r}"
    for c in lay.dense:
        try:
            fields[c] and _number(fields[c])
        except ValueError:
            return f"column {lay.names[c]} is not a finite number: {fields[c][:40]!r}"
    for c in lay.categorical:
        x = fields[c]
        if lay.keys == "hex" and x and not (len(x) <= 16 and all(ch in "0123456789abcdefABCDEF" for ch in x)):
            return f"column {lay.names[c]} is not a hex value of at most 64 bits (1-16 hex digits): {x[:40]!r}"
        if lay.keys == "raw" and not (x.isdigit() and x.isascii() and len(x) <= 19 and (int(x) < lay.rows or not lay.rows)):
            return (f"column {lay.names[c]} is not a decimal id below data.hash_rows = {lay.rows}: {x[:40]!r}" if lay.rows
                    else f"column {lay.names[c]} is not a decimal id of at most 19 digits: {x[:40]!r}")
    return None


def _sort_out(block: bytes, where, lay: Layout):
    """(the block's good lines, as a block; their slot numbers; [(where, why, text)] of the bad)."""
    good, slots, bad = [], [], []
    for i, raw in enumerate(block.split(b"\n")[:-1]):
        line = raw.decode("utf-8", "replace").rstrip("\r")
        if not line.strip():
            bad.append((where(i), None, ""))           # an empty line: dropped, not an error
            continue
        fields = line.split(lay.delimiter)
        why = _check_line(fields, lay)
        if why is None:
            good.append(lay.delimiter.join(fields).encode())
            slots.append(i)
        else:
            bad.append((where(i), why, line))
    return b"".join(x + b"\n" for x in good), np.array(slots, np.int64), bad


def _padded(block: bytes, lay: Layout) -> bytes | None:
    """``block`` with its short lines (``PAD_MIN`` to ncols - 1 fields) given the missing empty fields,
    or None where no line is short (or one has too many or too few fields)."""
    a = np.frombuffer(block, np.uint8)
    ends = np.flatnonzero(a == 10)
    seps = np.flatnonzero(a == ord(lay.delimiter))
    fields = np.diff(np.searchsorted(seps, ends), prepend=0) + 1
    short = fields < lay.ncols
    if not short.any() or (fields > lay.ncols).any() or (fields < _pad_min(lay)).any():
        return None
    at = np.repeat(ends[short], lay.ncols - fields[short])
    return np.insert(a, at, np.uint8(ord(lay.delimiter))).tobytes()


def parse_block(block: bytes, n: int, where, lay: Layout, skip_bad: bool, stats: dict):
    """Parse ``n`` lines (each ending in a newline) into ``(dense (m, D) float32, keys (m, T) int64,
    labels (m,) float32, slots)``: ``slots`` the line numbers (0-based in the block) of the ``m``
    samples, None when every line is one. ``where(i)`` names line ``i`` as ``"path:lineno"``.
    A bad line raises :class:`BadLine` quoting the block's first few, or (``skip_bad``) is dropped
    and counted in ``stats["skipped_lines"]``; empty lines are dropped and counted in
    ``stats["empty_lines"]``. Local."""
    try:
        return (*_fast(block, n, lay), None)
    except _Slow:
        pass
    padded = _padded(block, lay) if lay.pad else None
    if padded is not None:                           # Criteo copies that strip trailing empty fields
        try:
            return (*_fast(padded, n, lay), None)
        except _Slow:
            pass
    good, slots, bad = _sort_out(block, where, lay)
    errors = [b for b in bad if b[1] is not None]
    if errors and not skip_bad:
        shown = "\n".join(f"  {w}: {why}: {text[:120]!r}" for w, why, text in errors[:SHOW_BAD])
        more = f"\n  ... and {len(errors) - SHOW_BAD} more in this block" if len(errors) > SHOW_BAD else ""
        raise BadLine(f"{len(errors)} bad line{'s' if len(errors) > 1 else ''} "
                      f"(set data.skip_bad_lines = true to skip such lines):\n{shown}{more}")
    stats["skipped_lines"] = stats.get("skipped_lines", 0) + len(errors)
    stats["empty_lines"] = stats.get("empty_lines", 0) + len(bad) - len(errors)
    if not slots.shape[0]:
        d = len(lay.dense)
        return np.zeros((0, d), np.float32), np.zeros((0, len(lay.categorical)), np.int64), np.zeros(0, np.float32), slots
    try:
        return (*_fast(good, slots.shape[0], lay), slots)
    except _Slow as e:                               # the line check let through what pyarrow refused
        raise BadLine(f"{where(int(slots[0]))}: a block the line check passed did not parse: {e}") from None
