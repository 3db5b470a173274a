"""What every data source hands the trainer."""

from dataclasses import dataclass

import numpy as np

__all__ = ["Batch", "worker_slice", "DataSource"]


@dataclass
class Batch:
    """One worker's share of a global batch. ``sparse[t]`` holds the ids of table ``t``."""

    dense: np.ndarray                 # (n, num_dense) float32
    sparse: list                      # [(n,) int64] per table
    labels: np.ndarray                # (n,) float32: click (0/1) or rating
    truth: np.ndarray | None = None   # (n,) planted click probability (synthetic data only)

    def __len__(self) -> int:
        return int(self.labels.shape[0])


def worker_slice(batch_size: int, num_workers: int, worker: int) -> slice:
    """Positions of a global batch that ``worker`` takes (contiguous, as even as possible). Local."""
    return slice(batch_size * worker // num_workers, batch_size * (worker + 1) // num_workers)


class DataSource:
    """Interface: ``tables`` [(name, rows)], ``num_dense``, ``task`` ("ctr" | "ratings"),
    ``steps_per_epoch`` (None: endless), ``train_batch(step)``, ``eval_batches()``,
    ``stats`` (dict of counters, e.g. skipped lines)."""

    tables: list
    num_dense: int
    task: str
    steps_per_epoch: int | None = None
    stats: dict

    def train_batch(self, step: int) -> Batch:
        raise NotImplementedError

    def eval_batches(self):
        raise NotImplementedError
