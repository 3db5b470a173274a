"""Optimizers for sparse rows, applied where the rows live.

Plain SGD needs no PS CPU: workers add ``-lr * grad`` straight into the
weights (summed over duplicate ids first). Stateful optimizers (momentum,
Adagrad, Adam) are applied by the owning PS rank and come with the training
driver.
"""

from dataclasses import dataclass

__all__ = ["SparseOptimizer", "SGD"]


class SparseOptimizer:
    """Base of the sparse optimizer specs. ``stateful`` ones run on the PS."""

    stateful = False

    def check(self) -> None:
        """Raise ``ValueError`` naming a bad hyper-parameter. Local."""


@dataclass(frozen=True)
class SGD(SparseOptimizer):
    """``w -= lr * g`` for each touched row (``g`` summed over duplicate ids)."""

    lr: float = 0.01

    def check(self) -> None:
        if not (isinstance(self.lr, (int, float)) and self.lr >= 0 and self.lr == self.lr):
            raise ValueError(f"SGD: lr must be a finite number >= 0, got {self.lr!r}")
