"""Matrix factorisation with user and item biases, for ratings."""

import torch
from torch import nn

__all__ = ["MatrixFactorization"]


class MatrixFactorization(nn.Module):
    """``forward(dense, [users, items]) -> user·item + b_user + b_item + mu``.

    ``embeddings`` = [user vectors, item vectors, user biases (dim 1), item biases (dim 1)].
    After a forward, ``looked_up`` holds the rows it used (``hpcps.models.embedding_penalty``).
    """

    def __init__(self, embeddings, global_bias: float = 0.0):
        super().__init__()
        self.user, self.item, self.user_bias, self.item_bias = embeddings
        self.mu = nn.Parameter(torch.tensor(float(global_bias)))
        self.looked_up = []

    def forward(self, dense, sparse):
        users, items = (ids.view(-1, 1) for ids in sparse)
        u, i, bu, bi = self.user(users), self.item(items), self.user_bias(users), self.item_bias(items)
        self.looked_up = [u, i, bu, bi]
        return (u * i).sum(dim=1) + bu.squeeze(1) + bi.squeeze(1) + self.mu


def build(cfg, data, tables) -> MatrixFactorization:
    """``model.kind = "mf"`` over its ``tables``' modules (``hpcps.models.builtin``). Local."""
    return MatrixFactorization(tables, global_bias=getattr(data, "mean_rating", 0.0))
