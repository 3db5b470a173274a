"""Data sources: synthetic CTR (default), Criteo TSV, ratings files."""

from .base import Batch, DataSource, worker_slice
from .criteo import load_criteo, parse_criteo
from .files import BadLine
from .ratings import load_ratings, parse_rating
from .synthetic import SyntheticCTR
from .tabular import TabularData

__all__ = ["Batch", "DataSource", "worker_slice", "SyntheticCTR", "TabularData", "BadLine",
           "parse_criteo", "load_criteo", "parse_rating", "load_ratings", "make_data"]


def make_data(cfg, seed: int, num_workers: int, worker: int) -> DataSource:
    """The data source of a ``DataConfig`` for ``worker`` (any rank may build it for the
    table sizes; PS ranks pass ``worker=0``). Local."""
    if cfg.format == "synthetic-ctr":
        return SyntheticCTR(cfg.num_tables, cfg.rows_per_table, cfg.num_dense, cfg.batch_size,
                            cfg.eval_samples, cfg.zipf, seed, num_workers, worker, signal=cfg.signal)
    stats = {}
    if cfg.format == "criteo":
        train, evaluation = load_criteo(cfg.path, cfg.eval_path, cfg.eval_fraction, cfg.hash_rows,
                                        cfg.skip_bad_lines, stats)
        tables = [(f"C{c + 1}", cfg.hash_rows) for c in range(len(train[1]))]
        data = TabularData("ctr", tables, train, evaluation, cfg.batch_size, num_workers, worker, seed, stats)
        return data
    if cfg.format == "ratings":
        train, evaluation, nu, ni, mean = load_ratings(cfg.path, cfg.eval_path, cfg.eval_fraction,
                                                       cfg.skip_bad_lines, stats)
        data = TabularData("ratings", [("users", nu), ("items", ni)], train, evaluation, cfg.batch_size,
                           num_workers, worker, seed, stats)
        data.mean_rating = mean
        return data
    raise ValueError(f"unknown data.format {cfg.format!r}")
