"""Sparse optimizers: ``hpcps.optim.SGD(lr=...)``, ``Adagrad``, ``Adam``, ``FTRL``, ``LRSchedule``."""

from .core.optimizers import FTRL, SGD, Adagrad, Adam, LRSchedule, SparseOptimizer, make_optimizer

__all__ = ["SGD", "Adagrad", "Adam", "FTRL", "LRSchedule", "SparseOptimizer", "make_optimizer"]
