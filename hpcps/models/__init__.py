"""Reference models: DLRM-style CTR and matrix factorisation."""

from .dlrm import DLRM, mlp
from .mf import MatrixFactorization

__all__ = ["DLRM", "mlp", "MatrixFactorization"]
