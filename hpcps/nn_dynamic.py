"""A DLRM's categorical columns looked up in one :class:`hpcps.DynamicEmbeddingTable` (what
``hpcps train`` uses with ``model.dynamic_tables``). The data give each column's 64-bit keys,
salted per column (:func:`hpcps.data.hashing.salted_keys`), so one table holds every column's
rows with no table size to reduce them to."""

import time

import numpy as np
import torch

from .nn import ShardedEmbeddingBag, _gather

__all__ = ["DynamicEmbeddingCollection"]


class DynamicEmbeddingCollection(torch.nn.Module):
    """``forward([keys of column 0, keys of column 1, ...])`` (one ``(B,)`` or ``(B, 1)`` int64
    array or tensor per column) returns ``(B, columns, dim)``. A step pulls the batch's distinct
    keys once, and the gradient of those rows goes back in one push (the table's one push per
    step in sync mode). Under ``torch.no_grad()`` (evaluation) the pull stores nothing. Worker
    ranks; local.

    ``bag``: a :class:`ShardedEmbeddingBag` over the dynamic table, without a push batch or a
    cache (its comm thread, grad scale and wait counters are used)."""

    def __init__(self, bag: ShardedEmbeddingBag, columns: int):
        super().__init__()
        if bag.batch is not None or bag.cache is not None:
            raise ValueError("DynamicEmbeddingCollection: the bag must have no push batch and no cache")
        self.bags = torch.nn.ModuleList([bag])
        self.columns, self.embedding_dim, self.device = int(columns), bag.embedding_dim, bag.device
        self.after_push = None      # called once the step's push is handed on (as ShardedEmbeddingCollection)

    def __len__(self) -> int:
        return self.columns

    def prepare(self, inputs, plan=None) -> None:
        """Nothing to prepare (no plan: the keys are not rows). Local."""

    def forward(self, inputs) -> torch.Tensor:
        if len(inputs) != self.columns:
            raise ValueError(f"DynamicEmbeddingCollection: {self.columns} columns, got keys for {len(inputs)}")
        keys = np.stack([np.asarray(x if isinstance(x, np.ndarray) else torch.as_tensor(x).cpu().numpy()).reshape(-1)
                         for x in inputs])                       # (columns, samples)
        if keys.dtype != np.int64:
            raise ValueError(f"DynamicEmbeddingCollection: keys must be int64, got {keys.dtype}")
        bag = self.bags[0]
        t0 = time.perf_counter()
        uniq, inverse = np.unique(keys, return_inverse=True)
        train = torch.is_grad_enabled()
        rows = torch.from_numpy(bag.comm.submit(bag.table.pull, uniq, train).result())
        bag.pull_wait_s += time.perf_counter() - t0
        if self.device.type != "cpu":
            rows = rows.to(self.device, non_blocking=True)
        weight = rows.requires_grad_(train)
        if train:
            weight.register_hook(lambda grad: self._push(uniq, grad))
        index = np.ascontiguousarray(inverse.reshape(keys.shape).T)     # (samples, columns)
        return _gather(weight, torch.from_numpy(index).to(self.device))

    def _push(self, uniq: np.ndarray, grad: torch.Tensor) -> None:
        self.bags[0].push_grad(uniq, grad)
        if self.after_push is not None:
            self.after_push()
