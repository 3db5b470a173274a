"""``hpcps ckpt export --format torchscript``: a checkpoint as one TorchScript module that a process
with torch alone loads (``torch.jit.load``) and runs on raw feature columns:

    model = torch.jit.load("model.pt")
    p = model(dense, categorical)   # dense: (n, D) float32 raw values (missing: 0);
                                    # categorical: one list of n strings per categorical column
                                    # (model.categorical_names, model.dense_names: their order)

It hashes each value as the readers do (:mod:`hpcps.data.hashing`: the polynomial over the value's
UTF-8 bytes, finished by SplitMix64 with its length and its column's key; Criteo's hex values;
decimal ids for ``data.keys = "raw"``), reduces the keys modulo the table rows, applies
``data.dense_log``, and returns click probabilities. The 64-bit arithmetic runs on int64 tensors
(wrapping as uint64 does; shifts masked to be logical). The model inside is traced from the model
over plain ``torch.nn.EmbeddingBag`` tables holding every row, so it suits tables that fit one
process's memory. Local.
"""

import warnings
from pathlib import Path
from typing import List

import torch

__all__ = ["export_torchscript", "RawColumns"]

_U64 = 1 << 64
_GOLDEN_U = 0x9E3779B97F4A7C15


def _s64(x: int) -> int:
    """``x`` mod 2^64 as a signed int64 (the bits a uint64 holds)."""
    x %= _U64
    return x - _U64 if x >= 1 << 63 else x


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 ``x`` by ``k`` (1 <= k < 64)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    x = x + (-7046029254386353131)               # 0x9E3779B97F4A7C15 as int64
    x = x ^ _srl(x, 30)
    x = x * (-4658895280553007687)               # 0xBF58476D1CE4E5B9
    x = x ^ _srl(x, 27)
    x = x * (-7723592293110705685)               # 0x94D049BB133111EB
    return x ^ _srl(x, 31)


def _codes(values: List[str]):
    """``(codes (n, width) int64, lengths (n,) int64)``: each value's UTF-8 bytes, zero-padded (in
    Python a character's code point is encoded here)."""
    flat: List[int] = []
    rows: List[int] = []
    cols: List[int] = []
    lens: List[int] = []
    for i, s in enumerate(values):
        n = 0
        for ch in s:
            c = ord(ch)
            if c < 0x80 or torch.jit.is_scripting():       # TorchScript's str holds UTF-8 bytes: ord is a byte
                b = [c]
            elif c < 0x800:
                b = [0xC0 | (c >> 6), 0x80 | (c & 0x3F)]
            elif c < 0x10000:
                b = [0xE0 | (c >> 12), 0x80 | ((c >> 6) & 0x3F), 0x80 | (c & 0x3F)]
            else:
                b = [0xF0 | (c >> 18), 0x80 | ((c >> 12) & 0x3F), 0x80 | ((c >> 6) & 0x3F), 0x80 | (c & 0x3F)]
            for x in b:
                flat.append(x)
                rows.append(i)
                cols.append(n)
                n += 1
        lens.append(n)
    width = max(lens) if len(lens) > 0 else 0
    codes = torch.zeros([len(values), max(width, 1)], dtype=torch.int64)
    if len(flat) > 0:
        codes[torch.tensor(rows), torch.tensor(cols)] = torch.tensor(flat, dtype=torch.int64)
    return codes, torch.tensor(lens, dtype=torch.int64)


class RawColumns(torch.nn.Module):
    """Raw columns -> the readers' row ids -> the model -> probabilities (see the module's text)."""

    column_keys: List[int]
    categorical_names: List[str]
    dense_names: List[str]

    def __init__(self, model, keys: str, column_keys: List[int], rows: int, dense_log: bool,
                 categorical_names: List[str], dense_names: List[str]):
        super().__init__()
        self.model = model
        self.keys, self.column_keys, self.rows, self.dense_log = keys, column_keys, rows, dense_log
        self.wrap = (_U64 % rows) if rows else 0              # 2^64 mod rows: a negative int64's correction
        self.categorical_names, self.dense_names = categorical_names, dense_names

    def _bad_value(self, values: List[str], k: int, codes: torch.Tensor, lens: torch.Tensor) -> None:
        """Raise ``ValueError`` naming column ``k`` and its first value the readers refuse: hex (Criteo)
        1-16 hex digits or empty; raw decimal ids of at most 19 digits, below the table's rows."""
        on = torch.arange(codes.shape[1]).unsqueeze(0) < lens.unsqueeze(1)
        if self.keys == "hex":
            digit = ((codes >= 48) & (codes <= 57)) | ((codes >= 65) & (codes <= 70)) | ((codes >= 97) & (codes <= 102))
            bad = (on & ~digit).any(1) | (lens > 16)
            need = "a hex value of at most 64 bits (1-16 hex digits)"
        elif self.keys == "raw":
            bad = (on & ((codes < 48) | (codes > 57))).any(1) | (lens > 19) | (lens == 0)
            need = "a decimal id of at most 19 digits" + ("" if self.rows == 0 else " below " + str(self.rows))
        else:
            return
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0, 0])
            raise ValueError("categorical column " + self.categorical_names[k] + " is not " + need + ": '"
                             + values[i][:40] + "' (value " + str(i) + ")")

    @torch.jit.export
    def check_dense(self, dense: torch.Tensor) -> None:
        """The rule predict reads dense fields by: ``dense`` (n, len(dense_names)) of finite values
        of at most 3e38 (a float32); ``ValueError`` naming the column otherwise."""
        if dense.dim() != 2 or dense.shape[1] != len(self.dense_names):
            raise ValueError("dense: expected a (n, " + str(len(self.dense_names)) + ") tensor, one column per "
                             "model.dense_names, got shape " + str(list(dense.shape)))
        big = ~(torch.abs(dense.to(torch.float64)) <= 3e38)          # also true for NaN
        if bool(big.any()):
            at = torch.nonzero(big)[0]
            raise ValueError("dense column " + self.dense_names[int(at[1])] + " is not a finite number of at most "
                             "3e38: " + str(float(dense[int(at[0]), int(at[1])])) + " (row " + str(int(at[0])) + ")")

    def _check_lists(self, categorical: List[List[str]], n: int) -> None:
        """One list of ``n`` values per categorical column; ``ValueError`` naming what is off."""
        if len(categorical) != len(self.column_keys):
            raise ValueError("categorical: expected " + str(len(self.column_keys)) + " lists of values, one per "
                             "model.categorical_names, got " + str(len(categorical)))
        for k in range(len(categorical)):
            if len(categorical[k]) != n:
                raise ValueError("categorical column " + self.categorical_names[k] + ": " + str(len(categorical[k]))
                                 + " values where the first column has " + str(n) + " (or dense " + str(n) + " rows)")

    def _column(self, values: List[str], k: int) -> torch.Tensor:
        codes, lens = _codes(values)
        self._bad_value(values, k, codes, lens)
        v = torch.zeros(len(values), dtype=torch.int64)
        for j in range(codes.shape[1]):
            c = codes[:, j]
            on = j < lens
            if self.keys == "hash":
                v = torch.where(on, v * 1099511628211 + c, v)
            elif self.keys == "hex":
                digit = torch.where(c >= 97, c - 87, torch.where(c >= 65, c - 55, c - 48))
                v = torch.where(on, (v << 4) | digit, v)
            else:
                v = torch.where(on, v * 10 + (c - 48), v)
        if self.keys == "hash":
            v = _splitmix(v ^ _splitmix(lens ^ self.column_keys[k]))
        elif self.keys == "hex":
            v = _splitmix(torch.where(lens == 0, torch.full_like(v, 0xFFFFFFFFFFFF), v) ^ self.column_keys[k])
        if self.keys == "raw":
            if self.rows != 0 and bool((v >= self.rows).any()):
                i = int(torch.nonzero(v >= self.rows)[0, 0])
                raise ValueError("categorical column " + self.categorical_names[k] + " is not a decimal id below "
                                 + str(self.rows) + ": '" + values[i][:40] + "' (value " + str(i) + ")")
            return v
        r = torch.remainder(v, self.rows)
        return torch.where(v < 0, torch.remainder(r + self.wrap, self.rows), r)

    @torch.jit.export
    def ids(self, categorical: List[List[str]]) -> List[torch.Tensor]:
        """The row id of each value, a tensor per categorical column (values the readers refuse:
        ``ValueError`` naming the column and the value)."""
        self._check_lists(categorical, len(categorical[0]) if len(categorical) > 0 else 0)
        return [self._column(categorical[k], k) for k in range(len(categorical))]

    def forward(self, dense: torch.Tensor, categorical: List[List[str]]) -> torch.Tensor:
        self.check_dense(dense)
        self._check_lists(categorical, dense.shape[0])
        x = dense.to(torch.float32)
        if self.dense_log:
            x = torch.log1p(torch.clamp(x, min=0.0))
        return torch.sigmoid(self.model(x, self.ids(categorical)))


def checked_source(path, out, fmt: str):
    """``(manifest, config, input layout, Shape)`` of checkpoint ``path`` for an export to ``out``
    in ``fmt``: ``ValueError`` where ``out`` is inside a checkpoint, the checkpoint keeps no input
    layout, or its tables are dynamic. Local."""
    from ..checkpoint import store
    from ..config import load_config
    from ..data.columns import Layout
    from .inputs import Shape
    inside = store.inside_checkpoint(out)
    if inside is not None:
        raise ValueError(f"--out {out} is inside checkpoint {inside}: choose a path outside it")
    man = store.read_manifest(path)
    if "layout" not in man:
        raise ValueError(f"{path}: its manifest has no input layout (a synthetic-data job, a ratings job, or a "
                         f"checkpoint written before hpcps kept it): --format {fmt} needs csv or criteo columns")
    cfg = load_config(None, [], base=man["config"])
    if cfg.model.dynamic_tables:
        raise ValueError(f"model.dynamic_tables: --format {fmt} takes fixed tables (export the rows with --format h5)")
    lay = Layout(**man["layout"])
    return man, cfg, lay, Shape(lay)


def trace(model, example):
    """``torch.jit.trace`` of ``model`` on ``example`` (no grad). Local."""
    with torch.no_grad(), warnings.catch_warnings():
        # the models' branches on a weight's size are constants of the model: what the tracer warns of
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        return torch.jit.trace(model, example, check_trace=False)


def hashing(lay) -> tuple:
    """:class:`RawColumns`' arguments after the model: how the readers hash ``lay``'s columns. Local."""
    from ..data.hashing import column_key
    # the key mixed into each column's values: by its place among the categoricals (hex), else in the line
    keys = [_s64(int(column_key(k if lay.keys == "hex" else c))) for k, c in enumerate(lay.categorical)]
    return (lay.keys, keys, lay.rows, lay.dense_log, [lay.names[c] for c in lay.categorical],
            [lay.names[c] for c in lay.dense])


def script_save(module, out) -> Path:
    """``torch.jit.script(module)`` saved at ``out``. Local."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)       # TorchScript: see docs/design.md
        scripted = torch.jit.script(module)
    scripted.save(str(out))
    return Path(out)


def export_torchscript(path, out) -> Path:
    """Checkpoint ``path`` (its manifest's config and input layout, its weights) as a TorchScript
    module at ``out``; returns ``out``. Local."""
    from ..checkpoint import tools
    from .serving import torch_model
    man, cfg, lay, shape = checked_source(path, out, "torchscript")
    model = torch_model(cfg, shape, tools.weights(path))
    traced = trace(model, (torch.zeros(3, len(lay.dense)), [torch.zeros(3, dtype=torch.int64) for _ in lay.categorical]))
    return script_save(RawColumns(traced, *hashing(lay)), out)
