"""One PS's shard of a dynamic embedding table: rows created on first use, admitted after
``admit_min_count`` sightings, evicted (``lru`` or ``lfu``) when the shard is full (issue 26).

A shard holds ``capacity`` rows of ``dim`` floats and the sparse optimizer's state beside them, a
:class:`~hpcps.core.hashindex.HashIndex` from ids to rows, and per row the last step that
touched it and how many times it was pulled. A pull's :meth:`DynamicShard.observe` only looks
(present rows count a use, absent ids a sighting); a push's :meth:`DynamicShard.place` stores:
new admitted ids get free rows (their values ``hpcps.initial_rows(seed, name, [id], dim)``, as
in a fixed table, their state fresh), evicting rows not touched in this step when none are free;
ids not admitted get -1 (their pull is their initial row, their push is dropped and counted). Admission counts sightings in a count-min
sketch: bounded memory, never fewer than the true count (so an id is admitted at its
``admit_min_count``-th sighting or, on a hash collision, sooner). No MPI here: local.
"""

import contextlib

import numpy as np

from .ids import initial_rows, splitmix64
from .optimizers import SparseOptimizer, new_state
from .hashindex import HashIndex
from .torchlib import torch_module

__all__ = ["Admission", "DynamicShard", "EVICTIONS", "sum_rows"]

EVICTIONS = ("lru", "lfu")
PFS, LOCAL = 1, 2               # dirty bits of the checkpoint levels


_RANKS = 16                     # sum_rows: repeats of an id added in passes up to this many


def sum_rows(ids: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(distinct ids, sorted; each one's gradient rows summed)``, each sum added one row at a
    time in the rows' order in ``ids``: the same bits on every call, as a plain loop would give.
    Local."""
    if ids.size == 0:
        return ids[:0].copy(), np.zeros((0, grads.shape[1]), np.float32)
    order = np.argsort(ids, kind="stable")
    sid = ids[order]
    head = np.empty(ids.size, bool)             # the first of each id's rows
    head[0] = True
    np.not_equal(sid[1:], sid[:-1], out=head[1:])
    starts = np.flatnonzero(head)
    out = np.take(grads, order[starts], axis=0)
    if starts.size == ids.size:                 # no repeats: ~7x faster than np.add.reduceat
        return sid[starts], out
    lengths = np.diff(np.append(starts, ids.size))
    long_ = np.flatnonzero(lengths > _RANKS + 1)
    if long_.size > int(lengths.max()):         # a pass a rank is cheaper than a loop over them
        long_ = long_[:0]
    for s in long_:                             # a few ids repeated many times: each on its own
        block = np.take(grads, order[starts[s]:starts[s] + lengths[s]], axis=0)
        out[s] = np.add.accumulate(block, axis=0)[-1]
    seg = np.cumsum(head) - 1
    rest = np.flatnonzero(~head)
    if long_.size:
        rest = rest[lengths[seg[rest]] <= _RANKS + 1]
    rank = rest - starts[seg[rest]]             # the k-th repeat of its id is added in pass k
    by = rest[np.argsort(rank, kind="stable")]
    counts = np.bincount(rank) if rank.size else np.zeros(0, np.int64)
    at = 0
    for k in range(1, counts.size):
        part = by[at:at + counts[k]]            # distinct ids: a plain fancy add
        at += counts[k]
        out[seg[part]] += np.take(grads, order[part], axis=0)
    return sid[starts], out


class Admission:
    """Sightings of ids not stored yet, in a count-min sketch (``depth`` rows of ``width``
    counters). Local."""

    def __init__(self, min_count: int, width: int = 1 << 20, depth: int = 4, seed: int = 0):
        if int(min_count) < 1:
            raise ValueError(f"admit_min_count must be >= 1, got {min_count}")
        self.min_count = int(min_count)
        self.counts = np.zeros((depth, width), np.uint32) if self.min_count > 1 else None
        self._salts = splitmix64(np.arange(depth, dtype=np.uint64) + np.uint64(seed) * np.uint64(depth))

    def _cols(self, ids: np.ndarray) -> np.ndarray:
        width = self.counts.shape[1]
        return (splitmix64(ids.view(np.uint64)[None, :] ^ self._salts[:, None]) % np.uint64(width)).astype(np.int64)

    def count(self, ids: np.ndarray, times: np.ndarray) -> None:
        """Count ``times[i]`` more sightings of distinct ``ids[i]``. Local."""
        if self.counts is None:
            return
        cols = self._cols(ids)
        for d in range(self.counts.shape[0]):
            np.add.at(self.counts[d], cols[d], times.astype(np.uint32))

    def admitted(self, ids: np.ndarray) -> np.ndarray:
        """Which of distinct ``ids`` were seen at least ``min_count`` times. Local."""
        if self.counts is None:
            return np.ones(ids.size, bool)
        cols = self._cols(ids)
        est = np.min(np.stack([self.counts[d, cols[d]] for d in range(self.counts.shape[0])]), axis=0)
        return est >= self.min_count


class DynamicShard:
    """Rows, optimizer state and index of one PS's part of dynamic table ``name``. Local."""

    def __init__(self, name: str, dim: int, capacity: int, optimizer: SparseOptimizer, seed: int = 0,
                 admit_min_count: int = 1, evict: str = "lru", init: str = "uniform", scale: float | None = None,
                 memory: dict | None = None):
        """``memory``: where the rows (``"rows"``, ``(capacity, dim)`` float32) and the index's
        buckets (``"buckets"``, :func:`~hpcps.core.hashindex.bucket_count` x 2 int64) live, with a
        ``"version"`` word (int64) that is odd while the index changes and a ``"fence"`` (a memory
        barrier): window memory that same-host workers read (a seqlock). Default: private arrays."""
        if evict not in EVICTIONS:
            raise ValueError(f"table {name!r}: evict must be one of {', '.join(EVICTIONS)}, got {evict!r}")
        self.name, self.dim, self.seed, self.evict = name, int(dim), int(seed), evict
        self.optimizer, self.init, self.scale = optimizer, init, scale
        memory = memory or {}
        self.rows = memory["rows"] if "rows" in memory else np.zeros((capacity, self.dim), np.float32)
        self._buckets = memory.get("buckets")
        self.version = memory["version"] if "version" in memory else np.zeros(1, np.int64)
        self._fence = memory.get("fence", lambda: None)
        self.state = new_state(optimizer, capacity, self.dim) if optimizer.stateful else {}
        self._fresh = {k: v[:1].copy() for k, v in self.state.items()}    # a new row's state
        self.admission = Admission(admit_min_count, seed=seed)
        self.reset()

    def reset(self) -> None:
        """Empty the shard (no id, counters zero; the rows' memory is kept). Local."""
        capacity = self.rows.shape[0]
        with self.changing():
            self.index = HashIndex(capacity, storage=self._buckets)
        self.last = np.full(capacity, -1, np.int64)      # last step that touched each row
        self.uses = np.zeros(capacity, np.int64)
        if self.admission.counts is not None:
            self.admission.counts[:] = 0
        self.counters = {"inserts": 0, "evictions": 0, "rejected": 0}
        self.applies = 0
        # incremental checkpoints: per row a bit per checkpoint level (PFS, LOCAL) "changed since
        # that level's last checkpoint", and per level the ids evicted since
        self.dirty = np.zeros(capacity, np.uint8)
        self.evicted = {PFS: [], LOCAL: []}

    @contextlib.contextmanager
    def changing(self):
        """Around a change of the index (and the rows it maps): the version word odd meanwhile, so
        a reader of the window memory that saw it even, or changed, reads again. Local."""
        self.version[0] += 1
        self._fence()
        try:
            yield
        finally:
            self._fence()
            self.version[0] += 1

    @property
    def nbytes(self) -> int:
        """Bytes the shard holds: rows, optimizer state, the index, per-row counters and marks,
        the admission sketch. Local."""
        ix = self.index
        parts = [self.rows, *self.state.values(), ix.buckets, ix.row_key, ix.used, ix._free, self.last, self.uses,
                 self.dirty]
        if self.admission.counts is not None:
            parts.append(self.admission.counts)
        return sum(a.nbytes for a in parts)

    @property
    def capacity(self) -> int:
        return self.index.capacity

    def stats(self) -> dict:
        """``size``, ``capacity``, ``inserts``, ``evictions``, ``rejected`` of this shard. Local."""
        return {"size": self.index.size, "capacity": self.capacity, **self.counters}

    def initial(self, ids: np.ndarray) -> np.ndarray:
        """The initial rows of ``ids`` (as a fixed table's: ``hpcps.initial_rows``). Local."""
        return initial_rows(self.seed, self.name, ids, self.dim, self.scale, kind=self.init)

    def _distinct(self, ids, distinct: bool, inverse: bool = True):
        """``(distinct ids, sorted; each one's index in them (None: already distinct, or not
        asked for); how often each came)``."""
        ids = np.asarray(ids).reshape(-1)
        if ids.dtype != np.int64:
            raise TypeError(f"table {self.name!r}: ids must be int64, got {ids.dtype}")
        if distinct:
            return ids, None, np.ones(ids.size, np.int64)
        if not inverse:
            uniq, times = np.unique(ids, return_counts=True)
            return uniq, None, times
        return np.unique(ids, return_inverse=True, return_counts=True)

    def observe(self, ids, step: int, distinct: bool = False) -> np.ndarray:
        """A pull's look at ``ids`` (int64, any values, repeats allowed) in ``step``: the row of
        each, -1 where absent; present rows count a use and ``step`` as their last, absent ids a
        sighting (admission). Stores nothing: every change commutes, so the pulls of one step
        leave the same shard in whatever order they come. ``distinct``: sorted and distinct
        already. Local."""
        uniq, inv, times = self._distinct(ids, distinct)
        rows = self._observe(uniq, times, step)
        return rows if inv is None else rows[inv]

    def look(self, ids, step: int, distinct: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`observe`, giving ``(the distinct ids, sorted; their rows)``: what :meth:`place`
        of the same step may take as ``known``. Local."""
        uniq, _, times = self._distinct(ids, distinct, inverse=False)
        return uniq, self._observe(uniq, times, step)

    def _observe(self, uniq: np.ndarray, times: np.ndarray, step: int) -> np.ndarray:
        rows = self.index.find(uniq)
        hit = rows >= 0
        self.last[rows[hit]] = step
        self.uses[rows[hit]] += times[hit]
        self.dirty[rows[hit]] = PFS | LOCAL      # their last step and uses changed
        if not hit.all():
            self.admission.count(uniq[~hit], times[~hit])
        return rows

    def _rows_of(self, uniq: np.ndarray, known) -> np.ndarray:
        """The rows of sorted ``uniq`` (-1: absent), from ``known`` (:meth:`look`'s sorted ids and
        rows, the index unchanged since) where it has them: a binary search, not a probe."""
        if known is None or known[0].size == 0:
            return self.index.find(uniq)
        ids, got = known
        at = np.minimum(np.searchsorted(ids, uniq), ids.size - 1)
        hit = ids[at] == uniq
        rows = np.where(hit, got[at], -1)
        if not hit.all():
            rows[~hit] = self.index.find(uniq[~hit])
        return rows

    def place(self, uniq: np.ndarray, step: int, known: tuple | None = None) -> np.ndarray:
        """Rows for a push's distinct sorted ``uniq``: present ones as they are; absent ones
        admitted (seen ``admit_min_count`` times) inserted (their initial rows, fresh state),
        evicting rows no id of ``step`` touched when the shard is full; -1 for the others. Raises
        ``ValueError`` when ``step`` needs more rows than the shard has (before changing anything).
        ``known``: :meth:`look`'s result of this step, the index unchanged since. Local."""
        uniq = np.asarray(uniq, np.int64).reshape(-1)
        if uniq.size > self.capacity:
            raise ValueError(f"table {self.name!r}: {uniq.size} distinct ids in one step, more than this "
                             f"shard's capacity of {self.capacity} rows (raise capacity)")
        rows = self._rows_of(uniq, known)
        new = np.flatnonzero(rows < 0)
        admitted = new[self.admission.admitted(uniq[new])] if new.size else new
        if admitted.size:
            with self.changing():
                self._make_room(admitted.size, step, rows[rows >= 0])     # (raises before any change)
                got = self.index.insert(uniq[admitted])
                self.rows[got] = self.initial(uniq[admitted])
            for k, v in self.state.items():
                v[got] = self._fresh[k]
            self.last[got], self.uses[got], self.dirty[got] = step, 1, PFS | LOCAL
            rows[admitted] = got
            self.counters["inserts"] += got.size
        return rows

    def resolve(self, ids, step: int, distinct: bool = False) -> np.ndarray:
        """:meth:`observe`, then :meth:`place` of the absent ids: the row of each id, stored where
        admitted (-1 where not). Local."""
        uniq, inv, times = self._distinct(ids, distinct)
        rows = self._observe(uniq, times, step)
        miss = np.flatnonzero(rows < 0)
        if miss.size:
            rows[miss] = self.place(uniq[miss], step)
            got = miss[rows[miss] >= 0]
            self.uses[rows[got]] = times[got]
        return rows if inv is None else rows[inv]

    def _make_room(self, n: int, step: int, keep: np.ndarray) -> None:
        """Free rows for ``n`` new ids: evict the least recently (``lru``) or least often (``lfu``)
        used rows, never one touched at ``step`` or in ``keep``."""
        need = n - self.index.free
        if need <= 0:
            return
        spare = self.index.used.copy()
        spare[keep] = False
        live = np.flatnonzero(spare)
        live = live[self.last[live] != step]
        if live.size < need:
            raise ValueError(f"table {self.name!r}: step {step} needs {n} new rows; {self.index.free} are free and "
                             f"{live.size} not used in this step: the shard's {self.capacity} rows are too few "
                             f"for one step's ids (raise capacity)")
        # lru: oldest step first, then fewest uses; lfu: fewest uses first, then oldest
        first, second = (self.last, self.uses) if self.evict == "lru" else (self.uses, self.last)
        order = np.lexsort((live, second[live], first[live]))
        victims = live[order[:need]]
        for level in self.evicted.values():
            level.append(self.index.row_key[victims].copy())
        self.index.remove(victims)
        self.counters["evictions"] += victims.size

    def pull(self, rows: np.ndarray, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Rows ``rows`` (from :meth:`resolve`), into ``out`` when given; an id not admitted (-1)
        gets its initial row. Local."""
        out = np.take(self.rows, np.maximum(rows, 0), axis=0, out=out)
        miss = rows < 0
        if miss.any():
            out[miss] = self.initial(np.asarray(ids, np.int64).reshape(-1)[miss])
        return out

    def push(self, rows: np.ndarray, grads: np.ndarray, step: int) -> None:
        """Apply the summed gradients of ``rows`` (distinct, from :meth:`resolve`) with the
        optimizer; rows -1 (not admitted) are dropped and counted in ``rejected``. Local."""
        keep = rows >= 0
        self.counters["rejected"] += int(np.count_nonzero(~keep))
        rows, grads = rows[keep], grads[keep]
        self.applies += 1
        if rows.size:
            self.dirty[rows] = PFS | LOCAL
            torch = torch_module()      # here: a program that only pulls does not pay torch's import
            state = {k: torch.from_numpy(v) for k, v in self.state.items()}
            self.optimizer.apply(torch.from_numpy(self.rows), state, torch.from_numpy(rows),
                                 torch.from_numpy(np.ascontiguousarray(grads, np.float32)), step, self.applies)

    def take_dirty(self, level: str) -> tuple[np.ndarray, np.ndarray]:
        """``(rows changed, ids evicted)`` since checkpoint level ``level``'s (``"pfs"`` or
        ``"local"``) last call, and reset that level's marks. Local."""
        bit = LOCAL if level == "local" else PFS
        rows = np.flatnonzero(self.dirty & bit)
        self.dirty[rows] &= np.uint8(~bit & 0xFF)
        gone = np.concatenate([np.zeros(0, np.int64), *self.evicted[bit]])
        self.evicted[bit] = []
        return rows, gone

    def snapshot(self, dirty: tuple | None = None) -> dict:
        """A copy of every live row (``dirty``: of the live rows among those :meth:`take_dirty`
        gave, and the ids it gave as evicted): ``ids``, ``weights``, ``state``, ``last``, ``uses``,
        ``evicted`` (ids), ``counters``, ``applies`` and the admission sketch ``admission`` (None
        without one). Local."""
        if dirty is None:
            rows, gone = np.flatnonzero(self.index.used), np.zeros(0, np.int64)
        else:
            rows, gone = dirty
            rows = rows[self.index.used[rows]]
        counts = self.admission.counts
        return {"ids": self.index.row_key[rows], "weights": self.rows[rows],
                "state": {k: v[rows] for k, v in self.state.items()}, "last": self.last[rows],
                "uses": self.uses[rows], "evicted": gone, "counters": dict(self.counters), "applies": self.applies,
                "admission": None if counts is None else counts.copy()}

    def load(self, ids, weights, state: dict, last, uses) -> int:
        """Empty the shard (:meth:`reset`), then restore rows (a checkpoint's; ids distinct): as
        many as it holds, the rest evicted by the policy (``lru``: the oldest ``last`` first) and
        counted. Returns the number evicted. Local."""
        self.reset()
        ids = np.asarray(ids, np.int64)
        drop = max(0, ids.size - self.index.free)
        keep = np.arange(ids.size)
        if drop:
            first, second = (last, uses) if self.evict == "lru" else (uses, last)
            keep = np.sort(np.lexsort((ids, second, first))[drop:])
            self.counters["evictions"] += drop
        with self.changing():
            rows = self.index.insert(ids[keep])
            self.rows[rows] = weights[keep]
        for k, v in self.state.items():
            v[rows] = state[k][keep]
        self.last[rows], self.uses[rows] = last[keep], uses[keep]
        return drop
