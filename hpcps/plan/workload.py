"""What a config asks of a cluster, per step: the tables (rows, dim, optimizer state), the rows a
batch touches, the dense part's parameters. Local."""

import functools
from dataclasses import dataclass

import numpy as np

from ..config import Config, deterministic
from ..core.settings import mailbox_slot_bytes, mailbox_slot_rows
from ..data.synthetic import synthetic_rows, wrapped_zipf_cdf
from ..train.tables import fused_tables, part_optimizer, table_parts

__all__ = ["Table", "Workload", "workload", "table_rows", "expected_unique", "describe"]

_GRID = 4000                # log-spaced buckets of a large table's ids (expected_unique)
EXACT_ROWS = 1 << 16        # tables up to this many rows: every id's probability (exact)


@dataclass(frozen=True)
class Table:
    rows: int
    dim: int
    state: int              # float32 of optimizer state per row
    optimizer: str
    zipf: float             # 0: ids of unknown distribution (every id of a batch counted distinct)
    window: int = 0         # the hpcps table it is in (a part's tables fused into one share it)


@dataclass(frozen=True)
class Workload:
    tables: tuple
    batch: int              # global batch
    num_dense: int
    dense_params: int       # float32 parameters of the dense part (replicated on every worker)
    stateful_dense: int     # float32 of dense optimizer state per parameter
    ordered: bool = False   # deterministic sync: every push through the mailboxes, every worker a slot

    @property
    def row_bytes(self) -> int:
        """Bytes of every table's rows and optimizer state: what a checkpoint writes."""
        return sum(4 * t.rows * (t.dim + t.state) for t in self.tables)

    def ps_bytes(self, num_ps: int, far_workers: int = 0, workers: int = 0) -> float:
        """Bytes one PS holds: its share of rows and state, the staging copy of a stateful
        optimizer's rows (none in deterministic sync: hpcps.train.tables.shard_bytes in memory),
        and the push mailboxes (:meth:`mailbox_bytes`)."""
        rows = sum(4 * t.rows * (t.dim * (2 if t.state and not self.ordered else 1) + t.state)
                   for t in self.tables) / num_ps
        return rows + self.mailbox_bytes(num_ps, far_workers, workers)

    def mailbox_bytes(self, num_ps: int, far_workers: int, workers: int) -> float:
        """Bytes of one PS's push mailboxes: per hpcps table of a stateful optimizer, a slot for
        each of the ``far_workers`` workers on other nodes (``ordered``: per table, a slot for each
        of the ``workers``), at most 64 MB a table (``hpcps.core.settings.mailbox_slot_rows``;
        float32 gradients)."""
        slots = workers if self.ordered else far_workers
        windows = {}
        for t in self.tables:
            if t.state or self.ordered:
                windows.setdefault(t.window, [0, t.dim])[0] += t.rows
        return sum(slots * mailbox_slot_bytes(cap, dim) for rows, dim in windows.values()
                   for cap in [mailbox_slot_rows(-(-rows // num_ps), slots, 8 + 4 * dim, ordered=self.ordered)] if cap)

    def unique_rows(self, samples: int) -> float:
        """Expected distinct rows ``samples`` samples touch, summed over the tables."""
        return sum(expected_unique(t.rows, t.zipf, samples) for t in self.tables)

    def unique_bytes(self, samples: int) -> float:
        """Bytes of those rows (float32), the tables' dims weighed."""
        return sum(4 * t.dim * expected_unique(t.rows, t.zipf, samples) for t in self.tables)


def expected_unique(rows: int, a: float, n: int) -> float:
    """Expected distinct ids among ``n`` draws from a table of ``rows`` rows: ``sum_k 1 - (1 -
    p_k)^n`` for hpcps's wrapped Zipf(``a``) ids (exact up to ``EXACT_ROWS`` rows; above, Zipf's
    ``k^-a`` over log-spaced buckets, within 3% of exact where tested); ``a`` = 0 (unknown):
    ``min(n, rows)``. Local, pure."""
    if a <= 0:
        return float(min(n, rows))
    width, p = _buckets(rows, a)
    return float(np.sum(width * -np.expm1(n * np.log1p(-p))))


@functools.lru_cache(maxsize=256)
def _buckets(rows: int, a: float) -> tuple:
    """``(ids per bucket, each id's probability)`` of a table's ids: every id of a table up to
    ``EXACT_ROWS`` rows (its wrapped Zipf), else log-spaced buckets of Zipf's ``k^-a``, the mass past
    the last row folded back evenly (as the wrap does, nearly). Local, pure."""
    if rows <= EXACT_ROWS:
        p = np.diff(wrapped_zipf_cdf(a, rows), prepend=0.0)
        p, width = np.unique(np.minimum(p, 1 - 1e-16), return_counts=True)   # equal ones once
        return width.astype(np.float64), p
    edges = np.unique(np.geomspace(1, rows + 1, _GRID).astype(np.int64))
    k = (edges[:-1] + edges[1:] - 1) / 2.0                     # each bucket's middle id (1-based)
    zeta = np.sum(np.arange(1, 10_001, dtype=np.float64) ** -a) + 10_000.5 ** (1 - a) / (a - 1)
    width, p = np.diff(edges).astype(np.float64), k ** -a / zeta
    tail = max(0.0, 1.0 - float(np.sum(width * p)))
    return width, np.minimum(p + tail / rows, 1 - 1e-16)


def _standin(cfg: Config, rows: list):
    """A stand-in data source of the config's tables (names and rows) for the model's builders."""
    from types import SimpleNamespace
    return SimpleNamespace(tables=[(f"C{i + 1}", r) for i, r in enumerate(rows)], num_dense=cfg.data.num_dense,
                           task="ctr")


def standin_model(cfg: Config, rows: int = 8):
    """``(the config's model over torch tables of ``rows`` rows each, those tables)``: the dense part
    as training builds it (its size does not depend on the tables' rows). Local."""
    import torch

    from ..train.build import build_model
    data = _standin(cfg, [rows] * len(table_rows(cfg)[0]))
    embs = [torch.nn.EmbeddingBag(rows, dim, mode="sum") for _, specs in table_parts(cfg, data)
            for _, _, dim, _, _ in specs]
    return build_model(cfg, embs, data), embs


def table_rows(cfg: Config) -> tuple[list, float]:
    """``(each categorical column's rows, the ids' Zipf exponent or 0 when unknown)``: synthetic
    data's ``data.table_rows`` or ``num_tables x rows_per_table``, times ``data.scale``; Criteo's 26
    columns or a CSV's listed ``data.categorical``, each of ``data.hash_rows`` rows. Local."""
    d = cfg.data
    if d.format == "synthetic-ctr":
        return synthetic_rows(d), d.zipf
    if d.format == "criteo":
        return [d.hash_rows] * 26, 0.0
    if d.format == "csv" and d.categorical != ["rest"]:
        return [d.hash_rows] * len(d.categorical), 0.0
    raise ValueError(f"hpcps plan: data.format = {d.format!r} with categorical = {d.categorical!r}: the tables are "
                     f"not known before the file is read (list data.categorical, or plan a synthetic config of "
                     f"the same sizes with data.table_rows)")


def workload(cfg: Config) -> Workload:
    """The :class:`Workload` of a CTR config: every part's tables (:func:`table_rows`) with their
    optimizer's state, and the dense part's parameters (counted on :func:`standin_model`). Local."""
    rows, zipf = table_rows(cfg)
    tables = []
    for part, specs in table_parts(cfg, _standin(cfg, rows)):
        opt = part_optimizer(cfg, part, 1)
        fused, window = fused_tables(cfg, specs), len({t.window for t in tables})
        for i, (_, r, dim, _, _) in enumerate(specs):
            state = sum(int(np.prod(s[1:], dtype=np.int64)) for s in opt.state_shapes(1, dim).values())
            tables.append(Table(r, dim, state, type(opt).__name__.lower(), zipf, window + (0 if fused else i)))
    model, embs = standin_model(cfg)
    emb = {id(e.weight) for e in embs}
    params = sum(p.numel() for p in model.parameters() if id(p) not in emb)
    dense_state = {"sgd": 0, "adagrad": 1, "adam": 2}.get(cfg.optimizer.dense.name, 2)
    return Workload(tuple(tables), cfg.data.batch_size, cfg.data.num_dense, params, dense_state,
                    deterministic(cfg.job))


def describe(w: Workload) -> str:
    """One line: tables, rows, bytes. Local, pure."""
    return (f"{len(w.tables)} tables, {sum(t.rows for t in w.tables):,} rows of dim {w.tables[0].dim}, "
            f"{w.row_bytes / 1e9:,.1f} GB of rows and optimizer state; dense part {w.dense_params:,} parameters; "
            f"global batch {w.batch}")

