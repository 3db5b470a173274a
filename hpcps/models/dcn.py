"""``model.kind = "dcn"``: DCN-v2 (Wang et al. 2021), stacked. The features' embeddings and the
dense features, ``x0``, go through ``model.cross_layers`` cross layers (full rank, or of rank
``model.cross_rank``)
(``x_{l+1} = x0 * (W x_l + b) + x_l``: explicit feature crosses of rising order), then an MLP
(``model.top_mlp``) to one logit."""

import torch
from torch import nn

from .dlrm import mlp
from .layers import CrossNetwork

__all__ = ["DCNv2"]


class DCNv2(nn.Module):
    """``forward(dense, [ids per feature]) -> logits (B,)``. ``deep``: a lookup of ``(B, features, dim)``."""

    def __init__(self, deep, num_features: int, num_dense: int, dim: int, cross_layers: int = 3,
                 hidden=(64, 32), dropout: float = 0.0, cross_rank: int = 0):
        super().__init__()
        self.deep = deep
        width = num_features * dim + num_dense
        self.cross = CrossNetwork(width, cross_layers, cross_rank)
        self.mlp = mlp([width, *hidden, 1], last_activation=False, dropout=dropout)
        self.looked_up = []

    def forward(self, dense, sparse):
        e = self.deep(sparse)
        self.looked_up = [e]
        return self.mlp(self.cross(torch.cat([e.flatten(1), dense], dim=1))).squeeze(1)


def build(cfg, data, parts) -> DCNv2:
    """``model.kind = "dcn"`` over ``parts`` (``hpcps.models.builtin``). Local."""
    m = cfg.model
    return DCNv2(parts["deep"], len(data.tables), data.num_dense, m.dim, m.cross_layers, m.top_mlp,
                 dropout=m.dropout, cross_rank=m.cross_rank)
