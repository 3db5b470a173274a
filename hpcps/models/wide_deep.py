"""``model.kind = "wide_deep"`` (Cheng et al. 2016) and ``"deepfm"`` (Guo et al. 2017): a wide,
linear part (one-dim rows on the PS and the dense features' weights) plus an MLP over the
features' embeddings and the dense features; DeepFM adds the factorisation machine's pairwise
term over the embeddings. On little data the wide part does what logistic regression does, and
the deep part adds what the interactions hold."""

import torch
from torch import nn

from .dlrm import mlp
from .layers import first_order, fm_interaction
from .linear import DenseLinear

__all__ = ["WideAndDeep"]


class WideAndDeep(nn.Module):
    """``forward(dense, [ids per feature]) -> logits (B,)``. ``deep``: a lookup of ``(B, features,
    dim)``; ``wide``: of ``(B, features, 1)``. ``hidden``: the MLP's hidden widths (its input is
    every embedding and the dense features, its output one logit); ``fm``: add the pairwise dots
    of the embeddings (DeepFM)."""

    def __init__(self, deep, wide, num_features: int, num_dense: int, dim: int, hidden=(64, 32),
                 dropout: float = 0.0, fm: bool = False):
        super().__init__()
        self.deep, self.wide, self.fm = deep, wide, fm
        self.linear = DenseLinear(num_dense)
        self.mlp = mlp([num_features * dim + num_dense, *hidden, 1], last_activation=False, dropout=dropout)
        # the deep part starts silent: the model starts as the linear one and the MLP adds only what
        # it learns (on little data a random start of the MLP's logit is noise the wide part must undo)
        torch.nn.init.zeros_(self.mlp[-1].weight)
        torch.nn.init.zeros_(self.mlp[-1].bias)
        self.looked_up = []

    def forward(self, dense, sparse):
        e, w = self.deep(sparse), self.wide(sparse)
        self.looked_up = [e, w]
        out = first_order(w) + self.linear(dense) + self.mlp(torch.cat([e.flatten(1), dense], dim=1)).squeeze(1)
        return out + fm_interaction(e) if self.fm else out


def build(cfg, data, parts, fm: bool = False) -> WideAndDeep:
    """``model.kind = "wide_deep"`` over ``parts`` (``hpcps.models.builtin``); ``fm``: DeepFM. Local."""
    m = cfg.model
    return WideAndDeep(parts["deep"], parts["wide"], len(data.tables), data.num_dense, m.dim, m.top_mlp,
                       dropout=m.dropout, fm=fm)


def build_deepfm(cfg, data, parts) -> WideAndDeep:
    """``model.kind = "deepfm"`` (``hpcps.models.builtin``). Local."""
    return build(cfg, data, parts, fm=True)
