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

from ..sparse.pipeline import CommThread, PushBatch
from ..sparse.validate import as_id_rows, grads_ok

__all__ = ["IdPlan", "ShardedEmbeddingBag", "ShardedEmbeddingCollection"]

# distinct rows by a flag per row of all tables up to this many rows, or per key looked up (2.2M flags
# took ~1 ms here, sorting the 90k keys of a 4096-sample Avazu batch 12 ms), else by sorting
_MARK_ROWS, _MARK_PER_KEY = 1 << 20, 32


def _host(grad: torch.Tensor, scale: float) -> np.ndarray:
    """``grad * scale`` as a float32 numpy array in host memory (what a push sends)."""
    g = grad if scale == 1.0 else grad * scale
    return g.detach().to("cpu", torch.float32).contiguous().numpy()


class _Gather(torch.autograd.Function):
    """``weight[index]`` for a leaf of pulled rows: ``F.embedding``'s result, with a backward that is
    one ``index_add_`` into zeros (``F.embedding``'s dense backward costs ~2.5x that on CPU)."""

    @staticmethod
    def forward(ctx, weight, index):
        ctx.save_for_backward(index)
        ctx.rows = weight.shape[0]
        return weight.index_select(0, index.reshape(-1)).view(*index.shape, weight.shape[1])

    @staticmethod
    def backward(ctx, grad):
        index, = ctx.saved_tensors
        grad = grad.reshape(-1, grad.shape[-1])
        out = grad.new_zeros((ctx.rows, grad.shape[1]))
        return out.index_add_(0, index.reshape(-1), grad), None


def _gather(weight: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return _Gather.apply(weight, index) if weight.requires_grad else F.embedding(index, weight)


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

    # per-step state set on every step: past nn.Module.__setattr__'s checks (a few us each)
    _PLAIN = frozenset(("step", "_next", "pull_wait_s", "push_wait_s", "prefetched_rows", "refreshed_rows"))

    def __setattr__(self, name, value):
        if name in self._PLAIN:
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

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

    @property
    def prefetch_pending(self) -> bool:
        """Whether a prefetch waits for the next forward. Local."""
        return self._next is not None

    def push_grad(self, uniq, grad):
        """The autograd hook's work: push ``grad`` (torch, scaled by ``grad_scale``) of rows ``uniq``.
        Worker ranks; local."""
        t0 = time.perf_counter()
        self.send_grad(uniq, _host(grad, self.grad_scale), t0)

    def send_grad(self, uniq: np.ndarray, g: np.ndarray, t0: float, checked: bool = False) -> None:
        """Push ``g`` (already scaled, float32 host memory) to rows ``uniq``: into the step's
        batch, or on the comm thread; the time since ``t0`` counts as push wait. ``checked``:
        ``uniq`` and ``g`` passed the push's checks already (``PushBatch.add``). Worker ranks; local."""
        if self.batch is not None:
            self.batch.add(self.table, uniq, g, checked)
        else:
            self.comm.post(self.table.push, uniq, g)
        self.push_wait_s += time.perf_counter() - t0

    def lookup(self, ids: torch.Tensor) -> tuple[_Prefetch, np.ndarray]:
        """The prefetch serving ``ids`` (the one started for them, or a new pull) and its rows. Worker
        ranks; local."""
        flat = ids.reshape(-1).cpu().numpy()
        p = self._next
        if p is not None and np.array_equal(p.flat, flat):
            self._next = None
        else:
            if p is not None and torch.is_grad_enabled():     # a training step it was not for
                self.discard_prefetch()
            p = self._start(flat, self.step, self.step)
        return p, self._finish(p)

    def forward(self, input, offsets=None, per_sample_weights=None):
        """``input``: 2-D ``(bags, bag_size)`` or 1-D with ``offsets``, as ``nn.EmbeddingBag``."""
        ids = torch.as_tensor(input)
        p, pulled = self.lookup(ids)
        uniq = p.uniq
        rows = torch.from_numpy(pulled)
        if self.device.type != "cpu":
            rows = rows.to(self.device, non_blocking=True)
        weight = rows.requires_grad_(torch.is_grad_enabled())
        if weight.requires_grad:
            weight.register_hook(lambda grad, uniq=uniq: self.push_grad(uniq, grad))
        local = torch.from_numpy(p.inverse).view(ids.shape).to(self.device)
        if offsets is None and per_sample_weights is None and ids.dim() == 2 and ids.shape[1] == 1:
            # bags of one id (DLRM's categorical features): the bag is the row; a gather's
            # forward and backward cost a fraction of F.embedding_bag's on CPU for the same result
            return _gather(weight, local.view(-1))
        if offsets is not None:
            offsets = torch.as_tensor(offsets).to(self.device)
        return F.embedding_bag(local, weight, offsets, mode=self.mode, per_sample_weights=per_sample_weights)

    def extra_repr(self) -> str:
        return f"table={self.table.name!r}, {self.num_embeddings}x{self.embedding_dim}, mode={self.mode!r}"


class IdPlan:
    """One step's ids of several tables' logical tables, checked and indexed together: what a
    :class:`ShardedEmbeddingCollection` over bags of ``tables`` pulls and pushes by. It needs only
    the tables' sizes (no communication), so ``hpcps train``'s batch loader makes it ahead in its
    child process (:meth:`pack`, :meth:`unpack`). Local.
    """

    def __init__(self, tables):
        # the logical tables, in order: each table's segments (or the table itself)
        parts = [(j, seg, r) for j, t in enumerate(tables) for seg, _, r in t.logical]
        self.names = [seg for _, seg, _ in parts]
        bag_of = np.array([j for j, _, _ in parts])
        self.rows = np.array([r for _, _, r in parts], np.int64)
        # one key space: logical table t's row i is key bounds[t] + i; table j's keys are
        # [bag_bounds[j], bag_bounds[j + 1]), its rows in order
        self.bounds = np.concatenate([[0], np.cumsum(self.rows)])
        self.bag_bounds = np.concatenate([[0], np.cumsum([t.num_rows for t in tables])])
        self.tables_of = [np.flatnonzero(bag_of == j) for j in range(len(tables))]
        self._seen = self._slot = None       # the one-pass unique's scratch (unique), made on first use

    def unique(self, keys: np.ndarray):
        """``np.unique(keys, return_inverse=True)`` with the inverse shaped like ``keys``. Up to
        ``_MARK_ROWS`` rows in all or ``_MARK_PER_KEY`` per key, by flagging rows instead of sorting."""
        total = int(self.bounds[-1])
        if total > max(_MARK_ROWS, _MARK_PER_KEY * keys.size):
            uniq, inverse = np.unique(keys, return_inverse=True)
            return uniq, inverse.reshape(keys.shape)
        if self._seen is None:
            self._seen, self._slot = np.zeros(total, np.bool_), np.empty(total, np.int32)   # half the cache
        self._seen[keys] = True
        uniq = np.flatnonzero(self._seen)
        self._seen[uniq] = False
        self._slot[uniq] = np.arange(uniq.size)
        return uniq, self._slot[keys]

    def keys(self, inputs) -> np.ndarray:
        """The ids of every logical table, checked, as keys: an int64 ``(tables, samples)`` array."""
        if len(inputs) != len(self.names):
            raise ValueError(f"ShardedEmbeddingCollection: {len(self.names)} tables, got ids for {len(inputs)}")
        flat = [x.reshape(-1) if isinstance(x, np.ndarray) else torch.as_tensor(x).reshape(-1).cpu().numpy()
                for x in inputs]
        n = flat[0].size
        if any(x.size != n for x in flat):
            raise ValueError(f"ShardedEmbeddingCollection: every table needs one id per sample, got "
                             f"{[x.size for x in flat]} ids")
        M = as_id_rows(self.names, flat, self.rows)            # (tables, samples)
        M += self.bounds[:-1, None]
        return M

    def plan(self, inputs):
        """One unique over every table's checked ids ``inputs``: ``(uniq, index (samples, tables)
        into it, each table's first position in uniq and one past the last)``."""
        uniq, index = self.unique(self.keys(inputs))
        index = np.ascontiguousarray(index.T, np.int64)         # (samples, tables), as the gather reads it
        return uniq, index, np.searchsorted(uniq, self.bag_bounds).tolist()

    def pack(self, inputs) -> list:
        """:meth:`plan` of ``inputs`` as ``(name, array)`` pairs of fixed shapes for one number of
        samples (what :class:`hpcps.data.loader.BatchAhead` keeps beside a batch). Ids that fail the
        checks give an empty plan: the worker's own :meth:`plan` then raises the error."""
        n = np.asarray(inputs[0]).size if len(inputs) else 0
        count, uniq = np.full(1, -1, np.int64), np.zeros(len(self.names) * n, np.int64)
        index, cut = np.zeros((n, len(self.names)), np.int64), np.zeros(len(self.bag_bounds), np.int64)
        try:
            u, i, c = self.plan(inputs)
        except ValueError:
            u = None
        if u is not None:
            count[0] = u.size
            uniq[:u.size], index[...], cut[:] = u, i, c
        return [("plan_count", count), ("plan_uniq", uniq), ("plan_index", index), ("plan_cut", cut)]

    @staticmethod
    def unpack(arrays: dict):
        """The plan :meth:`pack` stored in ``arrays`` (by name, the worker's own copies), or None. Local."""
        count = int(arrays["plan_count"][0])
        if count < 0:
            return None
        return arrays["plan_uniq"][:count], arrays["plan_index"], arrays["plan_cut"].tolist()


def same_arrays(arrays: list, inputs) -> bool:
    """Whether ``inputs`` are CPU int64 tensors over the very memory of the int64 ``arrays`` (what a
    ``prepare`` saw), of the same shapes. Local."""
    return len(arrays) == len(inputs) and all(
        isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.data_ptr() == a.ctypes.data
        and tuple(x.shape) == a.shape and x.dtype == torch.int64 and a.dtype == np.int64
        for a, x in zip(arrays, inputs))


class ShardedEmbeddingCollection(torch.nn.Module):
    """Several embedding tables of one dim looked up together, one id per sample and table (DLRM's
    categorical features). Worker ranks; local.

    ``bags``: :class:`ShardedEmbeddingBag` modules. A bag over a table made with ``segments``
    serves one logical table per segment (the table-batched layout ``hpcps train`` uses: one
    pull, one push and one optimizer apply per step for all of them); any other bag serves one.
    ``forward([ids of table 0, ids of table 1, ...])`` takes one ``(B,)`` or ``(B, 1)`` tensor
    per logical table and returns ``(B, tables, dim)``: what stacking separate bags' outputs
    gives, with the same gradients. Each bag pulls its rows (with its prefetch and cache); the
    rows of all bags form one leaf tensor, read by one gather, whose gradient one hook splits and
    pushes per bag. So a step costs one autograd node and one hook instead of one per table.
    """

    def __init__(self, bags):
        super().__init__()
        self.bags = torch.nn.ModuleList(bags)
        if not self.bags:
            raise ValueError("ShardedEmbeddingCollection: needs at least one ShardedEmbeddingBag")
        dims = {b.embedding_dim for b in self.bags}
        if len(dims) != 1:
            raise ValueError(f"ShardedEmbeddingCollection: every table must have one dim, got {sorted(dims)}")
        self.embedding_dim = dims.pop()
        self.device = self.bags[0].device
        self._ids = IdPlan([b.table for b in self.bags])
        self._prepared = None                # (the id arrays, their plan) from prepare()
        # called by the hook once every table's gradient is handed to its push: all of a step's
        # sparse gradients are known then, while backward still has the layers below to run
        # (``hpcps train`` sends the step's pushes and reports the step done there)
        self.after_push = None

    def __len__(self) -> int:
        """The number of logical tables (what ``forward`` takes ids for). Local."""
        return len(self._ids.names)

    def _together(self) -> bool:
        """Whether this step's pulls can go in one pass (:meth:`_pull_together`): no bag has a cache
        or a prefetch waiting, and every table's rows are float32 in this node's shared memory."""
        return all(b.cache is None and not b.prefetch_pending and b.table.node_local for b in self.bags)

    def _bag_ids(self, M: np.ndarray, j: int) -> np.ndarray:
        """Bag ``j``'s rows for keys ``M``: its logical tables' keys, table by table, as rows of its table."""
        return (M[self._ids.tables_of[j]] - self._ids.bag_bounds[j]).reshape(-1)

    def _pull_together(self, plan):
        """Every bag's distinct rows of ``plan`` (:meth:`IdPlan.plan`) in one pass, each bag's rows read
        straight into one buffer. Returns ``(rows, index, uniqs, starts, sizes)``: what the per-bag
        path gives."""
        uniq, index, cut = plan
        rows = np.empty((uniq.size, self.embedding_dim), np.float32)
        uniqs = []
        for j, b in enumerate(self.bags):
            t0 = time.perf_counter()
            part = uniq[cut[j]:cut[j + 1]] - self._ids.bag_bounds[j]
            b.table.gather_local(part, rows[cut[j]:cut[j + 1]])
            uniqs.append(part)
            b.pull_wait_s += time.perf_counter() - t0
        sizes = [u.size for u in uniqs]
        return rows, index, uniqs, cut[:-1], sizes

    def prepare(self, inputs, plan=None) -> None:
        """Check and index the ids ``inputs`` of a coming ``forward`` now, while there is time (a
        worker waiting for the PS's apply): that forward then starts with its pull. Only
        ``forward(inputs)`` with these very arrays, unchanged, uses it. ``plan``: their
        :meth:`IdPlan.plan`, made already (by the batch loader, :meth:`IdPlan.unpack`). Local."""
        self._prepared = None
        if not self._together():
            return
        arrays = [x if isinstance(x, np.ndarray) else torch.as_tensor(x).numpy() for x in inputs]
        if plan is None or plan[1].shape != (arrays[0].size if arrays else 0, len(self._ids.names)) \
                or len(plan[2]) != len(self._ids.bag_bounds):
            plan = self._ids.plan(arrays)
        self._prepared = (arrays, plan)

    def _take_prepared(self, inputs):
        p, self._prepared = self._prepared, None
        if p is None or not self._together() or not same_arrays(p[0], inputs):
            return None
        return p[1]

    def prefetch(self, inputs, step: int, refresh_above: int | None = None) -> None:
        """Start each bag's pull for the forward of ``step`` on ``inputs`` (as ``forward`` takes
        them); see :meth:`ShardedEmbeddingBag.prefetch`. Local."""
        M = self._ids.keys(inputs)
        for j, b in enumerate(self.bags):
            b.prefetch(self._bag_ids(M, j), step, refresh_above=refresh_above)

    def forward(self, inputs) -> torch.Tensor:
        plan = self._take_prepared(inputs)
        together = plan is not None or self._together()
        if together:
            rows, index, uniqs, starts, sizes = self._pull_together(plan or self._ids.plan(inputs))
            rows = torch.from_numpy(rows)
        else:
            M = self._ids.keys(inputs)
            n = M.shape[1]
            found = [b.lookup(torch.from_numpy(self._bag_ids(M, j))) for j, b in enumerate(self.bags)]
            uniqs = [p.uniq for p, _ in found]
            sizes = [u.size for u in uniqs]
            starts = np.cumsum([0] + sizes[:-1]).tolist()
            rows = torch.from_numpy(np.concatenate([r for _, r in found]) if len(found) > 1 else found[0][1])
            index = np.empty((n, len(self._ids.names)), np.int64)     # (samples, tables) rows of the leaf
            for j, ((p, _), s) in enumerate(zip(found, starts)):
                tables = self._ids.tables_of[j]
                index[:, tables] = p.inverse.reshape(tables.size, n).T + s
        if self.device.type != "cpu":
            rows = rows.to(self.device, non_blocking=True)
        weight = rows.requires_grad_(torch.is_grad_enabled())
        if weight.requires_grad:
            weight.register_hook(lambda grad: self._push(uniqs, starts, sizes, grad, together))
        return _gather(weight, torch.from_numpy(index).to(self.device))

    def _push(self, uniqs, starts, sizes, grad, checked_ids: bool = False) -> None:
        """The hook on the leaf of pulled rows: push each table's slice of ``grad``. With
        ``checked_ids`` (rows from :meth:`_pull_together`: int64, unique, sorted, in range) and a
        finite gradient, the pushes skip their per-table checks."""
        scales = {b.grad_scale for b in self.bags}
        if len(scales) > 1:
            for b, uniq, s, k in zip(self.bags, uniqs, starts, sizes):
                b.push_grad(uniq, grad[s:s + k])
        else:
            t0 = time.perf_counter()
            g = _host(grad, scales.pop())
            # one check of the whole gradient (as_grads'); a bad one leaves the per-table checks to name it
            checked = checked_ids and grads_ok(g)
            for b, uniq, s, k in zip(self.bags, uniqs, starts, sizes):
                b.send_grad(uniq, g[s:s + k], t0, checked)
                t0 = time.perf_counter()
        if self.after_push is not None:
            self.after_push()
