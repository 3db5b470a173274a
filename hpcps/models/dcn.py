"""``model.kind = "dcn"``: DCN-v2 (Wang et al. 2021), stacked. The features' embeddings and the
dense features, ``x0``, go through ``model.cross_layers`` cross layers (full rank, or of rank
``model.cross_rank``)
(``x_{l+1} = x0 * (W x_l + b) + x_l``: explicit feature crosses of rising order), then an MLP
(``model.top_mlp``) to one logit."""

import torch
from torch import nn

from .dlrm import mlp
from .layers import CrossNetwork
from .registry import ModelKind, register

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


register(ModelKind("dcn", "ctr", ("deep",), lambda cfg, data, parts: DCNv2(
    parts["deep"], len(data.tables), data.num_dense, cfg.model.dim, cfg.model.cross_layers, cfg.model.top_mlp,
    dropout=cfg.model.dropout, cross_rank=cfg.model.cross_rank)))
