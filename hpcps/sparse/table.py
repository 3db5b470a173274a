"""Sparse embedding tables sharded over the PS ranks: the front.

:class:`EmbeddingTable` checks its arguments, agrees on them across ranks, owns
the rows' window and puts the parts together; each part owns its windows and
frees what it made:

- ``pull.py``: the pull path (shared-memory gathers, RMA gets; ``pull_server.py``: pulls by messages);
- ``push.py``: the push path and its transports (slab, staged rows, mailbox, RMA);
- ``staging.py``: the staged gradients, and the PS's drain and apply;
- ``codec.py``: 16-bit rows and gradients (the PS's 16-bit copy);
- ``mailbox.py``: pushes of stateful tables to a PS on another node, without its lock;
- ``tracking.py``: row version stamps and dirty marks;
- ``snapshot.py``: the checkpoint side (snapshots, chunked copies, restore);
- ``spec.py``: the argument checks and the agreement of every rank on them.

Placement (which PS owns a row, and where in its shard) is ``hpcps.core.sharding``.
"""

import logging
import math
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from ..core.ids import initial_rows
from ..core.malloc import map_pages
from ..core.optimizers import SparseOptimizer, new_state, reset_state
from ..core.sharding import logical_tables, make_sharding
from ..core.window import Window
from ..core.errors import FreedError, RoleError
from .codec import HalfCopy, torch_module
from .mailbox import Mailbox
from .pull import PullHandle, gather_local, pull_async
from .push import PushHandle, push_many
from .snapshot import Checkpointable
from .staging import Staging
from .spec import agree, check_args, check_init, check_segments
from .tracking import DirtyRows, RowVersions
from .validate import as_ids

__all__ = ["EmbeddingTable", "TableStats"]

logger = logging.getLogger(__name__)

_INIT_CHUNK_ROWS = 1 << 14
_MAP_NOW_BYTES = 1 << 30        # a worker maps the node's shards of a table up to this size at once (~0.3 s a GB)


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
    applies_mailbox: int = 0    # PS: applies that took only pushes from its mailboxes (summed, not staged)
    inbox_full: int = 0         # pushes to another node too large for the PS's push mailbox (sent the locked way)


class EmbeddingTable(Checkpointable):
    """A ``num_rows x dim`` float32 table sharded row-wise over the PS ranks.

    Collective over the world communicator of ``ctx``: every rank, PS and
    worker, creates the same tables in the same order, before the PS ranks
    call ``ctx.serve()``. Initial rows depend only on ``(seed, name, row id)``.

    init: ``"uniform"`` (in ``[-init_scale, init_scale)``, the default), ``"normal"`` (standard
    deviation ``init_scale``) or ``"zeros"``; ``init_scale`` defaults to ``1/sqrt(dim)``, and with
    ``segments`` may be a sequence, one per segment (``hpcps.initial_rows``).

    sharding: which PS owns each row: ``None`` or ``"modulo"`` (``id % P``, the default),
    ``"range"`` (contiguous ranges), or a sharding object for ``num_rows`` rows over
    ``ctx.num_ps`` PS ranks (``hpcps.core.sharding``).
    transport: ``None`` (the context's), ``"auto"`` or ``"rma"``; see :func:`hpcps.init`.
    rma_read: ``None`` (the context's), ``"auto"``, ``"get_accumulate"`` or ``"get"``: how pulls read a
    remote shard; see :func:`hpcps.init`.
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
    rounded rows travel in 16 bits, through its push mailbox (``hpcps.sparse.mailbox``; a
    push too large for it goes as float32 by accumulate, counted in ``stats.inbox_full``). The PS applies
    every update, plain SGD included.
    segments: ``[(name, rows), ...]`` summing to ``num_rows``: the table stores several logical
    tables of one ``dim`` and optimizer back to back ("table-batched", as FBGEMM's TBE), so a
    step's pulls, pushes and optimizer apply cost one pass instead of one per table. Segment
    ``j``'s row ``i`` is global row ``start_j + i`` and starts as table ``name_j``'s row ``i``
    would (``initial_rows(seed, name_j, i)``); ``logical`` lists ``(name_j, start_j, rows_j)``
    (the table itself when it has no segments). ``hpcps.nn.ShardedEmbeddingCollection`` maps
    each logical table's ids onto its segment.
    fill: ``False`` leaves the PS's rows unwritten until :meth:`fill_initial` or a restore of
    every row (a restart skips writing what it would overwrite).
    """

    def __init__(self, ctx, name: str, num_rows: int, dim: int,
                 optimizer: SparseOptimizer | None = None, seed: int = 0,
                 init_scale: float | None = None, transport: str | None = None, track_dirty: bool = False,
                 track_versions: bool = False, pull_dtype: str = "float32", push_dtype: str = "float32",
                 segments=None, sharding=None, rma_read: str | None = None, init: str = "uniform",
                 fill: bool = True):
        optimizer, transport, rma_read = check_args(ctx, name, num_rows, dim, optimizer, transport, pull_dtype,
                                                     push_dtype, rma_read)
        segments = check_segments(name, segments, int(num_rows))
        init, scales = check_init(name, init, init_scale, segments, dim)
        sharding = make_sharding(sharding, int(num_rows), ctx.num_ps)
        spec = (name, int(num_rows), int(dim), repr(optimizer), int(seed), init, scales, transport,
                bool(track_dirty), bool(track_versions), pull_dtype, push_dtype, segments, repr(sharding), rma_read)
        agree(ctx, name, spec)

        self.ctx, self.name, self.num_rows, self.dim = ctx, name, int(num_rows), int(dim)
        self.optimizer, self.seed, self.transport = optimizer, int(seed), transport
        self.init, self.init_scales, self.init_scale = init, scales, scales[0]
        self.segments, self.sharding, self.rma_read = segments, sharding, rma_read
        self.pull_dtype, self.push_dtype = pull_dtype, push_dtype
        self.track_dirty, self.track_versions = bool(track_dirty), bool(track_versions)
        # [(name, first row, rows)] of each segment (the table itself if it has none)
        self.logical = logical_tables(name, self.num_rows, segments)
        self._starts = np.array([first for _, first, _ in self.logical] + [self.num_rows], np.int64)
        self.stats = TableStats(rows_per_ps=[0] * ctx.num_ps, bytes_per_ps=[0] * ctx.num_ps)
        # a 16-bit copy is kept current by the PS, and 16-bit pushes are widened by it, so with
        # either the PS applies every update (even plain SGD)
        # deterministic sync mode: the PS applies every update, summing workers' pushes in worker order
        self.stateful = (optimizer.stateful or pull_dtype != "float32" or push_dtype != "float32"
                         or ctx.deterministic)
        self._unfilled = ctx.is_ps                  # PS: rows not yet written (fill_initial or a restore)
        self._allocate(fill)
        if fill:
            self.fill_initial()
        # its number in message pulls (rma_read = "messages": hpcps.sparse.pull_server)
        self.pull_number = ctx.pull_server.register(self) if ctx.pull_server is not None else -1
        if ctx.is_worker or self.stateful:      # torch does the adds: import it now, not mid-training
            torch_module()
        ctx.world.Barrier()                     # rows exist before anyone pulls
        if ctx.is_worker:
            self._map_node_shards()
        ctx.register(self)

    # ------------------------------------------------------------ set-up
    def _allocate(self, fill: bool) -> None:
        """Allocate the windows of the rows and of each part, and the PS's optimizer state (written
        now if ``fill``, else by ``fill_initial`` or a restore). Collective."""
        ctx, what = self.ctx, f"table {self.name!r}"
        local_rows = self.sharding.shard_rows(ctx.ps_rank) if ctx.is_ps else 0
        self.rows = Window(ctx.world, local_rows * self.dim * 4, what=what)
        self.rowtype = MPI.FLOAT.Create_contiguous(self.dim).Commit()
        self.row_views = [None] * ctx.num_ps    # worker: each PS's rows on this node
        ordered = ctx.deterministic             # every push through the mailbox: no staging rows
        self.staging = Staging(ctx, 0 if ordered else local_rows, self.dim, what,
                               slab=self.push_dtype == "float32" and not ordered) if self.stateful else None
        self.mailbox = Mailbox(ctx, [self.sharding.shard_rows(p) for p in range(ctx.num_ps)], self.dim,
                               self.push_dtype, what, ordered) if self.stateful else None
        self.dirty = DirtyRows(ctx, local_rows, what) if self.track_dirty else None
        self.row_versions = RowVersions(ctx, local_rows, what) if self.track_versions else None
        self.half = HalfCopy(ctx, local_rows, self.dim, self.pull_dtype, what) \
            if self.pull_dtype != "float32" else None
        self._applies = 0                       # PS: optimizer steps applied to this shard
        self._state = {}                        # PS: optimizer state arrays of the shard
        self._tensors = None                    # PS: the shard and state as torch tensors (_ps_tensors)
        self._snap = None                       # PS: a chunked snapshot in progress (begin_snapshot)
        self._spare = None                      # PS: the last one's arrays, once written (recycle_snapshot)
        if ctx.is_ps:
            if self.stateful:
                self._state = new_state(self.optimizer, local_rows, self.dim, written=fill)
            if not fill:                        # a restore writes the rows whole: their pages now
                map_pages(self.shard(), write=True)

    def fill_initial(self) -> None:
        """PS ranks: write every row of this rank's shard as it starts (:func:`hpcps.initial_rows`),
        and its optimizer state, once. The constructor does it unless given ``fill=False``: a
        restart that then restores every row (``hpcps.checkpoint.restore_tables``) skips writing
        what it would overwrite, and calls this only where no checkpoint was loaded. A no-op on
        workers and once filled or restored. Local; before any worker pulls (the driver's
        ``ctx.control.set_start`` publishes the rows)."""
        if not self._unfilled:
            return
        self._unfilled = False
        if self._state:
            reset_state(self.optimizer, self._state)
        shard = self.shard()
        p, local_rows = self.ctx.ps_rank, shard.shape[0]
        for start in range(0, local_rows, _INIT_CHUNK_ROWS):
            stop = min(local_rows, start + _INIT_CHUNK_ROWS)
            gids = self.sharding.global_ids(p, start, stop)
            # ascending ids: each segment's rows are one run of them, initialized under its name
            cut = np.searchsorted(gids, self._starts).tolist()
            for j, (seg, _, _) in enumerate(self.logical):
                if cut[j] < cut[j + 1]:
                    initial_rows(self.seed, seg, gids[cut[j]:cut[j + 1]] - self._starts[j], self.dim,
                                 self.init_scales[j], out=shard[start + cut[j]:start + cut[j + 1]], kind=self.init)
        if self.half is not None:
            self.half.refresh(shard)
        self.rows.sync()

    def _map_node_shards(self) -> None:
        """Worker: map the windows of the PS ranks on this node (``transport="auto"``). Local."""
        ctx = self.ctx
        near = [r if self.transport == "auto" and r in ctx.node_ranks else None for r in ctx.ps_world_ranks]
        rows = [self.sharding.shard_rows(p) for p in range(ctx.num_ps)]
        self.row_views = self.rows.map_shared(near, [n * self.dim for n in rows], np.float32, self.dim)
        mapped = [r if v is not None else None for r, v in zip(near, self.row_views)]
        if sum(v.nbytes for v in self.row_views if v is not None) <= _MAP_NOW_BYTES:
            for v in self.row_views:            # no page-by-page faults in the first pulls (hpcps.core.malloc)
                if v is not None:
                    map_pages(v)
        if self.half is not None:
            self.half.map(near, [n * self.dim for n in rows])
        if self.dirty is not None and not self.stateful:
            self.dirty.map(mapped, [-(-n // 8) * 8 for n in rows])
        if self.row_versions is not None:
            self.row_versions.map(mapped, rows)
        if self.staging is not None and not ctx.deterministic:
            self.staging.map(near, [n * self.dim for n in rows])

    # ------------------------------------------------------------ helpers
    @property
    def segment_starts(self) -> np.ndarray:
        """First global row of each segment, then ``num_rows`` (one segment if none were given). Local."""
        return self._starts.copy()

    def check_worker(self, what: str) -> None:
        """Raise unless this is a worker rank and the table is not freed. Local."""
        if self.rows.freed:
            raise FreedError(f"table {self.name!r}: {what}() after free()")
        if not self.ctx.is_worker:
            raise RoleError(f"table {self.name!r}: {what}() is for worker ranks, not PS ranks")

    @property
    def remote(self) -> str:
        """How a worker reaches the PS ranks on other nodes (the layout line): ``RMA`` or ``messages``. Local."""
        return "messages" if self.rma_read == "messages" else "RMA"

    @property
    def shared_memory_ps(self) -> list[int]:
        """PS indices this worker reads straight from shared memory. Local."""
        return [p for p, v in enumerate(self.row_views) if v is not None]

    @property
    def node_local(self) -> bool:
        """Whether every shard is in this node's shared memory and pulls read float32 rows (what
        :func:`hpcps.sparse.pull.gather_local` needs). Local."""
        return self.pull_dtype == "float32" and all(v is not None for v in self.row_views)

    def shard(self) -> np.ndarray:
        """PS ranks: this rank's shard as a writable ``(shard_rows, dim)`` view. Local."""
        if self.rows.freed:
            raise FreedError(f"table {self.name!r}: shard() after free()")
        if not self.ctx.is_ps:
            raise RoleError(f"table {self.name!r}: shard() is for PS ranks")
        return self.rows.local().reshape(-1, self.dim)

    @property
    def traffic(self) -> TableStats:
        """This rank's counters (:attr:`stats`), under the name a dynamic table gives them. Local."""
        return self.stats

    def held_bytes(self) -> int:
        """PS: bytes of rows, optimizer state, 16-bit copy and push mailbox this rank holds. Local."""
        if not self.ctx.is_ps:
            return 0
        return (self.shard().nbytes + sum(v.nbytes for v in self._state.values())
                + (self.half.window.nbytes if self.half is not None else 0)
                + (self.mailbox.nbytes if self.mailbox is not None else 0))

    # ------------------------------------------------------------ worker API
    def pull_async(self, ids, full: bool = False) -> PullHandle:
        """Start reading rows ``ids`` (duplicates allowed). Worker ranks; local (one-sided).

        Returns a handle whose ``wait()`` gives float32 ``(len(ids), dim)``. A table with a
        16-bit ``pull_dtype`` reads its 16-bit copy and widens it, unless ``full`` (the
        float32 rows: exports). Raises ``ValueError`` on bad ids before any communication.
        """
        return pull_async(self, ids, full)

    def pull(self, ids, full: bool = False) -> np.ndarray:
        """``pull_async(ids, full).wait()``. Worker ranks; local (one-sided)."""
        return pull_async(self, ids, full).wait()

    def gather_local(self, ids: np.ndarray, out: np.ndarray) -> None:
        """Unchecked pull into ``out`` for a :attr:`node_local` table (:func:`hpcps.sparse.pull.gather_local`).
        Worker ranks; local."""
        gather_local(self, ids, out)

    def push_async(self, ids, grads) -> PushHandle:
        """Apply the optimizer to rows ``ids`` with gradients ``grads``. Worker ranks; local (one-sided).

        ``grads`` is float32 ``(len(ids), dim)``; gradients of duplicate ids are
        summed. Raises ``ValueError`` on bad input before any communication.
        With plain SGD the update is complete (visible to every later pull) when
        the call returns; stateful optimizers stage the gradient, and the owning
        PS applies it as the context's mode says (``ctx.step_end``/``ctx.fence``).
        Several tables at once: :func:`hpcps.push_many`.
        """
        push_many([(self, ids, grads)])
        return PushHandle()

    def push(self, ids, grads) -> None:
        """``push_async(ids, grads).wait()``. Worker ranks; local (one-sided)."""
        self.push_async(ids, grads).wait()

    def versions(self, ids) -> np.ndarray:
        """Stamps of rows ``ids``: int32, the highest ``step + 1`` of an update applied to each row
        (0: never updated). Worker ranks of a table made with ``track_versions``; local (one-sided).

        Atomic per element against concurrent stamping; read them after the step's fence for
        an exact answer.
        """
        self.check_worker("versions")
        if self.row_versions is None:
            raise ValueError(f"table {self.name!r} was created without track_versions")
        ids = as_ids(self.name, ids, self.num_rows)
        if ids.size == 0:
            return np.empty(0, np.int32)
        owner, local = self.sharding.place(ids)
        return self.row_versions.read(owner, local)

    # ------------------------------------------------------------ PS side
    def _ps_tensors(self):
        """PS: ``(shard, state)`` as torch tensors over this rank's memory, made once (a window's
        memory stays put until ``free()``; views made per apply cost ~17 us per table). Local."""
        if self._tensors is None:
            torch = torch_module()
            self._tensors = (torch.from_numpy(self.shard()), {k: torch.from_numpy(v) for k, v in self._state.items()})
        return self._tensors

    def apply(self, rows: np.ndarray, grads: np.ndarray, step: int, stamp: int | None = None) -> None:
        """PS: apply the optimizer to local ``rows`` with their summed ``grads`` (from
        :meth:`Staging.take`), and refresh what follows the rows. Local."""
        torch = torch_module()
        if self._snap is not None:              # a snapshot in progress keeps these rows as they were
            self._snap.before_apply(rows)
            if self._snap.done:
                self._snap = None
        self._applies += 1
        shard, state = self._ps_tensors()
        new = self.optimizer.apply(shard, state, torch.from_numpy(rows), torch.from_numpy(grads), step, self._applies)
        if not math.isfinite(float(new.sum())) and not bool(torch.isfinite(new).all()):   # one pass when all is well
            self._refuse_nonfinite(rows, new, step)
        if self.dirty is not None:
            self.dirty.mark_local(rows)
        self.rows.sync()
        if self.half is not None:
            self.half.refresh(self.shard(), rows)
        if self.row_versions is not None:         # after the rows: a reader that sees the stamp sees them
            self.row_versions.raise_local(rows, step + 1 if stamp is None else stamp)

    def _refuse_nonfinite(self, rows: np.ndarray, new, step: int):
        """PS: an apply of finite gradients made rows non-finite (an optimizer step too large): raise
        ``ValueError`` naming the table and rows, so the job ends instead of training on them."""
        torch = torch_module()
        bad = rows[~torch.isfinite(new).all(dim=1).numpy()]
        gids = self.sharding.global_ids(self.ctx.ps_rank)[bad]
        raise ValueError(f"table {self.name!r}: the {type(self.optimizer).__name__} step of training step {step} "
                         f"made {bad.size} row(s) inf or NaN from finite gradients (global ids "
                         f"{gids[:8].tolist()}{' ...' if bad.size > 8 else ''}): the learning rate "
                         f"({self.optimizer.lr}) is too large for these gradients; stopping")

    def take_dirty(self, level: str = "pfs") -> np.ndarray:
        """PS, while no worker pushes (checkpoint cut): local rows changed since checkpoint level
        ``level``'s (``"pfs"`` or ``"local"``) last call, and reset its marks. Local."""
        if self.dirty is None:
            raise ValueError(f"table {self.name!r} was created without track_dirty")
        return self.dirty.take(self.dirty.LOCAL if level == "local" else self.dirty.PFS)

    # ------------------------------------------------------------ teardown
    def free(self) -> None:
        """Free the table's windows. Collective over the world communicator; safe twice."""
        if self.rows.freed:
            return
        self.row_views = [None] * self.ctx.num_ps
        self._tensors = None
        self.rowtype.Free()
        for part in (self.row_versions, self.half, self.dirty, self.mailbox, self.staging):
            if part is not None:
                part.free()
        self.rows.free()
        if self.ctx.pull_server is not None:
            self.ctx.pull_server.forget(self.pull_number)
        self.ctx.forget(self)

    @property
    def freed(self) -> bool:
        return self.rows.freed

    def __repr__(self) -> str:
        return (f"<hpcps.EmbeddingTable {self.name!r} {self.num_rows}x{self.dim} over "
                f"{self.ctx.num_ps} PS, {type(self.optimizer).__name__}>")
