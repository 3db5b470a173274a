"""Sparse embedding tables sharded over the PS ranks.

Pull path (worker):   validate ids -> for a PS on this node, numpy gather
straight from its shared-memory shard; for a remote PS, deduplicate, then
one ``MPI_Get_accumulate(NO_OP)`` per owner with an indexed datatype -> scatter
back through the inverse.
Push path (worker):   validate grads -> take the owner's shard lock -> on
this node ``index_add_`` of ``-lr * grad`` into shared memory; remote: sum
duplicates, one ``MPI_Accumulate(SUM)`` per owner -> release. A 16-bit
``push_dtype`` puts the rounded per-row sums into the owner's push inbox
instead (MPI has no usable 16-bit float sum); the PS widens and adds them.
"""

import logging
import os
import time
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from .._wait import backoff
from ..errors import FreedError, RoleError
from .initializers import default_scale, initial_rows
from .optimizers import SGD, SparseOptimizer, new_state
from .sharding import ModuloSharding, logical_tables
from .validate import as_grads, as_ids
from .window import Window

__all__ = ["EmbeddingTable", "PullHandle", "PushHandle", "apply_staged", "push_many"]

logger = logging.getLogger(__name__)

_INIT_CHUNK_ROWS = 1 << 14
# staged-row list (stateful tables): up to this many distinct rows staged between two applies are
# listed, so an apply costs O(rows staged), not a scan of the shard's flags; past it, the PS scans
STAGED_LIST_ROWS = 1 << 18
RMA_READS = ("get_accumulate", "get")
PULL_DTYPES = ("float32", "bfloat16", "float16")
PUSH_DTYPES = PULL_DTYPES
# push inbox (16-bit push_dtype, remote PS): up to this many rows a PS has not drained yet; a push
# that would overflow it goes as float32 by MPI_Accumulate (the same rounded values, twice the bytes)
PUSH_INBOX_ROWS = 1 << 16
# hand-off slab (stateful tables, float32 pushes, PS on the worker's node): one push of up to this
# many distinct rows, written in order by a worker and applied from there by the PS, instead of
# scattered into the staging rows (the PS's take of those cost ~60 ns a row in cache misses)
SLAB_ROWS = 1 << 18

_torch = None


def _t():
    global _torch
    if _torch is None:
        import torch
        _torch = torch
    return _torch


@dataclass
class TableStats:
    """Per-rank counters of one table (local)."""

    pulls: int = 0
    pull_rows: int = 0
    pull_seconds: float = 0.0
    pushes: int = 0
    push_rows: int = 0
    push_seconds: float = 0.0
    rows_per_ps: list = field(default_factory=list)     # rows pulled and pushed, per PS
    bytes_per_ps: list = field(default_factory=list)    # their bytes as moved (16-bit pulls: 2 per value)
    applies_listed: int = 0     # PS: applies that took their rows from the staged-row list
    applies_scanned: int = 0    # PS: applies that scanned the shard's flags (the list had overflowed)
    applies_slab: int = 0       # PS: applies that took one worker's push straight from the hand-off slab
    inbox_full: int = 0         # 16-bit pushes sent as float32 because the PS's push inbox was full


def _complete(requests) -> None:
    """Wait for RMA requests, pausing between tests (``hpcps._wait``): on a core shared with the
    model's compute (a communication thread, an oversubscribed node) a blocking flush would spin on it."""
    misses = 0
    while requests and not MPI.Request.Testall(requests):
        misses += 1
        backoff(misses)


def _narrow(rows: np.ndarray, dtype: str) -> np.ndarray:
    """float32 ``rows`` rounded to nearest (even) ``dtype`` ("bfloat16" or "float16"), by torch, as
    their uint16 bit patterns (numpy's float16 cast rounds the same but took 10x as long)."""
    torch = _t()
    half = torch.from_numpy(np.ascontiguousarray(rows)).to(getattr(torch, dtype))
    return half.view(torch.int16).numpy().view(np.uint16)


def _widen(half: np.ndarray, dtype: str) -> np.ndarray:
    """:func:`_narrow`'s bit patterns back to float32 (exact)."""
    torch = _t()
    bits = torch.from_numpy(np.ascontiguousarray(half).view(np.int16))
    return bits.view(getattr(torch, dtype)).to(torch.float32).numpy()


def _listed(n: int, k: int, cap: int) -> int:
    """A staged-row list of ``n`` rows (-1: overflowed) after ``k`` more: ``n + k``, or -1 past ``cap``."""
    return n + k if n >= 0 and n + k <= cap else -1


class PullHandle:
    """Result of :meth:`EmbeddingTable.pull_async`; ``wait()`` returns the rows."""

    def __init__(self, table, out, pending=(), finish=None, started=0.0):
        self._table, self._out, self._pending, self._finish = table, out, list(pending), finish
        self._started = started
        self._done = not self._pending

    def test(self) -> bool:
        """True when ``wait()`` would not block on communication. Local."""
        return self._done

    def wait(self) -> np.ndarray:
        """Complete the pull; returns float32 ``(len(ids), dim)``. Local; idempotent."""
        if not self._done:
            _complete([req for req, _, _, _ in self._pending])
            for _, dtype, into, buf in self._pending:
                dtype.Free()
                into(buf)
            self._pending.clear()
            self._done = True
        if self._finish is not None:
            self._out, self._finish = self._finish(self._out), None
            st = self._table.stats
            st.pull_seconds += time.perf_counter() - self._started
        return self._out


class PushHandle:
    """Result of :meth:`EmbeddingTable.push_async`. Local."""

    def test(self) -> bool:
        return True

    def wait(self) -> None:
        """Pushes complete before ``push_async`` returns today; kept for the async API."""
        return None


def _check_segments(name: str, segments, num_rows: int):
    """``segments`` as a tuple of ``(name, rows)``, checked: distinct non-empty names, rows >= 1,
    summing to ``num_rows``; ``None`` stays ``None``. Local."""
    if segments is None:
        return None
    try:
        parts = tuple((n, r) for n, r in segments)
    except (TypeError, ValueError):
        raise ValueError(f"table {name!r}: segments must be [(name, rows), ...], got {segments!r}") from None
    for n, r in parts:
        if not isinstance(n, str) or not n or isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r < 1:
            raise ValueError(f"table {name!r}: each segment needs a non-empty name and rows >= 1, got {(n, r)!r}")
    if not parts or len({n for n, _ in parts}) != len(parts):
        raise ValueError(f"table {name!r}: segments need distinct names, got {[n for n, _ in parts]}")
    if sum(int(r) for _, r in parts) != num_rows:
        raise ValueError(f"table {name!r}: segments hold {sum(int(r) for _, r in parts)} rows, the table "
                         f"{num_rows}")
    return tuple((n, int(r)) for n, r in parts)


class EmbeddingTable:
    """A ``num_rows x dim`` float32 table sharded row-wise over the PS ranks.

    Collective over the world communicator of ``ctx``: every rank, PS and
    worker, creates the same tables in the same order, before the PS ranks
    call ``ctx.serve()``. Initial rows depend only on ``(seed, name, row id)``.

    transport: ``None`` (the context's), ``"auto"`` or ``"rma"``; see
    :func:`hpcps.init`.
    track_dirty: keep a per-row "changed since the last checkpoint" byte on the PS
    (incremental checkpoints); costs one byte per row and, on the RMA path, one
    more put per push.
    track_versions: keep a per-row int32 stamp on the PS, the highest ``step + 1``
    of any update applied to the row (:meth:`versions`): a prefetch issued
    before step ``t``'s pushes re-pulls exactly the rows whose stamp shows
    they changed since (see :class:`hpcps.nn.ShardedEmbeddingBag`). Costs
    4 bytes per row and, on the RMA path, one more accumulate per push.
    pull_dtype: ``"float32"``, or ``"bfloat16"`` / ``"float16"``: the PS keeps a 16-bit copy of
    its rows (rounded to nearest) next to the float32 ones, refreshed whenever it
    applies an update, and pulls read that copy: half the bytes over RMA and through
    shared memory; the rows, the optimizer state and checkpoints stay float32. The PS
    then applies every update, plain SGD included.
    push_dtype: ``"float32"``, or ``"bfloat16"`` / ``"float16"``: a worker sums each row's
    gradients in float32 and rounds the sum to 16 bits (to nearest), and that is what the
    PS adds (in float32) to the row's staged gradient. To a PS on another node the
    rounded rows travel in 16 bits: they go to its push inbox (``MPI_Put``, up to
    ``PUSH_INBOX_ROWS`` rows not yet drained; past that as float32 by accumulate, counted in
    ``stats.inbox_full``), which the PS drains before it applies. Through shared memory
    nothing is saved (the worker adds the rounded values itself). The PS applies every
    update, plain SGD included.
    segments: ``[(name, rows), ...]`` summing to ``num_rows``: the table stores several logical
    tables of one ``dim`` and optimizer back to back ("table-batched", as FBGEMM's TBE), so a
    step's pulls, pushes and optimizer apply cost one pass instead of one per table. Segment
    ``j``'s row ``i`` is global row ``start_j + i`` and starts as table ``name_j``'s row ``i``
    would (``initial_rows(seed, name_j, i)``); ``logical`` lists ``(name_j, start_j, rows_j)``
    (the table itself when it has no segments). ``hpcps.nn.ShardedEmbeddingCollection`` maps
    each logical table's ids onto its segment.
    """

    def __init__(self, ctx, name: str, num_rows: int, dim: int,
                 optimizer: SparseOptimizer | None = None, seed: int = 0,
                 init_scale: float | None = None, transport: str | None = None, track_dirty: bool = False,
                 track_versions: bool = False, pull_dtype: str = "float32", push_dtype: str = "float32",
                 segments=None):
        ctx._check_open()
        if not isinstance(name, str) or not name:
            raise ValueError(f"table name must be a non-empty string, got {name!r}")
        for what, v in (("num_rows", num_rows), ("dim", dim)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"table {name!r}: {what} must be an integer >= 1, got {v!r}")
        if any(t.name == name for t in ctx._tables):
            raise ValueError(f"table {name!r} already exists in this context")
        optimizer = SGD() if optimizer is None else optimizer
        if not isinstance(optimizer, SparseOptimizer):
            raise ValueError(f"table {name!r}: optimizer must be an hpcps.optim optimizer, got {optimizer!r}")
        optimizer.check()
        transport = transport or ctx.transport
        if transport not in ("auto", "rma"):
            raise ValueError(f"table {name!r}: transport must be 'auto' or 'rma', got {transport!r}")
        rma_read = os.environ.get("HPCPS_RMA_READ", "get_accumulate")
        if rma_read not in RMA_READS:
            raise ValueError(f"HPCPS_RMA_READ must be one of {RMA_READS}, got {rma_read!r}")
        scale = default_scale(dim) if init_scale is None else float(init_scale)

        if pull_dtype not in PULL_DTYPES:
            raise ValueError(f"table {name!r}: pull_dtype must be one of {PULL_DTYPES}, got {pull_dtype!r}")
        if push_dtype not in PUSH_DTYPES:
            raise ValueError(f"table {name!r}: push_dtype must be one of {PUSH_DTYPES}, got {push_dtype!r}")
        segments = _check_segments(name, segments, int(num_rows))
        spec = (name, int(num_rows), int(dim), repr(optimizer), int(seed), scale, transport, bool(track_dirty),
                bool(track_versions), pull_dtype, push_dtype, segments)
        specs = ctx.world.allgather(spec)
        if any(s != spec for s in specs):
            raise ValueError(f"table {name!r} created differently on different ranks: {sorted(set(specs))}")

        self.ctx, self.name, self.num_rows, self.dim = ctx, name, int(num_rows), int(dim)
        self.optimizer, self.seed, self.init_scale, self.transport = optimizer, int(seed), scale, transport
        self.segments = segments
        # [(name, first row, rows)] of each segment (the table itself if it has none)
        self.logical = logical_tables(name, self.num_rows, segments)
        self._starts = np.array([first for _, first, _ in self.logical] + [self.num_rows], np.int64)
        self._rma_read = rma_read
        self.sharding = ModuloSharding(self.num_rows, ctx.num_ps)
        self.stats = TableStats(rows_per_ps=[0] * ctx.num_ps, bytes_per_ps=[0] * ctx.num_ps)
        self._row_bytes = self.dim * 4
        local_rows = self.sharding.shard_rows(ctx.ps_rank) if ctx.is_ps else 0
        self._data = Window(ctx.world, local_rows * self._row_bytes, what=f"table {name!r}")
        self._locks = ctx.shard_locks           # shared by the context's tables (push_many)
        self._rowtype = MPI.FLOAT.Create_contiguous(self.dim).Commit()
        self.pull_dtype, self.push_dtype = pull_dtype, push_dtype
        # a 16-bit copy is kept current by the PS, and 16-bit pushes are widened by it, so with
        # either the PS applies every update (even plain SGD)
        self.stateful = optimizer.stateful or pull_dtype != "float32" or push_dtype != "float32"
        self._applies = 0                       # PS: optimizer steps applied to this shard
        self._local = None                      # PS: views of its own memory (_ps_local)
        self._state = {}
        if self.stateful:                       # gradients are staged next to the rows
            self._stage = Window(ctx.world, local_rows * self._row_bytes, what=f"table {name!r} staging")
            self._flags = Window(ctx.world, -(-local_rows // 8) * 8, what=f"table {name!r} touched rows")
            # int64: [0] = rows listed (-1: overflowed, scan the flags), [1:] = the rows
            self._list_cap = min(local_rows, STAGED_LIST_ROWS) if ctx.is_ps else 0
            cap = ctx.world.allgather(self._list_cap)
            self._list_caps = [cap[r] for r in ctx.ps_world_ranks]
            self._list = Window(ctx.world, (1 + self._list_cap) * 8 if ctx.is_ps else 0,
                                what=f"table {name!r} staged-row list")
        self._slab = None
        if self.stateful and push_dtype == "float32":
            # int64 [0] rows in the slab (0: empty), [1] unused; int64 rows[cap]; float32 grads[cap, dim]
            self._slab_cap = min(local_rows, SLAB_ROWS) if ctx.is_ps else 0
            cap = ctx.world.allgather(self._slab_cap)
            self._slab_caps = [cap[r] for r in ctx.ps_world_ranks]
            self._slab = Window(ctx.world, self._slab_bytes(self._slab_cap) if ctx.is_ps else 0,
                                what=f"table {name!r} hand-off slab")
        self._inbox = None
        if push_dtype != "float32":
            # [0] int64 rows waiting, then int64 rows[cap], then uint16 grads[cap, dim]
            # a step of sync pushes fits when each worker's rows fit in the shard
            self._inbox_cap = min(ctx.num_workers * local_rows, PUSH_INBOX_ROWS) if ctx.is_ps else 0
            cap = ctx.world.allgather(self._inbox_cap)
            self._inbox_caps = [cap[r] for r in ctx.ps_world_ranks]
            nbytes = 8 + 8 * self._inbox_cap + -(-self._inbox_cap * 2 * self.dim // 8) * 8 if ctx.is_ps else 0
            self._inbox = Window(ctx.world, nbytes, what=f"table {name!r} {push_dtype} push inbox")
        self.track_dirty = bool(track_dirty)
        if self.track_dirty:
            self._dirty = Window(ctx.world, -(-local_rows // 8) * 8, what=f"table {name!r} dirty rows")
        self.track_versions = bool(track_versions)
        if self.track_versions:
            self._versions = Window(ctx.world, local_rows * 4, what=f"table {name!r} row versions")
        if pull_dtype != "float32":
            self._half = Window(ctx.world, local_rows * self.dim * 2, what=f"table {name!r} {pull_dtype} copy")
            self._halftype = MPI.UINT16_T.Create_contiguous(self.dim).Commit()
        if ctx.is_ps:
            self._fill_initial(local_rows)
            self._sync_half()
            if self.track_versions:
                self._versions.local(np.int32)[:] = 0
                self._versions.sync()
            if self.track_dirty:
                self._dirty.local(np.uint8)[:] = 0
                self._dirty.sync()
            if self.stateful:
                self._stage.local()[:] = 0
                self._flags.local(np.uint8)[:] = 0
                self._list.local(np.int64)[:] = 0
                self._list.sync()
                if self._slab is not None:
                    self._slab.local(np.int64)[:2] = 0
                    self._slab.sync()
                if self._inbox is not None:
                    self._inbox.local(np.int64)[:1] = 0
                    self._inbox.sync()
                self._stage.sync()
                self._flags.sync()
                self._state = new_state(optimizer, local_rows, self.dim)
        if ctx.is_worker or self.stateful:      # torch does the adds: import it now, not mid-training
            _t()
        ctx.world.Barrier()                     # rows exist before anyone pulls
        self._views = self._map_shared_shards(self._data) if ctx.is_worker else [None] * ctx.num_ps
        self._half_views = [None] * ctx.num_ps
        if pull_dtype != "float32" and ctx.is_worker:
            self._half_views = self._map_shared_shards(self._half, np.uint16)
        self._dirty_views = [None] * ctx.num_ps
        if self.track_dirty and ctx.is_worker and not self.stateful:
            self._dirty_views = [None if v is None else self._dirty.shared(r, np.uint8)
                                 for v, r in zip(self._views, ctx.ps_world_ranks)]
        self._version_views = [None] * ctx.num_ps
        if self.track_versions and ctx.is_worker:
            self._version_views = [None if v is None else self._versions.shared(r, np.int32)
                                   for v, r in zip(self._views, ctx.ps_world_ranks)]
        if self.stateful and ctx.is_worker:
            self._stage_views = self._map_shared_shards(self._stage)
            self._flag_views = [None if v is None else self._flags.shared(r, np.uint8)
                                for v, r in zip(self._stage_views, ctx.ps_world_ranks)]
            self._list_views = [None if v is None else self._list.shared(r, np.int64)
                                for v, r in zip(self._stage_views, ctx.ps_world_ranks)]
        self._slab_views = [None] * ctx.num_ps
        if self._slab is not None and ctx.is_worker:
            self._slab_views = [None if v is None else self._slab_parts(self._slab.shared(r, np.uint8), cap)
                                for v, r, cap in zip(self._stage_views, ctx.ps_world_ranks, self._slab_caps)]
        ctx._register(self)

    # ------------------------------------------------------------ set-up
    def _fill_initial(self, local_rows: int) -> None:
        shard = self.shard()
        for start in range(0, local_rows, _INIT_CHUNK_ROWS):
            stop = min(local_rows, start + _INIT_CHUNK_ROWS)
            gids = self.sharding.global_ids(self.ctx.ps_rank, start, stop)
            # ascending ids: each segment's rows are one run of them, initialized under its name
            cut = np.searchsorted(gids, self._starts).tolist()
            for j, (seg, _, _) in enumerate(self.logical):
                if cut[j] < cut[j + 1]:
                    initial_rows(self.seed, seg, gids[cut[j]:cut[j + 1]] - self._starts[j], self.dim,
                                 self.init_scale, out=shard[start + cut[j]:start + cut[j + 1]])
        self._data.sync()

    def _map_shared_shards(self, window, dtype=np.float32) -> list:
        views = []
        for p, rank in enumerate(self.ctx.ps_world_ranks):
            view = None
            if self.transport == "auto" and rank in self.ctx.node_ranks:
                mem = window.shared(rank, dtype)
                if mem is not None and mem.size == self.sharding.shard_rows(p) * self.dim:
                    view = mem.reshape(-1, self.dim)
            views.append(view)
        return views

    def _slab_bytes(self, cap: int) -> int:
        """Bytes of a hand-off slab of ``cap`` rows (a multiple of 8)."""
        return 16 + 8 * cap + -(-4 * self.dim * cap // 8) * 8

    def _slab_parts(self, mem: np.ndarray, cap: int):
        """``(head, rows, grads)`` of a hand-off slab's bytes ``mem`` holding ``cap`` rows."""
        if mem is None or mem.size != self._slab_bytes(cap):
            return None
        head = mem[:16].view(np.int64)
        rows = mem[16:16 + 8 * cap].view(np.int64)
        grads = mem[16 + 8 * cap:16 + 8 * cap + 4 * self.dim * cap].view(np.float32).reshape(cap, self.dim)
        return head, rows, grads

    # ------------------------------------------------------------ helpers
    @property
    def segment_starts(self) -> np.ndarray:
        """First global row of each segment, then ``num_rows`` (one segment if none were given). Local."""
        return self._starts.copy()

    def _check_worker(self, what: str) -> None:
        if self._data.freed:
            raise FreedError(f"table {self.name!r}: {what}() after free()")
        if not self.ctx.is_worker:
            raise RoleError(f"table {self.name!r}: {what}() is for worker ranks, not PS ranks")

    @property
    def shared_memory_ps(self) -> list[int]:
        """PS indices this worker reads straight from shared memory. Local."""
        return [p for p, v in enumerate(self._views) if v is not None]

    def shard(self) -> np.ndarray:
        """PS ranks: this rank's shard as a writable ``(shard_rows, dim)`` view. Local."""
        if self._data.freed:
            raise FreedError(f"table {self.name!r}: shard() after free()")
        if not self.ctx.is_ps:
            raise RoleError(f"table {self.name!r}: shard() is for PS ranks")
        return self._data.local().reshape(-1, self.dim)

    def _hindexed(self, local_rows: np.ndarray, half: bool = False) -> MPI.Datatype:
        rowtype, nbytes = (self._halftype, self.dim * 2) if half else (self._rowtype, self._row_bytes)
        return rowtype.Create_hindexed_block(1, (local_rows * nbytes).tolist()).Commit()

    # 16-bit copies of the rows (pull_dtype): bfloat16 or float16, rounded to nearest even by torch
    def _narrow(self, rows: np.ndarray) -> np.ndarray:
        return _narrow(rows, self.pull_dtype)

    def _widen(self, half: np.ndarray) -> np.ndarray:
        return _widen(half, self.pull_dtype)

    def _sync_half(self, rows: np.ndarray | None = None) -> None:
        """PS: refresh the 16-bit copy of ``rows`` (all when None) from the float32 shard. Local."""
        if self.pull_dtype == "float32":
            return
        shard = self.shard()
        half = self._half.local(np.uint16).reshape(-1, self.dim)
        if rows is None:
            for start in range(0, shard.shape[0], _INIT_CHUNK_ROWS):
                half[start:start + _INIT_CHUNK_ROWS] = self._narrow(shard[start:start + _INIT_CHUNK_ROWS])
        elif rows.size:
            half[rows] = self._narrow(shard[rows])
        self._half.sync()

    # ------------------------------------------------------------ pull
    def pull_async(self, ids, full: bool = False) -> PullHandle:
        """Start reading rows ``ids`` (duplicates allowed). Worker ranks; local (one-sided).

        Returns a handle whose ``wait()`` gives float32 ``(len(ids), dim)``. A table with a
        16-bit ``pull_dtype`` reads its 16-bit copy and widens it, unless ``full`` (the
        float32 rows: exports). Raises ``ValueError`` on bad ids before any communication.
        """
        self._check_worker("pull")
        ids = as_ids(self.name, ids, self.num_rows)
        started = time.perf_counter()
        st = self.stats
        st.pulls += 1
        st.pull_rows += ids.size
        dim = self.dim
        half = self.pull_dtype != "float32" and not full
        window, views, npt, mpit = ((self._half, self._half_views, np.uint16, MPI.UINT16_T) if half else
                                    (self._data, self._views, np.float32, MPI.FLOAT))
        widen = self._widen if half else None
        out = np.empty((ids.size, dim), dtype=npt)
        if ids.size == 0:
            return PullHandle(self, out if widen is None else widen(out))
        if all(v is not None for v in views):                       # whole table on this node
            self._gather_node(ids, out, window, views)
            if widen is not None:
                out = widen(out)
            st.pull_seconds += time.perf_counter() - started
            return PullHandle(self, out)

        uniq, inverse = np.unique(ids, return_inverse=True)
        owner, local = self.sharding.owner(uniq), self.sharding.local_row(uniq)
        rows = np.empty((uniq.size, dim), dtype=npt)
        pending = []
        win = window.win
        for p in np.unique(owner).tolist():
            sel = np.flatnonzero(owner == p)
            st.rows_per_ps[p] += sel.size
            st.bytes_per_ps[p] += sel.size * dim * rows.itemsize
            if views[p] is not None:
                rows[sel] = np.take(views[p], local[sel], axis=0)
                continue
            rank = self.ctx.ps_world_ranks[p]
            buf = np.empty((sel.size, dim), dtype=npt)
            dtype = self._hindexed(local[sel], half)
            if self._rma_read == "get":
                req = win.Rget([buf, mpit], rank, (0, 1, dtype))
            else:
                req = win.Rget_accumulate([buf, mpit], [buf, mpit], rank, (0, 1, dtype), op=MPI.NO_OP)
            pending.append((req, dtype, lambda b, sel=sel: rows.__setitem__(sel, b), buf))
        finish = (lambda r: r[inverse]) if widen is None else (lambda r: widen(r[inverse]))
        return PullHandle(self, rows, pending, finish=finish, started=started)

    @property
    def _node_local(self) -> bool:
        """Whether every shard is in this node's shared memory and pulls read float32 rows: what
        :meth:`_gather_local` needs. Local."""
        return self.pull_dtype == "float32" and all(v is not None for v in self._views)

    def _gather_local(self, ids: np.ndarray, out: np.ndarray) -> None:
        """``pull(ids)`` into ``out`` for a :attr:`_node_local` table, without the checks: ``ids``
        must be int64 in ``[0, num_rows)`` and ``out`` float32 ``(len(ids), dim)``. Worker ranks;
        local. For callers that validated many tables' ids at once
        (:class:`hpcps.nn.ShardedEmbeddingCollection`); counted in :attr:`stats` like a pull."""
        self._check_worker("pull")
        started = time.perf_counter()
        st = self.stats
        st.pulls += 1
        st.pull_rows += ids.size
        self._gather_node(ids, out, self._data, self._views)
        st.pull_seconds += time.perf_counter() - started

    def _gather_node(self, ids: np.ndarray, out: np.ndarray, window, views: list) -> None:
        """Read rows ``ids`` from ``window``'s shards, every PS's mapped in ``views`` (this node),
        into ``out``."""
        st, P = self.stats, self.ctx.num_ps
        if ids.size == 0:
            return
        window.sync()
        if P == 1:
            np.take(views[0], ids, axis=0, out=out)
            st.rows_per_ps[0] += ids.size
            st.bytes_per_ps[0] += out.nbytes
            return
        owner, local = np.divmod(ids, P)[::-1]
        for p in range(P):
            sel = np.flatnonzero(owner == p)
            if sel.size:
                out[sel] = np.take(views[p], local[sel], axis=0)
                st.rows_per_ps[p] += sel.size
                st.bytes_per_ps[p] += sel.size * self.dim * out.itemsize

    def pull(self, ids, full: bool = False) -> np.ndarray:
        """``pull_async(ids, full).wait()``. Worker ranks; local (one-sided)."""
        return self.pull_async(ids, full).wait()

    def versions(self, ids) -> np.ndarray:
        """Stamps of rows ``ids``: int32, the highest ``step + 1`` of an update applied to each row
        (0: never updated). Worker ranks of a table made with ``track_versions``; local (one-sided).

        Atomic per element against concurrent stamping (``Get_accumulate(NO_OP)`` on
        the RMA path); read them after the step's fence for an exact answer.
        """
        self._check_worker("versions")
        if not self.track_versions:
            raise ValueError(f"table {self.name!r} was created without track_versions")
        ids = as_ids(self.name, ids, self.num_rows)
        out = np.empty(ids.size, np.int32)
        if ids.size == 0:
            return out
        P = self.ctx.num_ps
        owner, local = np.divmod(ids, P)[::-1]
        win = self._versions.win
        for p in np.unique(owner).tolist():
            sel = np.flatnonzero(owner == p)
            view = self._version_views[p]
            if view is not None:
                self._versions.sync()
                out[sel] = np.take(view, local[sel])
                continue
            rank = self.ctx.ps_world_ranks[p]
            buf = np.empty(sel.size, np.int32)
            dtype = MPI.INT32_T.Create_indexed_block(1, local[sel].tolist()).Commit()
            try:
                win.Get_accumulate([buf, MPI.INT32_T], [buf, MPI.INT32_T], rank, (0, 1, dtype), op=MPI.NO_OP)
                win.Flush(rank)
            finally:
                dtype.Free()
            out[sel] = buf
        return out

    def _stamp_rows(self, p: int, rank: int, rows: np.ndarray, stamp: int) -> None:
        """Worker, holding PS ``p``'s shard lock: raise the version of ``rows`` (unique) to ``stamp``."""
        view = self._version_views[p]
        if view is not None:
            self._versions.sync()
            view[rows] = np.maximum(view[rows], np.int32(stamp))
            self._versions.sync()
            return
        vals = np.full(rows.size, stamp, np.int32)
        dtype = MPI.INT32_T.Create_indexed_block(1, rows.tolist()).Commit()
        try:
            self._versions.win.Accumulate([vals, MPI.INT32_T], rank, (0, 1, dtype), op=MPI.MAX)
            self._versions.win.Flush(rank)
        finally:
            dtype.Free()

    # ------------------------------------------------------------ push
    def push_async(self, ids, grads) -> PushHandle:
        """Apply the optimizer to rows ``ids`` with gradients ``grads``. Worker ranks; local (one-sided).

        ``grads`` is float32 ``(len(ids), dim)``; gradients of duplicate ids are
        summed. Raises ``ValueError`` on bad input before any communication.
        With plain SGD the update is complete (visible to every later pull) when
        the call returns; stateful optimizers stage the gradient, and the owning
        PS applies it as the context's mode says (``ctx.step_end``/``ctx.fence``).
        Several tables at once: :func:`push_many`.
        """
        push_many([(self, ids, grads)])
        return PushHandle()

    def _push_parts(self, ids, grads, checked: bool = False):
        """Validate one push, split it by owner and prepare each part, all before any lock is
        taken: ``[(p, (local rows, grads, their unique rows, summed grads or None, alpha))]``. Local,
        no communication. ``checked``: the caller vouches that ``ids`` are int64, unique, sorted
        and in range and ``grads`` float32, C-contiguous, finite and ``(len(ids), dim)``
        (:class:`hpcps.nn.ShardedEmbeddingCollection` checked them for all its tables at once)."""
        self._check_worker("push")
        if not checked:
            ids = as_ids(self.name, ids, self.num_rows)
            grads = as_grads(self.name, grads, ids.size, self.dim)
        st = self.stats
        st.pushes += 1
        st.push_rows += ids.size
        if ids.size == 0:
            return []
        P = self.ctx.num_ps
        if P == 1:
            split = [(0, ids, grads)]
        else:
            owner, local = np.divmod(ids, P)[::-1]
            split = [(p, local[sel], grads[sel]) for p in np.unique(owner).tolist()
                     for sel in (np.flatnonzero(owner == p),)]
        return [(p, self._prepare(p, rows_p, g_p, checked)) for p, rows_p, g_p in split]

    def _prepare(self, p: int, rows_p: np.ndarray, g_p: np.ndarray, distinct: bool = False):
        """The work of a push part that needs no lock: unique rows, the factor on the gradient
        (stateful: 1, the PS applies the optimizer; SGD: -lr), and for RMA the summed, scaled
        gradients (one accumulate per row). ``distinct``: the rows are known unique and sorted."""
        alpha = 1.0 if self.stateful else -self.optimizer.lr_at(self.ctx.control.step)
        # ids already unique and sorted (what ShardedEmbeddingBag pushes) skip the sort
        distinct = distinct or bool(np.all(rows_p[1:] > rows_p[:-1]))
        shared = (self._stage_views if self.stateful else self._views)[p] is not None
        if self.push_dtype != "float32":        # stateful: each row's summed gradient, rounded
            uniq, sums = (rows_p, g_p) if distinct else self._sum_rows(rows_p, g_p, alpha)
            half = _narrow(sums, self.push_dtype)
            if shared:                          # nothing to save: add the rounded values here
                wide = _widen(half, self.push_dtype)
                return uniq, wide, uniq, None, alpha
            return uniq, half, uniq, half, alpha
        if shared:
            return rows_p, g_p, rows_p if distinct else np.unique(rows_p), None, alpha
        if distinct:
            return rows_p, g_p, rows_p, g_p if alpha == 1.0 else g_p * np.float32(alpha), alpha
        uniq, sums = self._sum_rows(rows_p, g_p, alpha)
        return rows_p, g_p, uniq, sums, alpha

    def _sum_rows(self, rows_p: np.ndarray, g_p: np.ndarray, alpha: float):
        """The unique rows of ``rows_p`` and ``alpha`` times the sum of each one's gradients."""
        torch = _t()
        uniq, inverse = np.unique(rows_p, return_inverse=True)
        sums = torch.zeros((uniq.size, self.dim), dtype=torch.float32)
        sums.index_add_(0, torch.from_numpy(inverse.reshape(-1)), torch.from_numpy(g_p), alpha=alpha)
        return uniq, sums.numpy()

    def _put_inbox(self, p: int, rank: int, uniq: np.ndarray, half: np.ndarray) -> bool:
        """Worker holding PS ``p``'s shard lock: append rows ``uniq`` and their 16-bit gradients to
        its push inbox, complete on return; False, and nothing written, when they do not fit."""
        win, cap, k = self._inbox.win, self._inbox_caps[p], uniq.size
        count = np.empty(1, np.int64)
        win.Get([count, MPI.INT64_T], rank, (0, 1, MPI.INT64_T))
        win.Flush(rank)
        n = int(count[0])
        if n + k > cap:
            return False
        rows = np.ascontiguousarray(uniq, dtype=np.int64)
        half = np.ascontiguousarray(half)
        win.Put([rows, MPI.INT64_T], rank, (8 + 8 * n, k, MPI.INT64_T))
        win.Put([half, MPI.UINT16_T], rank, (8 + 8 * cap + 2 * self.dim * n, k * self.dim, MPI.UINT16_T))
        count[0] = n + k
        win.Put([count, MPI.INT64_T], rank, (0, 1, MPI.INT64_T))
        win.Flush(rank)
        return True

    def _push_locked(self, p: int, part) -> None:
        """Worker holding PS ``p``'s shard lock: add a prepared part (:meth:`_prepare`) into its
        local rows (stateful: stage it)."""
        rows_p, g_p, uniq, buf, alpha = part
        torch = _t()
        st = self.stats
        rank = self.ctx.ps_world_ranks[p]
        stamp = self.ctx.control.step + 1
        st.rows_per_ps[p] += rows_p.size
        st.bytes_per_ps[p] += g_p.nbytes
        window = self._stage if self.stateful else self._data
        view = (self._stage_views if self.stateful else self._views)[p]
        if view is not None:
            slab = self._slab_views[p]
            if slab is not None and uniq is rows_p and alpha == 1.0 and rows_p.size <= slab[1].size:
                # distinct rows: into the hand-off slab in order, if no other push is there yet
                head, rows, grads = slab
                self._slab.sync()
                if head[0] == 0:
                    k = rows_p.size
                    rows[:k] = rows_p
                    grads[:k] = g_p
                    self._slab.sync()             # the rows before the count that announces them
                    head[0] = k
                    self._slab.sync()
                    return
            window.sync()
            torch.from_numpy(view).index_add_(0, torch.from_numpy(rows_p), torch.from_numpy(g_p), alpha=alpha)
            if self.stateful:
                flags = self._flag_views[p]
                self._flags.sync()
                new = uniq[flags[uniq] == 0]
                flags[new] = 1
                self._list_rows(p, new)
                self._flags.sync()
            elif self.track_dirty:
                self._dirty_views[p][rows_p] = 1
            window.sync()
            if self.track_versions and not self.stateful:
                self._stamp_rows(p, rank, uniq, stamp)
            return
        if buf.dtype == np.uint16:              # a 16-bit push: to the inbox if it fits
            if self._put_inbox(p, rank, uniq, buf):
                return
            st.inbox_full += 1
            buf = _widen(buf, self.push_dtype)
            st.bytes_per_ps[p] += buf.nbytes - g_p.nbytes
        # every operation is issued before the first wait, so their latencies overlap: the flags
        # and list count are read first (the rows not staged yet go on the PS's list), then the
        # gradient, the marks and the list entries are written and flushed together
        marks = self._flags if self.stateful else (self._dirty if self.track_dirty else None)
        dtype = self._hindexed(uniq)
        flag_type = MPI.BYTE.Create_indexed_block(1, uniq.tolist()).Commit() if marks is not None else None
        try:
            window.win.Accumulate([buf, MPI.FLOAT], rank, (0, 1, dtype), op=MPI.SUM)
            if self.stateful:
                seen, count = np.empty(uniq.size, np.uint8), np.empty(1, np.int64)
                self._flags.win.Get([seen, MPI.BYTE], rank, (0, 1, flag_type))
                self._list.win.Get([count, MPI.INT64_T], rank, (0, 1, MPI.INT64_T))
                self._flags.win.Flush(rank)
                self._list.win.Flush(rank)
                new = np.ascontiguousarray(uniq[seen == 0], dtype=np.int64)
                n = int(count[0])
                if new.size:
                    count[0] = _listed(n, new.size, self._list_caps[p])
                    if count[0] > 0:
                        self._list.win.Put([new, MPI.INT64_T], rank, ((1 + n) * 8, new.size, MPI.INT64_T))
                    self._list.win.Put([count, MPI.INT64_T], rank, (0, 1, MPI.INT64_T))
            if marks is not None:
                ones = np.ones(uniq.size, np.uint8)
                marks.win.Put([ones, MPI.BYTE], rank, (0, 1, flag_type))
            window.win.Flush(rank)      # remote completion (a request would only say "buffer free")
            if marks is not None:
                marks.win.Flush(rank)
            if self.stateful:
                self._list.win.Flush(rank)
            if not self.stateful and self.track_versions:
                self._stamp_rows(p, rank, uniq, stamp)
        finally:
            dtype.Free()
            if flag_type is not None:
                flag_type.Free()

    def push(self, ids, grads) -> None:
        """``push_async(ids, grads).wait()``. Worker ranks; local (one-sided)."""
        self.push_async(ids, grads).wait()

    # ------------------------------------------------------------ PS side
    def _list_rows(self, p: int, new: np.ndarray) -> None:
        """Worker holding PS ``p``'s shard lock, PS on this node: add ``new`` (unique rows whose flag
        was clear) to its staged-row list, or mark the list overflowed. Local."""
        if new.size == 0:
            return
        view = self._list_views[p]
        self._list.sync()
        n = int(view[0])
        view[0] = _listed(n, new.size, self._list_caps[p])
        if view[0] > 0:
            view[1 + n:1 + n + new.size] = new
        self._list.sync()

    def _ps_local(self):
        """PS: ``(shard, state, (stage, flags, list, slab))``, this rank's memory as the apply reads it
        (the shard and the optimizer state as torch tensors; the hand-off slab's ``(head, rows,
        grads)``, or None without one): made once, since a window's memory stays put
        until ``free()`` (views made per apply cost ~17 us per table). Local."""
        if self._local is None:
            torch = _t()
            staged = None
            if self.stateful:
                stage = self._stage.local().reshape(-1, self.dim)
                slab = self._slab_parts(self._slab.local(np.uint8), self._slab_cap) if self._slab is not None else None
                staged = (stage, self._flags.local(np.uint8)[:stage.shape[0]], self._list.local(np.int64), slab)
            self._local = (torch.from_numpy(self.shard()), {k: torch.from_numpy(v) for k, v in self._state.items()},
                           staged)
        return self._local

    def _take_staged(self):
        """PS holding its own shard lock: the staged rows and their summed gradients, which are
        reset to zero; ``None`` when nothing is staged. Local."""
        if not self.stateful or self._data.freed:
            return None
        stage, flags, listed, slab = self._ps_local()[2]
        self._stage.sync()
        self._flags.sync()
        self._list.sync()
        self._drain_inbox(stage, flags, listed)
        taken = self._take_slab(slab, stage, flags, listed)
        if taken is not None:
            return taken
        n = int(listed[0])
        rows = np.sort(listed[1:1 + n]) if n >= 0 else np.flatnonzero(flags)
        if n < 0:
            self.stats.applies_scanned += 1
        elif n:
            self.stats.applies_listed += 1
        listed[0] = 0
        self._list.sync()
        if rows.size == 0:
            return None
        grads = stage[rows]
        stage[rows] = 0
        flags[rows] = 0
        self._stage.sync()
        self._flags.sync()
        return rows, grads

    def _take_slab(self, slab, stage: np.ndarray, flags: np.ndarray, listed: np.ndarray):
        """PS holding its own shard lock, inside :meth:`_take_staged`: empty the hand-off ``slab``. When
        nothing else is staged, return its ``(rows, grads)`` (one push's distinct rows: what the
        apply needs as they are); else add it to the staged gradients, flag and list its rows, and
        return None. Local."""
        if slab is None:
            return None
        head, rows, grads = slab
        self._slab.sync()
        k = int(head[0])
        if k == 0:
            return None
        rows, grads = rows[:k].copy(), grads[:k].copy()
        head[0] = 0
        self._slab.sync()
        if int(listed[0]) == 0:
            self.stats.applies_slab += 1
            return rows, grads
        self._stage_here(stage, flags, listed, rows, grads, rows)
        return None

    def _stage_here(self, stage, flags, listed, rows: np.ndarray, grads: np.ndarray, uniq: np.ndarray) -> None:
        """PS holding its own shard lock: add ``grads`` to the staged gradients of ``rows`` (whose
        distinct values are ``uniq``), flag and list the rows not staged yet. Local."""
        torch = _t()
        torch.from_numpy(stage).index_add_(0, torch.from_numpy(rows), torch.from_numpy(grads))
        new = uniq[flags[uniq] == 0]
        flags[new] = 1
        n = int(listed[0])
        listed[0] = _listed(n, new.size, self._list_cap)
        if listed[0] > 0:
            listed[1 + n:1 + n + new.size] = new

    def _drain_inbox(self, stage: np.ndarray, flags: np.ndarray, listed: np.ndarray) -> None:
        """PS holding its own shard lock, inside :meth:`_take_staged`: add the 16-bit pushes waiting
        in the push inbox to the staged gradients (widened, in float32), flag and list their rows,
        and empty the inbox. Local."""
        if self._inbox is None:
            return
        self._inbox.sync()
        head = self._inbox.local(np.int64)
        k = int(head[0])
        if k == 0:
            return
        cap, dim = self._inbox_cap, self.dim
        rows = head[1:1 + k].copy()
        half = self._inbox.local(np.uint16)[(8 + 8 * cap) // 2:][:cap * dim].reshape(cap, dim)[:k]
        self._stage_here(stage, flags, listed, rows, _widen(half, self.push_dtype), np.unique(rows))
        head[0] = 0
        self._inbox.sync()

    def _apply_taken(self, rows: np.ndarray, grads: np.ndarray, step: int, stamp: int | None = None) -> None:
        """PS: apply the optimizer to ``rows`` with the gradients :meth:`_take_staged` gave. Local."""
        torch = _t()
        self._applies += 1
        shard, state, _ = self._ps_local()
        self.optimizer.apply(shard, state, torch.from_numpy(rows), torch.from_numpy(grads), step, self._applies)
        if self.track_dirty:
            self._dirty.local(np.uint8)[rows] = 1
        self._data.sync()
        self._sync_half(rows)
        if self.track_versions:                 # after the rows: a reader that sees the stamp sees them
            ver = self._versions.local(np.int32)
            ver[rows] = np.maximum(ver[rows], np.int32(step + 1 if stamp is None else stamp))
            self._versions.sync()

    def take_dirty(self) -> np.ndarray:
        """PS, while no worker pushes (checkpoint cut): local rows changed since the last call,
        and reset the marks. Local."""
        if not self.track_dirty:
            raise ValueError(f"table {self.name!r} was created without track_dirty")
        self._dirty.sync()
        flags = self._dirty.local(np.uint8)[:self.shard().shape[0]]
        rows = np.flatnonzero(flags)
        flags[rows] = 0
        self._dirty.sync()
        return rows

    # ------------------------------------------------------------ teardown
    def free(self) -> None:
        """Free the table's windows. Collective over the world communicator; safe twice."""
        if self._data.freed:
            return
        self._views = self._stage_views = self._flag_views = self._dirty_views = [None] * self.ctx.num_ps
        self._local = None
        self._list_views = [None] * self.ctx.num_ps
        self._version_views = [None] * self.ctx.num_ps
        self._rowtype.Free()
        if self.track_versions:
            self._versions.free()
        if self.pull_dtype != "float32":
            self._half_views = [None] * self.ctx.num_ps
            self._halftype.Free()
            self._half.free()
        if self.track_dirty:
            self._dirty.free()
        if self._inbox is not None:
            self._inbox.free()
        if self._slab is not None:
            self._slab_views = [None] * self.ctx.num_ps
            self._slab.free()
        if self.stateful:
            self._list.free()
            self._flags.free()
            self._stage.free()
        self._data.free()
        self.ctx._forget(self)

    @property
    def freed(self) -> bool:
        return self._data.freed

    def __repr__(self) -> str:
        return (f"<hpcps.EmbeddingTable {self.name!r} {self.num_rows}x{self.dim} over "
                f"{self.ctx.num_ps} PS, {type(self.optimizer).__name__}>")


def push_many(pushes) -> None:
    """Push to several tables in one go: ``pushes`` is ``[(table, ids, grads), ...]``, each as
    :meth:`EmbeddingTable.push_async`. Worker ranks; local (one-sided).

    Every push is validated before any communication (a bad one raises ``ValueError``
    and nothing is pushed). Then each PS's shard lock, shared by all tables of a
    context, is taken once for all the tables' rows it owns, and one staged push is
    counted: a training step's pushes of N tables cost one lock round trip per PS
    instead of N. Same result as the pushes one by one.
    """
    _push_many([(table, ids, grads, False) for table, ids, grads in pushes])


def _push_many(pushes) -> None:
    """:func:`push_many` of ``[(table, ids, grads, checked), ...]``: ``checked`` as in
    :meth:`EmbeddingTable._push_parts` (True skips that push's checks). Worker ranks; local."""
    if not pushes:
        return
    ctx = pushes[0][0].ctx
    if any(item[0].ctx is not ctx for item in pushes):
        raise ValueError("push_many: all tables must belong to one hpcps context")
    started = time.perf_counter()
    by_ps = {}
    for table, ids, grads, checked in pushes:
        for p, part in table._push_parts(ids, grads, checked):
            by_ps.setdefault(p, []).append((table, part))
    locks = ctx.shard_locks
    for p in sorted(by_ps):
        rank = ctx.ps_world_ranks[p]
        locks.acquire(rank)
        try:
            for table, part in by_ps[p]:
                table._push_locked(p, part)
            if any(table.stateful for table, _ in by_ps[p]):
                locks.add_pending(rank)
        finally:
            locks.release(rank)
    elapsed = time.perf_counter() - started
    for item in pushes:
        item[0].stats.push_seconds += elapsed / len(pushes)


def apply_staged(ctx, tables, step: int, stamp: int | None = None) -> int:
    """PS: apply the gradients staged in this rank's shards of ``tables``; returns the rows updated.
    Local; called from the serve loop (``StepControl.service``).

    Staged sums of every table are taken and zeroed under the shard lock in one
    acquisition, so a worker's push (all tables of a step, :func:`push_many`) lands
    either wholly in this apply or wholly in the next one. ``stamp`` (default
    ``step + 1``) is an upper bound on ``step + 1`` of the pushes applied
    (``track_versions``).
    """
    me = ctx.rank
    locks = ctx.shard_locks
    if locks.pending(me) == 0:
        return 0
    locks.acquire(me)
    try:
        taken = [(t, t._take_staged()) for t in tables]
        locks.pending(me, reset=True)
    finally:
        locks.release(me)
    rows = 0
    for t, got in taken:
        if got is not None:
            t._apply_taken(*got, step, stamp)
            rows += got[0].size
    return rows
