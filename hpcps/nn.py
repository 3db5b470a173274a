"""torch modules over hpcps tables: the autograd bridge.

``ShardedEmbeddingBag`` is a drop-in for ``torch.nn.EmbeddingBag``: forward
pulls the distinct rows a batch needs into a small leaf tensor and runs
``F.embedding_bag`` on it; autograd computes that leaf's gradient, and a hook
pushes it to the table (the PS applies the optimizer). No hand-written backward.

Pipelining (what ``hpcps train`` does with ``[pipeline]``): ``prefetch(next
input)`` starts the pull for the next step while this one computes; pushes go
to a :class:`hpcps.sparse.pipeline.CommThread` and ``wait_pushes()`` ends them
before the step is reported done; an optional :class:`RowCache` serves hot
rows. With ``refresh_above=s`` a prefetched row whose version stamp is above
``s`` (changed after the prefetch could see it) is pulled again at forward
time, so a prefetch changes nothing in ``sync`` mode.
"""

import time

import numpy as np
import torch
import torch.nn.functional as F

from .sparse.pipeline import CommThread, PushBatch

__all__ = ["ShardedEmbeddingBag"]


class _Prefetch:
    __slots__ = ("flat", "uniq", "inverse", "hit", "cached", "future", "refresh_above", "read_step")


class ShardedEmbeddingBag(torch.nn.Module):
    """``torch.nn.EmbeddingBag`` over an :class:`hpcps.EmbeddingTable`. Worker ranks; local.

    mode: ``"sum"`` or ``"mean"`` (``"max"`` has no useful sparse gradient here).
    grad_scale: multiplies the gradient pushed (the trainer uses ``1/num_workers``
    so that the sum over workers is the gradient of the global-batch mean loss).
    device: where the pulled rows go (``"cuda"`` for a model on the GPU); pushed
    gradients come back to the host.
    comm: a :class:`CommThread` shared by the worker's modules (pushes and
    prefetches run on it); default: every call inline.
    cache: a :class:`RowCache` for this table, or None; used while autograd is on
    (training), bypassed under ``torch.no_grad()`` (evaluation reads fresh rows).
    batch: a :class:`PushBatch` shared by the worker's modules: backward adds this
    table's push to it, and the caller sends the step's pushes with ``batch.flush()``
    (one shard-lock acquisition per PS for all tables); default: each hook pushes.
    """

    def __init__(self, table, mode: str = "sum", grad_scale: float = 1.0, device=None,
                 comm: CommThread | None = None, cache=None, batch: PushBatch | None = None):
        super().__init__()
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if mode not in ("sum", "mean"):
            raise ValueError(f"ShardedEmbeddingBag: mode must be 'sum' or 'mean', got {mode!r}")
        self.table, self.mode, self.grad_scale = table, mode, float(grad_scale)
        self.embedding_dim = table.dim
        self.num_embeddings = table.num_rows
        self.comm = comm if comm is not None else CommThread(enabled=False)
        self.cache = cache
        self.batch = batch
        self.step = 0                  # the step forward() serves: cache ages count from it
        self._next = None
        # seconds the calling thread waited for pulls / pushes; rows pulled again after a prefetch
        self.pull_wait_s = self.push_wait_s = 0.0
        self.prefetched_rows = self.refreshed_rows = 0

    # ------------------------------------------------------------ pulls
    def _start(self, flat: np.ndarray, use_step: int, read_step: int) -> _Prefetch:
        p = _Prefetch()
        p.flat = flat
        p.uniq, inverse = np.unique(flat, return_inverse=True)
        p.inverse = inverse.reshape(-1)
        p.read_step = read_step
        if self.cache is not None and torch.is_grad_enabled():     # evaluation reads fresh rows
            p.hit, p.cached = self.cache.lookup(p.uniq, use_step)
            want = p.uniq[~p.hit]
        else:
            p.hit, p.cached, want = None, None, p.uniq
        p.future = self.comm.submit(self.table.pull, want)
        p.refresh_above = None
        return p

    def _finish(self, p: _Prefetch) -> np.ndarray:
        t0 = time.perf_counter()
        pulled = p.future.result()
        if p.refresh_above is not None and pulled.size:
            want = p.uniq if p.hit is None else p.uniq[~p.hit]
            stale = np.flatnonzero(self.table.versions(want) > p.refresh_above)
            if stale.size:
                pulled[stale] = self.table.pull(want[stale])
            self.refreshed_rows += int(stale.size)
            self.prefetched_rows += int(want.size)
        if p.hit is not None:
            self.cache.insert(p.uniq[~p.hit], pulled, p.read_step)
            rows = np.empty((p.uniq.size, self.embedding_dim), np.float32)
            rows[p.hit] = p.cached
            rows[~p.hit] = pulled
        else:
            rows = pulled
        self.pull_wait_s += time.perf_counter() - t0
        return rows

    def prefetch(self, input, step: int, refresh_above: int | None = None) -> None:
        """Start pulling the rows ``input`` needs, for the forward of ``step``. Local.

        ``refresh_above``: when the forward uses these rows, pull again those whose
        version stamp (``table.versions``) is above it; ``None`` uses them as read.
        The table must track versions for a refresh.
        """
        if refresh_above is not None and not self.table.track_versions:
            raise ValueError(f"table {self.table.name!r}: a refreshed prefetch needs track_versions")
        self.discard_prefetch()
        flat = np.ascontiguousarray(torch.as_tensor(input).reshape(-1).cpu().numpy())
        p = self._start(flat, step, step - 1)       # read during the step before
        p.refresh_above = refresh_above
        self._next = p

    def discard_prefetch(self) -> None:
        """Complete and drop a prefetch no forward used (its communication must end). Local."""
        p, self._next = self._next, None
        if p is not None:
            p.future.result()

    # ------------------------------------------------------------ pushes
    def wait_pushes(self) -> None:
        """Return once every push (and prefetch) submitted so far completed. Local."""
        t0 = time.perf_counter()
        self.comm.drain()
        self.push_wait_s += time.perf_counter() - t0

    def _push(self, uniq, grad):
        t0 = time.perf_counter()
        g = grad if self.grad_scale == 1.0 else grad * self.grad_scale
        g = g.detach().to("cpu", torch.float32).contiguous().numpy()
        if self.batch is not None:
            self.batch.add(self.table, uniq, g)
            self.push_wait_s += time.perf_counter() - t0
            return
        self.comm.post(self.table.push, uniq, g)
        self.push_wait_s += time.perf_counter() - t0

    def forward(self, input, offsets=None, per_sample_weights=None):
        """``input``: 2-D ``(bags, bag_size)`` or 1-D with ``offsets``, as ``nn.EmbeddingBag``."""
        ids = torch.as_tensor(input)
        flat = ids.reshape(-1).cpu().numpy()
        p = self._next
        if p is not None and np.array_equal(p.flat, flat):
            self._next = None
        else:
            if p is not None and torch.is_grad_enabled():     # a training step it was not for
                self.discard_prefetch()
            p = self._start(flat, self.step, self.step)
        uniq = p.uniq
        rows = torch.from_numpy(self._finish(p))
        if self.device.type != "cpu":
            rows = rows.to(self.device, non_blocking=True)
        weight = rows.requires_grad_(torch.is_grad_enabled())
        if weight.requires_grad:
            weight.register_hook(lambda grad, uniq=uniq: self._push(uniq, grad))
        local = torch.from_numpy(p.inverse).view(ids.shape).to(self.device)
        if offsets is None and per_sample_weights is None and ids.dim() == 2 and ids.shape[1] == 1:
            # bags of one id (DLRM's categorical features): the bag is the row; F.embedding's
            # forward and backward cost ~half of F.embedding_bag's on CPU for the same result
            return F.embedding(local.view(-1), weight)
        if offsets is not None:
            offsets = torch.as_tensor(offsets).to(self.device)
        return F.embedding_bag(local, weight, offsets, mode=self.mode, per_sample_weights=per_sample_weights)

    def extra_repr(self) -> str:
        return f"table={self.table.name!r}, {self.num_embeddings}x{self.embedding_dim}, mode={self.mode!r}"
