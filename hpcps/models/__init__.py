"""Reference models: DLRM-style CTR and matrix factorisation."""

from .dlrm import DLRM, build_dlrm, mlp
from .mf import MatrixFactorization

__all__ = ["DLRM", "build_dlrm", "mlp", "MatrixFactorization"]
