"""Building a worker's model from its config: the model over the tables' lookups, the dense
optimizer and its schedule (torch; the tables themselves: ``hpcps.train.tables``)."""

import torch

from ..config import Config
from ..core.optimizers import LRSchedule
from ..dense.optim import make_dense_optimizer
from ..models import StackedLookup, get_kind
from ..nn import ShardedEmbeddingCollection
from ..nn.dynamic import DynamicEmbeddingCollection
from ..nn.parts import ShardedEmbeddingParts
from .tables import table_parts, tables_by_part

__all__ = ["dense_optimizer", "dense_schedule", "build_model", "make_lookups"]


def dense_schedule(sec, steps: int) -> LRSchedule:
    """The learning-rate schedule of ``[optimizer.dense]``. Local."""
    return LRSchedule(kind=sec.schedule, warmup_steps=sec.warmup_steps, step_size=sec.step_size,
                      gamma=sec.gamma, total_steps=max(steps, 1), min_factor=sec.min_factor)


def dense_optimizer(sec, params, linear=()):
    """The optimizer of ``[optimizer.dense]``: torch's fused kernel (one call for every parameter),
    called without ``torch.optim``'s wrappers where torch has one for the parameters' device
    (``hpcps.dense.optim``), else the ``torch.optim`` one. ``linear``: the linear part's parameters
    among ``params`` (:func:`hpcps.models.linear.linear_params`): with ``optimizer.dense.linear_lr``
    they are a param group of their own, first, at that learning rate. Local."""
    params = list(params)
    mine = {id(p) for p in linear}
    if getattr(sec, "linear_lr", 0.0) and mine:
        rest = [p for p in params if id(p) not in mine]
        params = [{"params": [p for p in params if id(p) in mine], "lr": sec.linear_lr}] + \
            ([{"params": rest}] if rest else [])
    name = sec.name.lower()
    if name in ("sgd", "momentum"):
        m = sec.momentum or (0.9 if name == "momentum" else 0.0)
        kind, kw = "sgd", dict(lr=sec.lr, momentum=m, weight_decay=sec.weight_decay)
    elif name == "adagrad":
        kind, kw = "adagrad", dict(lr=sec.lr, weight_decay=sec.weight_decay, eps=sec.eps or 1e-10)
    elif name == "adam":
        kind, kw = "adam", dict(lr=sec.lr, betas=(sec.beta1, sec.beta2), eps=sec.eps or 1e-8,
                                weight_decay=sec.weight_decay)
    else:
        raise ValueError(f"config: optimizer.dense.name = {sec.name!r}: must be sgd, momentum, adagrad or adam")
    return make_dense_optimizer(kind, params, **kw)


def build_model(cfg: Config, embeddings, data) -> torch.nn.Module:
    """The model (``model.kind``) over the given embedding modules: ``{part: lookup}`` (hpcps
    collections in training), or one ``(B,) -> (B, dim)`` module per table in
    :func:`table_specs`'s order (torch's, in the single-process reference: each part's are
    stacked into one lookup). Local."""
    kind = get_kind(cfg.model.kind)
    if kind.tables is not None or isinstance(embeddings, dict):
        return kind.make(cfg, data, embeddings)
    lookups, at = {}, 0
    for part, specs in table_parts(cfg, data):
        lookups[part] = StackedLookup(embeddings[at:at + len(specs)])
        at += len(specs)
    return kind.make(cfg, data, lookups)


def make_lookups(cfg: Config, data, tables: list, embs: list, dynamic: bool):
    """``(the lookup a worker drives, what the model is built over)`` from the tables' embedding
    modules ``embs``. A CTR kind looks each part's tables up at once (one autograd node and one
    hook for all of them): one collection, or :class:`ShardedEmbeddingParts` over a collection per
    part; MF its tables one by one. Local."""
    if dynamic:
        lookup = DynamicEmbeddingCollection(embs[0], len(data.tables))
        return lookup, {"deep": lookup}
    if get_kind(cfg.model.kind).tables is not None:
        return embs, embs
    bags = dict(zip(tables, embs))
    parts = {part: ShardedEmbeddingCollection([bags[t] for t in ts]) for part, ts in tables_by_part(cfg, data, tables).items()}
    if len(parts) == 1:
        return next(iter(parts.values())), parts
    lookup = ShardedEmbeddingParts(parts)
    return lookup, {part: lookup[part] for part in parts}


