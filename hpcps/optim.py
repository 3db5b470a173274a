"""Sparse optimizers: ``hpcps.optim.SGD(lr=...)``, ``Adagrad``, ``Adam``, ``LRSchedule``."""

from .core.optimizers import SGD, Adagrad, Adam, LRSchedule, SparseOptimizer, make_optimizer

__all__ = ["SGD", "Adagrad", "Adam", "LRSchedule", "SparseOptimizer", "make_optimizer"]
