"""The model kinds (``model.kind``): each module registers one or more (``registry``)."""

import torch

from . import dcn, linear, wide_deep  # noqa: F401  (registration)
from .dlrm import DLRM, mlp
from .layers import CrossNetwork, StackedLookup, fm_interaction
from .linear import LogisticRegression
from .mf import MatrixFactorization
from .registry import PARTS, ModelKind, get_kind, kinds, register
from .wide_deep import WideAndDeep
from .dcn import DCNv2

__all__ = ["DLRM", "mlp", "MatrixFactorization", "LogisticRegression", "WideAndDeep", "DCNv2", "CrossNetwork",
           "StackedLookup", "fm_interaction", "embedding_penalty", "ModelKind", "register", "get_kind", "kinds",
           "PARTS"]


def embedding_penalty(model) -> torch.Tensor:
    """The sum of squares of the embedding rows the model's last forward looked up, one term per
    occurrence (a row in 5 samples of the batch counts 5 times): ``l2 * embedding_penalty(model)``
    added to the batch's summed loss is the per-occurrence L2 of the literature, and its gradient
    reaches the rows through the normal push. A multi-hot bag counts as its pooled vector. Local."""
    return sum(t.pow(2).sum() for t in model.looked_up)
