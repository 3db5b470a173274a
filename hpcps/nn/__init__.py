"""The torch bridge: torch modules over hpcps tables (autograd pulls rows forward and pushes their
gradients back; the PS applies the optimizer).

``sharded`` (:class:`ShardedEmbeddingBag`, a drop-in for ``torch.nn.EmbeddingBag``;
:class:`ShardedEmbeddingCollection`, a CTR model's columns over its tables; :class:`IdPlan`, a
step's distinct ids and where they go), ``dynamic`` (a DLRM's columns over one dynamic table),
``parts`` (a CTR model's parts looked up together). Importing this package imports torch.
"""

from .sharded import IdPlan, ShardedEmbeddingBag, ShardedEmbeddingCollection

__all__ = ["IdPlan", "ShardedEmbeddingBag", "ShardedEmbeddingCollection"]
