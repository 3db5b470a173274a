"""In-memory train/eval arrays with global-batch sharding and seeded epoch order."""

import numpy as np

from .base import Batch, DataSource, worker_slice

__all__ = ["TabularData"]


class TabularData(DataSource):
    """Train arrays split into full global batches; worker ``w`` keeps its slice of each.

    Epoch ``e`` visits the batches in the order ``permutation(seed, e)``, the
    same on every worker; a last partial batch is dropped. Eval keeps every row.
    """

    def __init__(self, task, tables, train, evaluation, batch_size, num_workers, worker, seed, stats):
        dense, sparse, labels = train
        n = labels.shape[0]
        if n < batch_size:
            raise ValueError(f"the training data has {n} samples, fewer than data.batch_size = {batch_size}")
        self.task, self.tables, self.stats, self.seed = task, tables, stats, seed
        self.num_dense = dense.shape[1]
        self.steps_per_epoch = n // batch_size
        sl = worker_slice(batch_size, num_workers, worker)
        per = sl.stop - sl.start
        idx = (np.arange(self.steps_per_epoch)[:, None] * batch_size + np.arange(sl.start, sl.stop)).reshape(-1)
        self._dense = dense[idx].reshape(self.steps_per_epoch, per, -1)
        self._sparse = [s[idx].reshape(self.steps_per_epoch, per) for s in sparse]
        self._labels = labels[idx].reshape(self.steps_per_epoch, per)
        e_dense, e_sparse, e_labels = evaluation
        m = e_labels.shape[0]
        esl = slice(m * worker // num_workers, m * (worker + 1) // num_workers)
        self._eval = (e_dense[esl], [s[esl] for s in e_sparse], e_labels[esl])
        self._order = {}
        stats.update({"train_samples": int(n), "eval_samples": int(m)})

    def _batch_index(self, step: int) -> int:
        epoch, k = divmod(step, self.steps_per_epoch)
        if epoch not in self._order:
            self._order = {epoch: np.random.default_rng([self.seed, 7, epoch]).permutation(self.steps_per_epoch)}
        return int(self._order[epoch][k])

    def train_batch(self, step: int) -> Batch:
        b = self._batch_index(step)
        return Batch(self._dense[b], [s[b] for s in self._sparse], self._labels[b])

    def eval_batches(self, batch_size: int = 4096):
        dense, sparse, labels = self._eval
        for s in range(0, labels.shape[0], batch_size):
            yield Batch(dense[s:s + batch_size], [x[s:s + batch_size] for x in sparse], labels[s:s + batch_size])
