"""In-memory train/eval arrays with global-batch sharding and seeded epoch order."""

import numpy as np

from .base import Batch, DataSource, worker_slice

__all__ = ["TabularData", "epoch_steps"]


def epoch_steps(samples: int, batch_size: int) -> int:
    """Steps of an epoch of ``samples`` in full batches, the last completed from the next epoch
    (:class:`TabularData`): ``ceil(samples / batch_size)``. Local, pure."""
    return -(-samples // batch_size)


class TabularData(DataSource):
    """Train arrays read as one stream of global batches; worker ``w`` takes its slice of each.

    Epoch ``e`` visits every sample once, in the order ``permutation(seed, e)`` (the same on every
    worker), and the epochs follow one another in the stream: the last batch of an epoch that the
    data do not fill is filled with the first samples of the next epoch's order. So every batch
    has ``batch_size`` samples (the shapes every step, the loader and the dense all-reduce expect)
    and no sample is left out of an epoch; ``steps_per_epoch`` is ``ceil(samples / batch_size)``.
    Each worker keeps every training sample (this is the in-memory reader: ``data.reader``).
    Eval keeps every row, split over the workers.
    """

    def __init__(self, task, tables, train, evaluation, batch_size, num_workers, worker, seed, stats):
        dense, sparse, labels = train
        n = labels.shape[0]
        if n < batch_size:
            raise ValueError(f"the training data has {n} samples, fewer than data.batch_size = {batch_size}")
        self.task, self.tables, self.stats, self.seed = task, tables, stats, seed
        self.num_dense = dense.shape[1]
        self.samples, self.batch_size = n, batch_size
        self.steps_per_epoch = epoch_steps(n, batch_size)
        sl = worker_slice(batch_size, num_workers, worker)
        self._offsets = np.arange(sl.start, sl.stop, dtype=np.int64)
        self._train = (dense, sparse, labels)
        e_dense, e_sparse, e_labels = evaluation
        m = e_labels.shape[0]
        esl = slice(m * worker // num_workers, m * (worker + 1) // num_workers)
        self._eval = (e_dense[esl], [s[esl] for s in e_sparse], e_labels[esl])
        self._order = {}
        stats.update({"train_samples": int(n), "eval_samples": int(m)})

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch not in self._order:
            if len(self._order) > 1:                   # a batch spans at most two epochs
                self._order.pop(min(self._order))
            self._order[epoch] = np.random.default_rng([self.seed, 7, epoch]).permutation(self.samples)
        return self._order[epoch]

    def _samples(self, step: int, offsets: np.ndarray) -> np.ndarray:
        """The sample numbers at ``offsets`` of global batch ``step`` of the stream."""
        epoch, at = np.divmod(step * self.batch_size + offsets, self.samples)
        out = np.empty(offsets.size, np.int64)
        for e in np.unique(epoch):
            mine = epoch == e
            out[mine] = self._epoch_order(int(e))[at[mine]]
        return out

    def train_batch(self, step: int) -> Batch:
        dense, sparse, labels = self._train
        i = self._samples(step, self._offsets)
        return Batch(dense[i], [s[i] for s in sparse], labels[i])

    def train_pass(self) -> Batch:
        """Every training sample once, in epoch 0's order (``hpcps baseline``'s training set). Local."""
        dense, sparse, labels = self._train
        i = self._epoch_order(0)
        return Batch(dense[i], [s[i] for s in sparse], labels[i])

    def eval_batches(self, batch_size: int = 4096):
        dense, sparse, labels = self._eval
        for s in range(0, labels.shape[0], batch_size):
            yield Batch(dense[s:s + batch_size], [x[s:s + batch_size] for x in sparse], labels[s:s + batch_size])
