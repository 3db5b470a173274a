"""A DLRM-style CTR model: bottom MLP, one embedding table per categorical
feature, pairwise dot interaction (or, ``model.interaction = "dcn"``, DCN-v2 cross layers over
the bottom MLP's output and the embeddings: DLRM-DCNv2, MLPerf's reference), top MLP, one logit."""

import torch
from torch import nn

from .layers import CrossNetwork

__all__ = ["DLRM", "mlp", "pair_spread", "pairwise_dots"]


def mlp(sizes, last_activation: bool, dropout: float = 0.0) -> nn.Sequential:
    """Linear layers with ReLU between them (and after the last with ``last_activation``);
    ``dropout`` after each hidden layer's ReLU. Local."""
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        hidden = i < len(sizes) - 2
        if hidden or last_activation:
            layers.append(nn.ReLU())
        if hidden and dropout:
            layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers)


class _PairwiseDots(torch.autograd.Function):
    """``bmm(T, T^T)`` read at the flat positions ``pairs``: autograd's own graph for that costs two
    ``bmm`` and a scatter in backward; the gradient ``(G + G^T) T`` needs one ``bmm``. No pair comes
    with its mirror or on the diagonal, so ``G + G^T`` is ``grad`` copied to both ``(i, j)`` and
    ``(j, i)``: the same bits (each sum added a zero), without the add. That copy is one small
    matrix product, ``grad @ spread`` (:func:`pair_spread`: a single 1 per column that a pair
    fills), ~2x faster on CPU than zeros and two ``index_copy_``, and the same bits for finite
    gradients (each entry is one ``grad`` value times 1, plus zeros)."""

    @staticmethod
    def forward(ctx, T, pairs, spread):
        B, n, _ = T.shape
        ctx.save_for_backward(T, spread)
        return torch.bmm(T, T.transpose(1, 2)).view(B, n * n).index_select(1, pairs)

    @staticmethod
    def backward(ctx, grad):
        T, spread = ctx.saved_tensors
        B, n, _ = T.shape
        G = torch.mm(grad, spread)
        return torch.bmm(G.view(B, n, n), T), None, None


def pair_spread(pairs: torch.Tensor, n: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """``(len(pairs), n * n)`` of zeros with a 1 at ``(p, pairs[p])`` and at its mirror ``(p, j * n +
    i)``: ``grad @ pair_spread(...)`` is the symmetric ``(B, n * n)`` gradient of the pairwise dots
    (what :class:`DLRM` keeps as a buffer beside its pairs). Local."""
    pairs = pairs.to(device)
    spread = torch.zeros((pairs.numel(), n * n), dtype=dtype, device=device)
    rows = torch.arange(pairs.numel(), device=device)
    spread[rows, pairs] = 1
    spread[rows, (pairs % n) * n + pairs // n] = 1
    return spread


def pairwise_dots(T: torch.Tensor, pairs: torch.Tensor, spread: torch.Tensor | None = None) -> torch.Tensor:
    """``(B, n, d) -> (B, len(pairs))``: the dot products of the feature pairs ``(i, j)``, given as
    flat indices ``i * n + j`` with ``i != j`` (each unordered pair at most once). ``spread``:
    :func:`pair_spread` of ``pairs`` for ``T``'s ``n``, dtype and device, made here if None. Local."""
    if spread is None or spread.dtype != T.dtype or spread.device != T.device:
        spread = pair_spread(pairs, T.shape[1], T.dtype, T.device)
    return _PairwiseDots.apply(T, pairs, spread)


class DLRM(nn.Module):
    """``forward(dense (B, num_dense), sparse [(B,) ids per table]) -> logits (B,)``.

    ``embeddings`` are modules mapping ``(B, 1)`` ids to ``(B, dim)``: hpcps
    ``ShardedEmbeddingBag`` in training, ``torch.nn.EmbeddingBag`` in the
    single-process reference. Or one module mapping the list of every table's
    ``(B,)`` ids to ``(B, tables, dim)`` (``hpcps.nn.ShardedEmbeddingCollection``,
    what ``hpcps train`` uses): the same model, fewer autograd nodes. ``dropout``: after each
    hidden layer of both MLPs (``model.eval()`` turns it off). After a forward, ``looked_up`` holds
    the embedding rows it used (for :func:`embedding_penalty`).
    """

    def __init__(self, embeddings, num_dense: int, dim: int, bottom_mlp=(64,), top_mlp=(64, 32),
                 dropout: float = 0.0, interaction: str = "dot", cross_layers: int = 3, cross_rank: int = 0):
        super().__init__()
        self.collection = isinstance(embeddings, nn.Module) and not isinstance(embeddings, nn.ModuleList)
        self.embeddings = embeddings if self.collection else nn.ModuleList(embeddings)
        self.bottom = mlp([num_dense, *bottom_mlp, dim], last_activation=True, dropout=dropout) if num_dense else None
        n = len(self.embeddings) + (1 if num_dense else 0)
        i, j = torch.tril_indices(n, n, offset=-1)       # strictly lower triangle, as flat indices
        self.register_buffer("_pairs", i * n + j, persistent=False)
        self.register_buffer("_spread", pair_spread(self._pairs, n), persistent=False)
        top_in = (dim if num_dense else 0) + n * (n - 1) // 2
        self.cross = None
        if interaction == "dcn":                   # the features' vectors, crossed, go to the top MLP
            self.cross = CrossNetwork(n * dim, cross_layers, cross_rank)
            top_in = n * dim
        self.top = mlp([top_in, *top_mlp, 1], last_activation=False, dropout=dropout)
        self.looked_up = []

    def forward(self, dense, sparse):
        x = self.bottom(dense) if self.bottom is not None else None
        if self.collection:
            T = self.embeddings(sparse)                      # (B, tables, dim)
            self.looked_up = [T]
            if x is not None:
                T = torch.cat([x.unsqueeze(1), T], dim=1)
        else:
            feats = [emb(ids.view(-1, 1)) for emb, ids in zip(self.embeddings, sparse)]
            self.looked_up = feats
            T = torch.stack(([x] if x is not None else []) + feats, dim=1)   # (B, n, dim)
        if self.cross is not None:
            return self.top(self.cross(T.flatten(1))).squeeze(1)
        inter = pairwise_dots(T, self._pairs, self._spread)              # (B, n (n - 1) / 2)
        top_in = torch.cat([x, inter], dim=1) if x is not None else inter
        return self.top(top_in).squeeze(1)


def build(cfg, data, parts) -> DLRM:
    """``model.kind = "dlrm"`` over ``parts`` (``hpcps.models.builtin``). Local."""
    m = cfg.model
    return DLRM(parts["deep"], data.num_dense, m.dim, m.bottom_mlp, m.top_mlp, dropout=m.dropout,
                interaction=m.interaction, cross_layers=m.cross_layers, cross_rank=m.cross_rank)
