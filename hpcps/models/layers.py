"""Building blocks the CTR kinds share: lookups over plain torch embeddings, the first-order (wide)
term, the factorisation machine's pairwise term, DCN-v2's cross layers. Local."""

import torch
from torch import nn

__all__ = ["StackedLookup", "first_order", "fm_interaction", "CrossNetwork", "embedding_penalty"]


class StackedLookup(nn.Module):
    """One ``(B,) ids -> (B, dim)`` module per feature (``torch.nn.EmbeddingBag`` in the
    single-process reference) as one lookup: ``forward([ids per feature]) -> (B, features, dim)``,
    what ``hpcps.nn.ShardedEmbeddingCollection`` gives in training."""

    def __init__(self, embeddings):
        super().__init__()
        self.tables = nn.ModuleList(embeddings)

    def __len__(self) -> int:
        return len(self.tables)

    def forward(self, sparse):
        return torch.stack([t(ids.view(-1, 1)) for t, ids in zip(self.tables, sparse)], dim=1)


def first_order(weights: torch.Tensor) -> torch.Tensor:
    """``(B, features, 1)`` wide weights -> ``(B,)``: their sum, the linear model's sparse part."""
    return weights.sum(dim=(1, 2))


def fm_interaction(emb: torch.Tensor) -> torch.Tensor:
    """``(B, features, dim)`` -> ``(B,)``: the sum over feature pairs of their dot products,
    ``((sum v)^2 - sum v^2) / 2`` summed over dim (Rendle's identity: linear in the features)."""
    s = emb.sum(dim=1)
    return 0.5 * (s * s - (emb * emb).sum(dim=1)).sum(dim=1)


class CrossNetwork(nn.Module):
    """DCN-v2's cross layers (Wang et al. 2021): ``x_{l+1} = x0 * (W_l x_l + b_l) + x_l``; with
    ``rank`` > 0 each ``W_l`` is low-rank, ``U_l V_l^T`` (``width x rank`` each), as in the MLPerf
    DLRM-DCNv2 reference (rank 512)."""

    def __init__(self, width: int, layers: int, rank: int = 0):
        super().__init__()
        if rank and rank < width:
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, rank, bias=False), nn.Linear(rank, width))
                                        for _ in range(layers))
        else:
            self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for layer in self.layers:
            x = x0 * layer(x) + x
        return x


def embedding_penalty(model) -> torch.Tensor:
    """The sum of squares of the embedding rows the model's last forward looked up, one term per
    occurrence (a row in 5 samples of the batch counts 5 times): ``l2 * embedding_penalty(model)``
    added to the batch's summed loss is the per-occurrence L2 of the literature, and its gradient
    reaches the rows through the normal push. A multi-hot bag counts as its pooled vector. Local."""
    return sum(t.pow(2).sum() for t in model.looked_up)
