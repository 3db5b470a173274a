"""Reference models: DLRM-style CTR and matrix factorisation."""

import torch

from .dlrm import DLRM, mlp
from .mf import MatrixFactorization

__all__ = ["DLRM", "mlp", "MatrixFactorization", "embedding_penalty"]


def embedding_penalty(model) -> torch.Tensor:
    """The sum of squares of the embedding rows the model's last forward looked up, one term per
    occurrence (a row in 5 samples of the batch counts 5 times): ``l2 * embedding_penalty(model)``
    added to the batch's summed loss is the per-occurrence L2 of the literature, and its gradient
    reaches the rows through the normal push. A multi-hot bag counts as its pooled vector. Local."""
    return sum(t.pow(2).sum() for t in model.looked_up)
