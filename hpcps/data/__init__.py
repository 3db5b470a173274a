"""Data sources: synthetic CTR (default), Criteo TSV, delimited files (CSV), ratings files."""

import dataclasses

from .base import Batch, DataSource, worker_slice
from .columns import criteo_layout, parse_block
from .sources import delimited
from .files import BadLine
from .ratings import load_ratings, parse_rating
from .synthetic import SyntheticCTR, synthetic_rows
from .tabular import TabularData

__all__ = ["Batch", "DataSource", "worker_slice", "SyntheticCTR", "synthetic_rows", "TabularData", "BadLine",
           "criteo_layout", "parse_block", "parse_rating", "load_ratings", "make_data"]


def make_data(cfg, seed: int, num_workers: int, worker: int, comm=None, reads: bool = True,
              raw_keys: bool = False) -> DataSource:
    """The data source of a ``DataConfig`` for ``worker``. Every rank builds it for the tables'
    sizes and the epoch's length; a PS rank passes ``worker=0, reads=False`` (for criteo and csv it
    then reads no sample). ``raw_keys``: categorical ids are 64-bit keys salted per column, never
    reduced modulo a table size (``data.hash_rows`` is then unused; for dynamic tables).
    Collective over ``comm`` (every rank of it) where given: the files' counting pass is shared out
    over its ranks. Local otherwise."""
    if cfg.format == "synthetic-ctr":
        return SyntheticCTR(cfg.num_tables, cfg.rows_per_table, cfg.num_dense, cfg.batch_size, cfg.eval_samples,
                            cfg.zipf, seed, num_workers, worker, signal=cfg.signal, raw_keys=raw_keys,
                            table_rows=synthetic_rows(cfg))
    stats = {}
    if cfg.format in ("criteo", "csv"):
        return delimited(dataclasses.replace(cfg, hash_rows=0) if raw_keys else cfg, seed, num_workers, worker,
                         comm, reads)
    if raw_keys:
        raise ValueError(f"data.format = {cfg.format!r} has no raw keys: model.dynamic_tables needs synthetic-ctr, "
                         f"criteo or csv data")
    if cfg.format == "ratings":
        train, evaluation, nu, ni, mean, ids = load_ratings(cfg.path, cfg.eval_path, cfg.eval_fraction,
                                                       cfg.skip_bad_lines, stats)
        data = TabularData("ratings", [("users", nu), ("items", ni)], train, evaluation, cfg.batch_size,
                           num_workers, worker, seed, stats)
        data.mean_rating, data.ids = mean, ids          # ids: kept in checkpoints (hpcps predict)
        return data
    raise ValueError(f"unknown data.format {cfg.format!r}")
