"""An open-addressing hash index from any int64 id to a row of a PS's shard of a dynamic table,
vectorized over a step's ids (the PS-side core of dynamic embedding tables, issue 26).

Where an id lives is a pure function of the id: :func:`owner_of` picks its PS (``splitmix64(id)
mod num_ps``, the same in every run and for every id, so a checkpoint reshards to any PS count),
and :func:`bucket_of` its first bucket on that PS (a second hash, salted). No
table size bounds the ids: negative ones and ones at or above 2**62 are ids like any other.

Layout (every array may be a view of window memory, for readers on the same host): ``2**k``
buckets, at least twice the row capacity, each a key and a row side by side (``EMPTY``,
``GONE``: a removed entry whose probe chain goes on, or the row); linear probing; per row its key; a stack of free
rows. Removed entries are swept by a rebuild once live and removed ones fill 3/4 of the buckets.
Only the owner writes (inserts, removals, rebuilds). No MPI here: every function is local.
"""

import numpy as np

from .ids import splitmix64

__all__ = ["HashIndex", "owner_of", "bucket_of", "bucket_count", "probe", "EMPTY", "GONE"]

EMPTY, GONE = -1, -2
_SALT = np.uint64(0x2545F4914F6CDD1D)     # bucket hash: not the owner's
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)   # 2**64 / the golden ratio (Fibonacci hashing)


def _u64(ids) -> np.ndarray:
    ids = np.asarray(ids)
    if ids.dtype != np.int64:
        raise TypeError(f"ids must be int64, got {ids.dtype}")
    return ids.reshape(-1).view(np.uint64)


def owner_of(ids, num_ps: int) -> np.ndarray:
    """The PS that owns each int64 id: ``splitmix64(id) % num_ps`` (int64). Local."""
    if num_ps < 1:
        raise ValueError(f"num_ps must be >= 1, got {num_ps}")
    return (splitmix64(_u64(ids)) % np.uint64(num_ps)).astype(np.int64)


def bucket_of(ids, mask: int) -> np.ndarray:
    """Each id's first bucket in a table of ``mask + 1`` (a power of 2, at least 2) buckets
    (int64): the top bits of a multiplicative hash of the salted id, its high half folded into
    the low one first (ids that differ only in high bits spread too). 2-3x cheaper than
    :func:`owner_of`'s splitmix64, and as even on random, sequential and strided ids. Local."""
    x = _u64(ids) ^ _SALT
    x = x ^ (x >> np.uint64(32))
    with np.errstate(over="ignore"):
        x = x * _GOLDEN
    return (x >> np.uint64(64 - int(mask).bit_length())).view(np.int64)


def bucket_count(capacity: int) -> int:
    """Buckets of the index of a shard of ``capacity`` rows: a power of 2, at least twice it. Local."""
    return max(8, 1 << (2 * int(capacity) - 1).bit_length())


_WIDE = np.arange(8)


def probe(buckets: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, buckets)`` of int64 ``ids`` (repeats allowed) in the ``(n, 2)`` bucket array
    ``buckets`` (-1 where absent): what :meth:`HashIndex.find` does, on any copy or mapping of an
    index's buckets (a worker reads a PS's from shared memory). Every id's first bucket in one
    pass; the few ids whose chain goes on, 8 buckets a pass (1.5x faster than a bucket a pass for
    4096 ids of a 1M-id index, where the longest chains are ~8 buckets). Local."""
    mask = buckets.shape[0] - 1
    pos = bucket_of(ids, mask)
    kv = np.take(buckets, pos, axis=0)             # (b[p] gathers 2-D rows ~7x slower)
    s = kv[:, 1]
    hit = (s >= 0) & (kv[:, 0] == ids)
    rows, where = np.where(hit, s, -1), np.where(hit, pos, -1)
    todo = np.flatnonzero(~hit & (s != EMPTY))     # an empty bucket ends a miss's chain
    start = 1
    while todo.size:
        at = ((pos[todo, None] + start + _WIDE) & mask).reshape(-1)
        kv = np.take(buckets, at, axis=0)
        s = kv[:, 1]
        live = (kv[:, 0] == np.repeat(ids[todo], _WIDE.size)) & (s >= 0)
        h = np.flatnonzero(live)                   # live keys are distinct: a match is the id's entry
        got = todo[h // _WIDE.size]
        rows[got], where[got] = s[h], at[h]
        done = (s == EMPTY).reshape(-1, _WIDE.size).view(np.uint64).ravel() != 0   # its chain ended
        done[h // _WIDE.size] = True
        todo = todo[~done]
        start += _WIDE.size
    return rows, where


class HashIndex:
    """Ids to rows ``[0, capacity)`` of one PS's shard. ``find`` looks ids up, ``insert`` adds
    absent ones (taking free rows), ``remove`` drops rows. Local (the owning PS writes; readers
    of the same arrays must not race a write)."""

    def __init__(self, capacity: int, buckets: int | None = None, storage: np.ndarray | None = None):
        if int(capacity) < 1:
            raise ValueError(f"capacity must be >= 1 row, got {capacity}")
        self.capacity = int(capacity)
        n = storage.shape[0] if storage is not None else buckets or bucket_count(self.capacity)
        if n & (n - 1) or n < 2 * self.capacity:
            raise ValueError(f"buckets must be a power of 2 and >= 2 x capacity, got {n} for {capacity}")
        self.mask = n - 1
        # a bucket's key and row side by side: a probe reads one cache line, not two. ``storage``:
        # an (n, 2) int64 array to keep them in (window memory that same-host workers read)
        self.buckets = storage if storage is not None else np.zeros((n, 2), np.int64)
        self.buckets[:, 1] = EMPTY
        self.keys, self.slot = self.buckets[:, 0], self.buckets[:, 1]
        self.row_key = np.zeros(self.capacity, np.int64)
        self.used = np.zeros(self.capacity, bool)       # rows holding an id
        self._free = np.arange(self.capacity - 1, -1, -1, dtype=np.int64)    # a stack: row 0 first
        self._nfree = self.capacity
        self.size = 0                   # live entries
        self.gone = 0                   # removed entries not yet swept

    @property
    def free(self) -> int:
        """Rows not holding an id. Local."""
        return self._nfree

    def _probe(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(rows, buckets)`` of ``ids`` (-1 where absent)."""
        return probe(self.buckets, ids)

    def find(self, ids) -> np.ndarray:
        """The row of each id, -1 where absent (int64). Local."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        _u64(ids)
        return self._probe(ids)[0]

    def insert(self, ids) -> np.ndarray:
        """Add ``ids`` (distinct, none present: :meth:`find` them first), each in a free row;
        returns their rows. Raises ``ValueError`` when fewer rows are free. Local."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        if ids.size > self._nfree:
            raise ValueError(f"{ids.size} new ids, {self._nfree} free rows of {self.capacity}")
        if ids.size == 0:
            return np.zeros(0, np.int64)
        if self.size + self.gone + ids.size > (self.mask + 1) * 3 // 4:
            self._rebuild()
        rows = self._free[self._nfree - ids.size:self._nfree][::-1].copy()
        self._nfree -= ids.size
        pos = bucket_of(ids, self.mask)
        todo = np.arange(ids.size)
        while todo.size:
            p = pos[todo]
            open_ = self.slot[p] < 0                   # empty, or a removed entry's bucket
            cand = todo[open_]
            if cand.size:
                _, first = np.unique(pos[cand], return_index=True)   # one id a bucket a round
                win = cand[first]
                b = pos[win]
                self.gone -= int(np.count_nonzero(self.slot[b] == GONE))
                self.keys[b], self.slot[b] = ids[win], rows[win]
                placed = np.zeros(ids.size, bool)
                placed[win] = True
                todo = todo[~placed[todo]]
            pos[todo] = (pos[todo] + 1) & self.mask
        self.row_key[rows] = ids
        self.used[rows] = True
        self.size += ids.size
        return rows

    def remove(self, rows) -> None:
        """Drop the ids held in ``rows`` (distinct live rows); the rows are free again. Local."""
        rows = np.asarray(rows, np.int64).reshape(-1)
        if rows.size == 0:
            return
        got, where = self._probe(self.row_key[rows])
        if (got != rows).any():
            raise ValueError("remove(): a row that holds no id")
        self.slot[where] = GONE
        self.used[rows] = False
        self.gone += rows.size
        self.size -= rows.size
        self._free[self._nfree:self._nfree + rows.size] = rows
        self._nfree += rows.size

    def live(self) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, rows)`` of every live entry, in row order. Local."""
        rows = np.flatnonzero(self.used)
        return self.row_key[rows], rows

    def _rebuild(self) -> None:
        """Sweep removed entries: every live one placed again from its first bucket."""
        ids, rows = self.live()
        self.slot[:] = EMPTY
        self.gone = 0
        pos = bucket_of(ids, self.mask)
        todo = np.arange(ids.size)
        while todo.size:
            p = pos[todo]
            cand = todo[self.slot[p] == EMPTY]
            _, first = np.unique(pos[cand], return_index=True)
            win = cand[first]
            self.keys[pos[win]], self.slot[pos[win]] = ids[win], rows[win]
            placed = np.zeros(ids.size, bool)
            placed[win] = True
            todo = todo[~placed[todo]]
            pos[todo] = (pos[todo] + 1) & self.mask
