"""Single-process PyTorch training of the same model on the same global batches.

The yardstick for ``sync`` mode (and the single-process baseline of the
benchmarks): embeddings are ``torch.nn.EmbeddingBag(sparse=True)`` holding the
same initial rows as the hpcps tables; sparse optimizers are ``torch.optim``
(SGD, Adagrad, SparseAdam) where torch has the lazy sparse form, and the hpcps
row-wise update (the same formulas, applied to the coalesced sparse gradient)
for momentum, weight decay, row-wise Adagrad, clipping and schedules, which
torch only offers densely. Local; imports no MPI.
"""

import numpy as np
import torch

from ..config import Config
from ..data import make_data
from ..core.ids import initial_rows
from ..core.optimizers import SGD, Adagrad, Adam, new_state
from ..models import embedding_penalty
from ..models.linear import linear_params
from ..train import build_model, dense_optimizer, dense_schedule, table_parts, total_steps
from ..train.tables import part_optimizer

__all__ = ["train_reference"]


def _torch_sparse_optimizer(opt, params):
    """The torch.optim equivalent, or None when only the hpcps row-wise form exists."""
    if not opt.schedule.is_constant or opt.clip_norm:
        return None
    if isinstance(opt, SGD) and not opt.momentum and not opt.weight_decay:
        return torch.optim.SGD(params, lr=opt.lr)
    if isinstance(opt, Adagrad) and not opt.rowwise:
        return torch.optim.Adagrad(params, lr=opt.lr, eps=opt.eps,
                                   initial_accumulator_value=opt.initial_accumulator_value)
    if isinstance(opt, Adam):
        return torch.optim.SparseAdam(params, lr=opt.lr, betas=opt.betas, eps=opt.eps)
    return None


def train_reference(cfg: Config, steps: int | None = None) -> dict:
    """Train in one process; returns ``{"dense/<name>": array, "tables/<name>": array}``. Local."""
    data = make_data(cfg.data, cfg.job.seed, 1, 0)
    steps = total_steps(cfg, data) if steps is None else steps
    torch.manual_seed(cfg.job.seed)
    embs, names, opts = [], [], []
    for part, specs in table_parts(cfg, data):
        opt = part_optimizer(cfg, part, steps)
        for name, rows, dim, kind, scale in specs:
            w = torch.from_numpy(initial_rows(cfg.job.seed, name, np.arange(rows), dim, scale, kind=kind))
            embs.append(torch.nn.EmbeddingBag.from_pretrained(w, freeze=False, mode="sum", sparse=True))
            names.append(name)
            opts.append(opt)
    model = build_model(cfg, embs, data)
    emb_params = [e.weight for e in embs]
    emb_ids = {id(p) for p in emb_params}
    dense_params = [p for p in model.parameters() if id(p) not in emb_ids]
    dopt = dense_optimizer(cfg.optimizer.dense, dense_params, linear_params(model))
    dsched = dense_schedule(cfg.optimizer.dense, steps)
    base = [g["lr"] for g in dopt.param_groups]
    # torch's own sparse optimizer for each optimizer's tables where torch has its lazy form, else None
    torch_opt = {}
    for o in opts:
        if id(o) not in torch_opt:
            torch_opt[id(o)] = _torch_sparse_optimizer(o, [p for p, q in zip(emb_params, opts) if q is o])
    states = [{k: torch.from_numpy(v) for k, v in new_state(o, p.shape[0], p.shape[1]).items()}
              for p, o in zip(emb_params, opts)]
    counts = [0] * len(emb_params)
    B = cfg.data.batch_size
    crit = (torch.nn.functional.binary_cross_entropy_with_logits if data.task == "ctr"
            else torch.nn.functional.mse_loss)
    for step in range(steps):
        b = data.train_batch(step)
        out = model(torch.from_numpy(b.dense), [torch.from_numpy(s) for s in b.sparse])
        loss = crit(out, torch.from_numpy(b.labels), reduction="sum")
        if cfg.model.embedding_l2:
            loss = loss + cfg.model.embedding_l2 * embedding_penalty(model)
        loss = loss / B
        dopt.zero_grad(set_to_none=True)
        for p in emb_params:
            p.grad = None
        loss.backward()
        if cfg.optimizer.dense.clip_norm:
            torch.nn.utils.clip_grad_norm_(dense_params, cfg.optimizer.dense.clip_norm)
        f = dsched.factor(step)
        for g, lr in zip(dopt.param_groups, base):
            g["lr"] = lr * f
        dopt.step()
        for t in torch_opt.values():
            if t is not None:
                t.step()
        with torch.no_grad():
            for i, (p, opt) in enumerate(zip(emb_params, opts)):
                if torch_opt[id(opt)] is not None:
                    continue
                g = p.grad.coalesce()
                rows, vals = g.indices()[0], g.values()
                if rows.numel():
                    counts[i] += 1
                    opt.apply(p.data, states[i], rows, vals, step, counts[i])
    tables = {name for name, p in model.named_parameters() if id(p) in emb_ids}
    result = {f"dense/{k}": v.detach().numpy() for k, v in model.state_dict().items() if k not in tables}
    for name, p in zip(names, emb_params):
        result[f"tables/{name}"] = p.detach().numpy().copy()
    return result
