"""Optimizers for sparse rows, applied where the rows live.

All are *lazy*: only rows touched in a step change, and only their state.
For a row touched at every step each one equals its ``torch.optim``
counterpart (``SGD`` with momentum/weight decay, ``Adagrad`` on sparse
gradients, ``SparseAdam``; row-wise Adagrad follows FBGEMM: one accumulator
per row, the mean of the squared gradient entries).

Plain SGD with a constant learning rate and no clipping needs no PS CPU:
workers add ``-lr * grad`` straight into the weights. Every other
configuration is *stateful*: workers stage gradients next to the rows and
the owning PS rank applies the update (see ``table.py``).

``apply`` works on torch tensors that view the PS's shard and state arrays.
"""

import math
from dataclasses import dataclass, field

import numpy as np

from .malloc import populated
from .settings import F32_MAX as _F32_MAX

__all__ = ["LRSchedule", "SparseOptimizer", "SGD", "Adagrad", "Adam", "FTRL", "make_optimizer"]


@dataclass(frozen=True)
class LRSchedule:
    """Learning-rate factor per step (0-based): linear warm-up, then constant, step decay or cosine.

    kind: ``"constant"``, ``"step"`` (multiply by ``gamma`` every ``step_size``
    steps) or ``"cosine"`` (from 1 down to ``min_factor`` over ``total_steps``).
    warmup_steps: linear ramp from ``1/warmup_steps`` to 1 first.
    """

    kind: str = "constant"
    warmup_steps: int = 0
    step_size: int = 1000
    gamma: float = 0.1
    total_steps: int = 0
    min_factor: float = 0.0

    def check(self) -> None:
        if self.kind not in ("constant", "step", "cosine"):
            raise ValueError(f"schedule kind must be constant, step or cosine, got {self.kind!r}")
        if self.warmup_steps < 0 or self.step_size < 1 or self.gamma <= 0:
            raise ValueError(f"schedule needs warmup_steps >= 0, step_size >= 1, gamma > 0: {self}")
        if self.kind == "cosine" and self.total_steps < 1:
            raise ValueError("a cosine schedule needs total_steps >= 1")

    @property
    def is_constant(self) -> bool:
        return self.kind == "constant" and self.warmup_steps == 0

    def factor(self, step: int) -> float:
        """Multiplier of the base lr at 0-based ``step``. Local."""
        f = 1.0
        if self.warmup_steps and step < self.warmup_steps:
            f = (step + 1) / self.warmup_steps
        s = max(0, step - self.warmup_steps)
        if self.kind == "step":
            f *= self.gamma ** (s // self.step_size)
        elif self.kind == "cosine":
            span = max(1, self.total_steps - self.warmup_steps)
            p = min(1.0, s / span)
            f *= self.min_factor + (1 - self.min_factor) * 0.5 * (1 + math.cos(math.pi * p))
        return f


class SparseOptimizer:
    """Base of the sparse optimizer specs."""

    lr: float
    schedule: LRSchedule
    clip_norm: float

    @property
    def stateful(self) -> bool:
        """True when the owning PS must apply the update."""
        return True

    def check(self) -> None:
        """Raise ``ValueError`` naming a bad hyper-parameter. Local."""
        name = type(self).__name__
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and 0 <= self.lr <= _F32_MAX):
            raise ValueError(f"{name}: lr must be a number in [0, {_F32_MAX:.4g}] (rows are float32), got {self.lr!r}")
        if not (isinstance(self.clip_norm, (int, float)) and self.clip_norm >= 0):
            raise ValueError(f"{name}: clip_norm must be >= 0 (0 = off), got {self.clip_norm!r}")
        self.schedule.check()

    def lr_at(self, step: int) -> float:
        return float(self.lr) * self.schedule.factor(step)

    def state_shapes(self, rows: int, dim: int) -> dict:
        """Name -> shape of the per-row state arrays (float32). Local."""
        return {}

    def clip(self, g):
        """Clip each row of the summed gradient to L2 norm ``clip_norm`` (0 = off)."""
        if self.clip_norm:
            norms = g.norm(dim=1, keepdim=True)
            g = g * (self.clip_norm / norms.clamp(min=self.clip_norm))
        return g

    def apply(self, w, state: dict, rows, g, step: int, count: int):
        """Update rows ``rows`` of ``w`` with summed gradients ``g`` (torch); returns the new rows
        (a tensor the caller may read, e.g. to check they are finite). ``step`` is the 0-based
        training step (for the schedule), ``count`` the 1-based number of updates applied to
        this table so far (for bias correction)."""
        raise NotImplementedError


@dataclass(frozen=True)
class SGD(SparseOptimizer):
    """``torch.optim.SGD`` per touched row: ``g += wd*w; buf = m*buf + g; w -= lr*buf``."""

    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    schedule: LRSchedule = field(default_factory=LRSchedule)
    clip_norm: float = 0.0

    @property
    def stateful(self) -> bool:
        return bool(self.momentum or self.weight_decay or self.clip_norm or not self.schedule.is_constant)

    def check(self) -> None:
        super().check()
        if not 0 <= self.momentum < 1 or self.weight_decay < 0:
            raise ValueError(f"SGD: need 0 <= momentum < 1 and weight_decay >= 0, got {self.momentum}, "
                             f"{self.weight_decay}")

    def state_shapes(self, rows, dim):
        return {"momentum": (rows, dim)} if self.momentum else {}

    def apply(self, w, state, rows, g, step, count):
        g = self.clip(g)
        wr = w.index_select(0, rows)            # (index_select / index_copy_: w[rows] at 1/4 to 1/2 the cost)
        if self.weight_decay:
            g = g.add(wr, alpha=self.weight_decay)
        if self.momentum:
            buf = state["momentum"]
            seen = state["_seen"][rows]        # torch: the first step's buffer is the gradient itself
            b = buf.index_select(0, rows).mul_(self.momentum).add_(g)
            b[~seen] = g[~seen]
            buf.index_copy_(0, rows, b)
            state["_seen"][rows] = True
            g = b
        new = wr.add_(g, alpha=-self.lr_at(step))
        w.index_copy_(0, rows, new)
        return new


@dataclass(frozen=True)
class Adagrad(SparseOptimizer):
    """``torch.optim.Adagrad`` on sparse gradients, or FBGEMM row-wise Adagrad (``rowwise=True``)."""

    lr: float = 0.01
    eps: float = 1e-10
    initial_accumulator_value: float = 0.0
    rowwise: bool = False
    schedule: LRSchedule = field(default_factory=LRSchedule)
    clip_norm: float = 0.0

    def check(self):
        super().check()
        if self.eps <= 0 or self.initial_accumulator_value < 0:
            raise ValueError(f"Adagrad: need eps > 0 and initial_accumulator_value >= 0: {self}")

    def state_shapes(self, rows, dim):
        return {"sum": (rows,) if self.rowwise else (rows, dim)}

    def apply(self, w, state, rows, g, step, count):
        g = self.clip(g)
        acc = state["sum"]
        # index_select / index_copy_: the same values as acc[rows] / acc[rows] = s, at ~3/4 of the cost;
        # in-place addcmul_ / sqrt_ / addcdiv_ on the gathered copies: 7 passes over the rows, not 10
        if self.rowwise:
            s = acc.index_select(0, rows).add_(g.pow(2).mean(dim=1))
            acc.index_copy_(0, rows, s)
            std = s.sqrt_().add_(self.eps).unsqueeze(1)
        else:
            s = acc.index_select(0, rows).addcmul_(g, g)
            acc.index_copy_(0, rows, s)
            std = s.sqrt_().add_(self.eps)
        new = w.index_select(0, rows).addcdiv_(g, std, value=-self.lr_at(step))
        w.index_copy_(0, rows, new)
        return new


@dataclass(frozen=True)
class Adam(SparseOptimizer):
    """``torch.optim.SparseAdam``: moments and bias correction per touched entry."""

    lr: float = 0.001
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    schedule: LRSchedule = field(default_factory=LRSchedule)
    clip_norm: float = 0.0

    def check(self):
        super().check()
        b1, b2 = self.betas
        if not (0 <= b1 < 1 and 0 <= b2 < 1 and self.eps > 0):
            raise ValueError(f"Adam: need 0 <= betas < 1 and eps > 0, got betas={self.betas}, eps={self.eps}")

    def state_shapes(self, rows, dim):
        return {"exp_avg": (rows, dim), "exp_avg_sq": (rows, dim)}

    def apply(self, w, state, rows, g, step, count):
        g = self.clip(g)
        b1, b2 = self.betas
        m_old, v_old = state["exp_avg"].index_select(0, rows), state["exp_avg_sq"].index_select(0, rows)
        m_upd = (g - m_old).mul_(1 - b1)
        v_upd = g.pow(2).sub_(v_old).mul_(1 - b2)
        m_new, v_new = m_upd.add_(m_old), v_upd.add_(v_old)
        state["exp_avg"].index_copy_(0, rows, m_new)
        state["exp_avg_sq"].index_copy_(0, rows, v_new)
        step_size = self.lr_at(step) * math.sqrt(1 - b2 ** count) / (1 - b1 ** count)
        new = w.index_select(0, rows).add_(m_new / v_new.sqrt().add_(self.eps), alpha=-step_size)
        w.index_copy_(0, rows, new)
        return new


@dataclass(frozen=True)
class FTRL(SparseOptimizer):
    """FTRL-proximal (McMahan et al., "Ad Click Prediction: a View from the Trenches", KDD 2013,
    Algorithm 1) per entry, with ``alpha = lr``, ``beta``, ``l1``, ``l2``:
    ``sigma = (sqrt(n + g^2) - sqrt(n)) / alpha; z += g - sigma * w; n += g^2;
    w = 0 if |z| <= l1 else -(z - sign(z) * l1) / ((beta + sqrt(n)) / alpha + l2)``.

    The paper starts every weight at 0. Embedding rows start from their initialiser instead: at a
    row's first update ``z`` is set to the value that gives back its current weights
    (``z = -w * ((beta + sqrt(n)) / alpha + l2) - sign(w) * l1``), so a row with zero initial weights
    follows the paper exactly and any other starts where it was. With ``l1 > 0`` entries whose
    accumulated gradient stays within ``l1`` are exactly 0 (sparse models)."""

    lr: float = 0.05
    beta: float = 1.0
    l1: float = 0.0
    l2: float = 0.0
    initial_accumulator_value: float = 0.0
    schedule: LRSchedule = field(default_factory=LRSchedule)
    clip_norm: float = 0.0

    def check(self):
        super().check()
        if self.lr <= 0 or self.beta < 0 or self.l1 < 0 or self.l2 < 0 or self.initial_accumulator_value < 0:
            raise ValueError(f"FTRL: need lr > 0 and beta, l1, l2, initial_accumulator_value >= 0: {self}")
        if not (self.beta or self.l2 or self.initial_accumulator_value):
            raise ValueError("FTRL: beta, l2 and initial_accumulator_value are all 0: the first update of an "
                             "entry would divide by 0; use beta > 0 (the paper's 1.0)")

    def state_shapes(self, rows, dim):
        return {"z": (rows, dim), "n": (rows, dim)}

    def _denominator(self, n, alpha):
        return n.sqrt().add_(self.beta).div_(alpha).add_(self.l2)

    def apply(self, w, state, rows, g, step, count):
        g = self.clip(g)
        alpha = self.lr_at(step)
        wr, z, n = (t.index_select(0, rows) for t in (w, state["z"], state["n"]))
        fresh = ~state["_seen"][rows]
        if fresh.any():               # z that reproduces the row's current weights
            wf = wr[fresh]
            z[fresh] = -wf * self._denominator(n[fresh], alpha) - wf.sign() * self.l1
            state["_seen"][rows] = True
        n_new = n + g * g
        sigma = (n_new.sqrt() - n.sqrt()).div_(alpha)
        z.add_(g).sub_(sigma * wr)
        new = -(z - z.sign() * self.l1) / self._denominator(n_new, alpha)
        new[z.abs() <= self.l1] = 0.0
        state["z"].index_copy_(0, rows, z)
        state["n"].index_copy_(0, rows, n_new)
        w.index_copy_(0, rows, new)
        return new


_NAMES = {"sgd": SGD, "momentum": SGD, "adagrad": Adagrad, "rowwise_adagrad": Adagrad, "adam": Adam, "ftrl": FTRL}


def make_optimizer(name: str, **kw) -> SparseOptimizer:
    """Build an optimizer by config name: sgd, momentum, adagrad, rowwise_adagrad, adam, ftrl. Local."""
    key = name.lower().replace("-", "_")
    if key not in _NAMES:
        raise ValueError(f"unknown sparse optimizer {name!r}; choose one of {sorted(_NAMES)}")
    if key == "rowwise_adagrad":
        kw["rowwise"] = True
    if key == "momentum" and not kw.get("momentum"):
        kw["momentum"] = 0.9
    opt = _NAMES[key](**kw)
    opt.check()
    return opt


def new_state(opt: SparseOptimizer, rows: int, dim: int, written: bool = True) -> dict:
    """State arrays for ``rows`` rows (numpy float32; ``_seen`` flags for momentum), as they start
    (:func:`reset_state`); ``written=False``: left unwritten, for a restore that writes every row
    (or a later ``reset_state``). Local."""
    make = np.empty if written else populated         # a restore writes it whole: its pages now
    state = {name: make(shape, np.float32) for name, shape in opt.state_shapes(rows, dim).items()}
    if getattr(opt, "momentum", 0) or isinstance(opt, FTRL):
        state["_seen"] = np.zeros(rows, dtype=bool)
    if written:
        reset_state(opt, state)
    return state


def reset_state(opt: SparseOptimizer, state: dict) -> None:
    """Write every state array as it starts: the accumulators' initial value, else zeros. Local."""
    for name, a in state.items():
        a[...] = getattr(opt, "initial_accumulator_value", 0.0) if name in ("sum", "n") else 0
