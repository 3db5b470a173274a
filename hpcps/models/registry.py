"""The model kinds ``hpcps train`` knows (``model.kind``): what tables each needs and how to build
it over them. A kind is one module of this package that calls :func:`register`; nothing in
``hpcps.train`` names a kind. Local, pure."""

import importlib
from dataclasses import dataclass
from typing import Callable

__all__ = ["ModelKind", "register", "get_kind", "kinds", "PARTS"]

# A CTR kind's tables come in parts, one table per categorical feature in each:
#   deep: model.dim-wide rows (model.init), the embeddings the interactions and MLPs read;
#   wide: one weight per row (zeros at start), the linear part (logistic regression's weights),
#         trained by [optimizer.wide] (or [optimizer.sparse] when its name is empty).
# hpcps keeps each part in one table-batched table (model.fuse_tables) named after PARTS.
PARTS = {"deep": "embeddings", "wide": "wide"}


@dataclass(frozen=True)
class ModelKind:
    """``name`` (``model.kind``), ``task`` (``ctr`` or ``ratings``), ``parts`` (which of
    :data:`PARTS` its tables hold, CTR kinds), ``build(cfg, data, lookups)``: the module, where
    ``lookups`` maps each part to a module that takes the list of every feature's ``(B,)`` ids
    and returns ``(B, features, dim)``. ``mlps``: whether ``model.top_mlp``/``dropout`` mean
    anything to it. ``tables(cfg, data)``: a kind whose tables are not parts over the features
    (matrix factorisation) lists them itself, ``[(name, rows, dim, init, init_scale)]``, and its
    ``build`` gets their modules as a list, in that order. ``build`` may be ``"module:function"``,
    imported on first :meth:`make` (the built-in kinds, ``hpcps.models.builtin``: a PS rank reads a
    kind's parts and tables without importing torch)."""
    name: str
    task: str
    parts: tuple
    build: Callable | str
    mlps: bool = True
    tables: Callable | None = None

    def make(self, cfg, data, lookups):
        """The kind's module over ``lookups`` (``build``'s arguments). Local."""
        build = self.build
        if isinstance(build, str):
            module, _, name = build.partition(":")
            build = getattr(importlib.import_module(module), name)
        return build(cfg, data, lookups)


_KINDS: dict = {}


def register(kind: ModelKind) -> ModelKind:
    """Make ``kind`` a valid ``model.kind``. Local."""
    if not set(kind.parts) <= set(PARTS):
        raise ValueError(f"model kind {kind.name!r}: parts must be among {sorted(PARTS)}, got {kind.parts}")
    _KINDS[kind.name] = kind
    return kind


def get_kind(name: str) -> ModelKind:
    """The registered kind ``name``; ``ValueError`` naming the known ones. Local."""
    try:
        return _KINDS[name]
    except KeyError:
        raise ValueError(f"config: model.kind = {name!r}: must be one of {', '.join(kinds())}") from None


def kinds() -> tuple:
    """The registered kinds' names, in registration order. Local."""
    return tuple(_KINDS)
