"""``model.kind = "lr"``: logistic regression on the PS. A weight per table row (one-dim rows of
the wide part, trained by [optimizer.wide]) and per dense feature, and a bias: hashed logistic
regression as ``hpcps baseline`` fits it, trained as the other kinds are."""

import torch
from torch import nn

from .layers import first_order

__all__ = ["LogisticRegression", "DenseLinear", "linear_params"]


class DenseLinear(nn.Module):
    """The dense features' weights and the bias, at zero: ``(B, num_dense) -> (B,)``."""

    def __init__(self, num_dense: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_dense))
        self.bias = nn.Parameter(torch.zeros(()))

    def forward(self, dense):
        return (dense @ self.weight if self.weight.numel() else dense.new_zeros(dense.shape[0])) + self.bias


def linear_params(model: nn.Module) -> list:
    """The parameters of ``model``'s linear part over the dense features (its :class:`DenseLinear`
    modules: weights and bias), which ``optimizer.dense.linear_lr`` trains at a rate of its own. Local."""
    return [p for m in model.modules() if isinstance(m, DenseLinear) for p in m.parameters()]


class LogisticRegression(nn.Module):
    """``forward(dense, [ids per feature]) -> logits (B,)``: the sum of the ids' wide weights plus
    :class:`DenseLinear`. ``wide``: a lookup of ``(B, features, 1)``."""

    def __init__(self, wide, num_dense: int):
        super().__init__()
        self.wide = wide
        self.linear = DenseLinear(num_dense)
        self.looked_up = []

    def forward(self, dense, sparse):
        w = self.wide(sparse)
        self.looked_up = [w]
        return first_order(w) + self.linear(dense)


def build(cfg, data, parts) -> LogisticRegression:
    """``model.kind = "lr"`` over ``parts`` (``hpcps.models.builtin``). Local."""
    return LogisticRegression(parts["wide"], data.num_dense)
