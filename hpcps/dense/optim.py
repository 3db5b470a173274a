"""The dense part's optimizer: torch's fused kernels, called without ``torch.optim``.

``torch.optim.SGD/Adagrad/Adam(fused=True)`` run one fused kernel per step
(``torch._fused_sgd_``, ``_fused_adagrad_``, ``_fused_adam_``). Their wrappers import
``torch._dynamo`` the first time an optimizer is made or steps (``Optimizer.__init__`` is
wrapped by ``torch._disable_dynamo``, ``step`` calls ``torch._dynamo.graph_break``): 1.0 s of
a worker's start on the development VM, as much as ``import torch`` itself, and a 4-rank
launch of a 30-step job took ~5.8 s in all. :class:`FusedOptimizer` calls the same kernels
with the same arguments, so each step gives the bits ``torch.optim`` gives (tested), and keeps
its state and ``state_dict`` in ``torch.optim``'s layout, so checkpoints written with either
load into either. Where a kernel is missing (another device or dtype) :func:`make_dense_optimizer`
returns the ``torch.optim`` optimizer instead. Local.
"""

import torch

__all__ = ["FusedOptimizer", "make_dense_optimizer", "KINDS"]

KINDS = ("sgd", "adagrad", "adam")

# torch.optim's param_group keys beside "params" and the hyper-parameters given (state_dict layout)
_GROUP = {"sgd": {"dampening": 0.0, "nesterov": False, "maximize": False, "foreach": None,
                  "differentiable": False, "fused": True},
          "adagrad": {"lr_decay": 0.0, "initial_accumulator_value": 0.0, "foreach": None, "maximize": False,
                      "differentiable": False, "fused": True},
          "adam": {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                   "differentiable": False, "fused": True, "decoupled_weight_decay": False}}


class FusedOptimizer:
    """Param groups (``params``: tensors, or dicts of ``params`` and their own hyper-parameters, as
    ``torch.optim`` takes) of ``kind`` (``sgd``: ``lr, momentum, weight_decay``; ``adagrad``:
    ``lr, weight_decay, eps``; ``adam``: ``lr, betas, eps, weight_decay``) over float CPU or CUDA
    tensors. The parts of ``torch.optim.Optimizer`` that hpcps uses: ``param_groups``,
    ``state`` (per parameter), ``step()``, ``zero_grad()``, ``state_dict()``, ``load_state_dict()``. Local."""

    def __init__(self, kind: str, params, **hyper):
        if kind not in KINDS:
            raise ValueError(f"FusedOptimizer: kind must be one of {KINDS}, got {kind!r}")
        self.kind = kind
        params = list(params)
        groups = params if params and isinstance(params[0], dict) else [{"params": params}]
        # as torch.optim: a group's own hyper-parameters (e.g. its lr) over the defaults given
        self.param_groups = [{**hyper, **_GROUP[kind], **g, "params": list(g["params"])} for g in groups]
        self.state: dict = {}
        if kind == "adagrad":           # torch.optim.Adagrad fills its state when made
            for p in self._params():
                self.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                                 "sum": torch.zeros_like(p, memory_format=torch.preserve_format)}

    def _params(self) -> list:
        return [p for g in self.param_groups for p in g["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop (or zero) every parameter's gradient, as ``torch.optim``'s. Local."""
        for p in self._params():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()

    @torch.no_grad()
    def step(self) -> None:
        """One step of every parameter that has a gradient (as ``torch.optim``'s fused step: one
        kernel a param group). Local."""
        for g in self.param_groups:
            self._step(g)

    def _step(self, g) -> None:
        params = [p for p in g["params"] if p.grad is not None]
        if not params:
            return
        grads = [p.grad for p in params]
        if self.kind == "sgd":
            self._sgd(g, params, grads)
        elif self.kind == "adagrad":
            sums = [self.state[p]["sum"] for p in params]
            steps = [self.state[p]["step"] for p in params]
            torch._foreach_add_(steps, 1)
            torch._fused_adagrad_(params, grads, sums, steps, lr=g["lr"], lr_decay=g["lr_decay"],
                                  weight_decay=g["weight_decay"], eps=g["eps"], maximize=False,
                                  grad_scale=None, found_inf=None)
        else:
            for p in params:
                if not self.state.get(p):
                    self.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                                     "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                     "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
            st = [self.state[p] for p in params]
            steps = [s["step"] for s in st]
            torch._foreach_add_(steps, 1)
            beta1, beta2 = g["betas"]
            torch._fused_adam_(params, grads, [s["exp_avg"] for s in st], [s["exp_avg_sq"] for s in st], [],
                               steps, amsgrad=False, lr=g["lr"], beta1=beta1, beta2=beta2,
                               weight_decay=g["weight_decay"], eps=g["eps"], maximize=False,
                               grad_scale=None, found_inf=None)

    def _sgd(self, g, params, grads) -> None:
        momentum = g["momentum"]
        bufs = []
        first = False
        if momentum != 0:
            bufs = [self.state.get(p, {}).get("momentum_buffer") for p in params]
            first = all(b is None for b in bufs)
            if first:
                bufs = [torch.empty_like(x) for x in grads]
        torch._fused_sgd_(params, grads, bufs, weight_decay=g["weight_decay"], momentum=momentum, lr=g["lr"],
                          dampening=g["dampening"], nesterov=g["nesterov"], maximize=False,
                          is_first_step=first, grad_scale=None, found_inf=None)
        for p, b in zip(params, bufs):
            self.state.setdefault(p, {})["momentum_buffer"] = b

    def state_dict(self) -> dict:
        """``torch.optim.Optimizer.state_dict``'s layout: state by parameter index (tensors, not
        copies; indices run on across the groups), each param group with ``params`` as indices. Local."""
        index = {id(p): i for i, p in enumerate(self._params())}
        state = {index[id(p)]: dict(st) for p, st in self.state.items() if st}
        groups, at = [], 0
        for g in self.param_groups:
            group = {k: v for k, v in g.items() if k != "params"}
            group["params"] = list(range(at, at + len(g["params"])))
            at += len(g["params"])
            groups.append(group)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, sd: dict) -> None:
        """Take a ``state_dict`` of this class or of the ``torch.optim`` optimizer of the same kind:
        hyper-parameters from its groups, state tensors cast to each parameter's dtype and device
        (``step`` kept float32, as torch keeps it for fused kernels). Local."""
        groups = sd["param_groups"]
        mine = [len(g["params"]) for g in self.param_groups]
        if [len(x["params"]) for x in groups] != mine:
            raise ValueError(f"the optimizer state holds {sum(len(x['params']) for x in groups)} parameter(s) in "
                             f"{len(groups)} group(s); this model has {sum(mine)} in {len(mine)} "
                             f"(optimizer.dense.linear_lr set on one side only?)")
        for g, theirs in zip(self.param_groups, groups):
            g.update({k: v for k, v in theirs.items() if k != "params" and k in g})
            if "betas" in g:
                g["betas"] = tuple(g["betas"])
        self.state = {}
        for i, p in enumerate(self._params()):
            st = sd["state"].get(i, sd["state"].get(str(i)))
            if not st:
                continue
            self.state[p] = {k: (torch.as_tensor(v).to(device=p.device, dtype=torch.float32) if k == "step"
                                 else torch.as_tensor(v).to(device=p.device, dtype=p.dtype))
                             for k, v in st.items()}


def make_dense_optimizer(kind: str, params, **hyper):
    """A :class:`FusedOptimizer` where torch has the fused kernel for every parameter (float32/64,
    CPU or CUDA), else ``torch.optim``'s optimizer of ``kind`` (``lr, momentum, weight_decay`` /
    ``lr, weight_decay, eps`` / ``lr, betas, eps, weight_decay``). Local."""
    params = list(params)
    tensors = [p for g in params for p in g["params"]] if params and isinstance(params[0], dict) else params
    if all(p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.float64) for p in tensors):
        return FusedOptimizer(kind, params, **hyper)
    cls = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam}[kind]
    return cls(params, **hyper)
