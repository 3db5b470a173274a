"""Sparse embedding tables on the PS ranks: the front (``table``), the pull and push paths,
the PS's staging and apply, 16-bit rows, row bookkeeping, and the step protocol (``control``)."""

from ..core.ids import default_scale, initial_rows
from ..core.optimizers import SGD, SparseOptimizer
from ..core.sharding import ModuloSharding, RangeSharding
from .dynamic import DynamicEmbeddingTable
from .pull import PullHandle
from .push import PushHandle, push_many
from .table import EmbeddingTable

__all__ = ["EmbeddingTable", "DynamicEmbeddingTable", "PullHandle", "PushHandle", "push_many", "ModuloSharding", "RangeSharding",
           "initial_rows", "default_scale", "SGD", "SparseOptimizer"]
