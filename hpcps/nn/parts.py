"""Several :class:`hpcps.nn.ShardedEmbeddingCollection` over the same features, looked up together:
a CTR model's parts (deep embeddings and wide weights, ``hpcps.models.registry.PARTS``), each its
own table of its own dim. Worker ranks; local."""

import torch

from .sharded import ShardedEmbeddingCollection

__all__ = ["ShardedEmbeddingParts"]


class ShardedEmbeddingParts(torch.nn.Module):
    """``parts``: ``{part: ShardedEmbeddingCollection}``, each over one table per feature (the same
    features, in the same order). ``self[part]`` is that collection, which the model calls with
    the features' ids. :meth:`prepare` and :meth:`prefetch` go to every part; ``after_push`` is
    called once a step, when every part has handed its gradients to its push."""

    def __init__(self, parts: dict):
        super().__init__()
        if not parts or not all(isinstance(c, ShardedEmbeddingCollection) for c in parts.values()):
            raise ValueError("ShardedEmbeddingParts: needs {part: ShardedEmbeddingCollection}")
        self.parts = torch.nn.ModuleDict(parts)
        self.after_push = None
        self._pushed = 0
        for c in self.parts.values():
            c.after_push = self._one_pushed

    def __getitem__(self, part: str) -> ShardedEmbeddingCollection:
        return self.parts[part]

    def _one_pushed(self) -> None:
        self._pushed += 1
        if self._pushed == len(self.parts):
            self._pushed = 0
            if self.after_push is not None:
                self.after_push()

    def prepare(self, inputs, plan=None) -> None:
        """:meth:`ShardedEmbeddingCollection.prepare` of every part (each makes its own plan). Local."""
        for c in self.parts.values():
            c.prepare(inputs)

    def prefetch(self, inputs, step: int, refresh_above: int | None = None) -> None:
        """:meth:`ShardedEmbeddingCollection.prefetch` of every part. Local."""
        for c in self.parts.values():
            c.prefetch(inputs, step, refresh_above=refresh_above)
