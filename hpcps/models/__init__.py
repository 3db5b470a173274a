"""The model kinds (``model.kind``): ``registry`` (what a kind is), ``builtin`` (the built-in
kinds, registered without torch), and a module per model (``dlrm``, ``dcn``, ``linear``,
``wide_deep``, ``mf``; ``layers``: their shared parts). The models themselves are imported on first
use of their names here: a PS rank, which reads only a kind's tables, never imports torch."""

import importlib

from . import builtin  # noqa: F401  (registration)
from .registry import PARTS, ModelKind, get_kind, kinds, register

_LAZY = {"DLRM": "dlrm", "mlp": "dlrm", "MatrixFactorization": "mf", "LogisticRegression": "linear",
         "WideAndDeep": "wide_deep", "DCNv2": "dcn", "CrossNetwork": "layers", "StackedLookup": "layers",
         "fm_interaction": "layers", "embedding_penalty": "layers"}

__all__ = [*_LAZY, "ModelKind", "register", "get_kind", "kinds", "PARTS"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
