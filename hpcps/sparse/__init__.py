"""Sparse embedding tables on the PS ranks."""

from .initializers import default_scale, initial_rows
from .optimizers import SGD, SparseOptimizer
from .sharding import ModuloSharding
from .table import EmbeddingTable, PullHandle, PushHandle, push_many

__all__ = ["EmbeddingTable", "PullHandle", "PushHandle", "push_many", "ModuloSharding",
           "initial_rows", "default_scale", "SGD", "SparseOptimizer"]
