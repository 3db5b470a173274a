"""Sparse optimizers: ``hpcps.optim.SGD(lr=...)``."""

from .sparse.optimizers import SGD, SparseOptimizer

__all__ = ["SGD", "SparseOptimizer"]
