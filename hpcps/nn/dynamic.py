"""A DLRM's categorical columns looked up in one :class:`hpcps.DynamicEmbeddingTable` (what
``hpcps train`` uses with ``model.dynamic_tables``). The data give each column's 64-bit keys,
salted per column (:func:`hpcps.data.hashing.salted_keys`), so one table holds every column's
rows with no table size to reduce them to."""

import time

import numpy as np
import torch

from .sharded import ShardedEmbeddingBag, _gather, same_arrays

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
        self._prepared = None       # (the key arrays, their distinct keys) from prepare()

    def __len__(self) -> int:
        return self.columns

    def prepare(self, inputs, plan=None) -> None:
        """Find the distinct keys of a coming ``forward``'s ``inputs`` now, while there is time (a
        worker waiting for the PS's apply): that forward then starts with its pull. Only
        ``forward(inputs)`` with these very arrays, unchanged, uses them. ``plan``: ignored (the
        keys are not rows). Local."""
        self._prepared = None
        arrays = [x if isinstance(x, np.ndarray) else torch.as_tensor(x).numpy() for x in inputs]
        self._prepared = (arrays, self._distinct(arrays))

    def _distinct(self, inputs) -> tuple:
        """``(distinct keys, each sample's index into them (columns, samples))`` of ``inputs``."""
        if len(inputs) != self.columns:
            raise ValueError(f"DynamicEmbeddingCollection: {self.columns} columns, got keys for {len(inputs)}")
        keys = np.stack([np.asarray(x if isinstance(x, np.ndarray) else torch.as_tensor(x).cpu().numpy()).reshape(-1)
                         for x in inputs])                       # (columns, samples)
        if keys.dtype != np.int64:
            raise ValueError(f"DynamicEmbeddingCollection: keys must be int64, got {keys.dtype}")
        uniq, inverse = np.unique(keys, return_inverse=True)
        return uniq, inverse.reshape(keys.shape)

    def forward(self, inputs) -> torch.Tensor:
        p, self._prepared = self._prepared, None
        bag = self.bags[0]
        t0 = time.perf_counter()
        uniq, inverse = p[1] if p is not None and same_arrays(p[0], inputs) else self._distinct(inputs)
        train = torch.is_grad_enabled()
        rows = torch.from_numpy(bag.comm.submit(bag.table.pull, uniq, train).result())
        bag.pull_wait_s += time.perf_counter() - t0
        if self.device.type != "cpu":
            rows = rows.to(self.device, non_blocking=True)
        weight = rows.requires_grad_(train)
        if train:
            weight.register_hook(lambda grad: self._push(uniq, grad))
        index = np.ascontiguousarray(inverse.T)                         # (samples, columns)
        return _gather(weight, torch.from_numpy(index).to(self.device))

    def _push(self, uniq: np.ndarray, grad: torch.Tensor) -> None:
        self.bags[0].push_grad(uniq, grad)
        if self.after_push is not None:
            self.after_push()
