"""Row placement of a sparse table over PS ranks. Pure: imports no MPI.

A sharding maps a global row id to ``(owner, local_row)``: ``owner`` is the
PS index (0..num_ps-1) holding the row and ``local_row`` its row inside that
PS's shard. Every pull, push, initial fill, checkpoint and restore goes
through it, so a checkpoint written under one placement restores under
another (rows are matched by global id).

A placement is an object with ``num_rows``, ``num_ps``, ``name`` and the
methods of :class:`ModuloSharding` (``place``, ``owner``, ``local_row``,
``shard_rows``, ``global_ids``), and must keep two promises the fast paths rely
on: ids of one owner keep their order (sorted ids give sorted local rows), and
with one PS a row's local row is its id.

- :class:`ModuloSharding` (default): ``owner = id % P``, spreads Zipf-hot low ids evenly.
- :class:`RangeSharding`: contiguous ranges, ``owner = id // ceil(num_rows / P)``.
"""

from dataclasses import dataclass

import numpy as np

from .settings import SHARDINGS

__all__ = ["ModuloSharding", "RangeSharding", "make_sharding", "logical_tables"]


def logical_tables(name: str, num_rows: int, segments=None) -> list:
    """A table's logical tables as ``[(name, first row, rows)]``: its ``segments`` (``[(name, rows),
    ...]``) back to back, as a table-batched table holds them, or else the table itself. Local."""
    out, start = [], 0
    for seg, rows in segments or ((name, num_rows),):
        out.append((seg, start, int(rows)))
        start += int(rows)
    return out


@dataclass(frozen=True)
class _Sharding:
    num_rows: int
    num_ps: int

    name = "?"

    def __post_init__(self):
        if self.num_rows < 1 or self.num_ps < 1:
            raise ValueError(f"num_rows and num_ps must be >= 1, got {self.num_rows}, {self.num_ps}")

    def owner(self, ids: np.ndarray) -> np.ndarray:
        """PS index owning each id (array of int64). Local."""
        return self.place(ids)[0]

    def local_row(self, ids: np.ndarray) -> np.ndarray:
        """Row of each id inside its owner's shard. Local."""
        return self.place(ids)[1]

    def ids_of(self, ps: int, rows: np.ndarray) -> np.ndarray:
        """Global ids of PS ``ps``'s local ``rows`` (a few, out of a large shard). Local."""
        return self.global_ids(ps)[rows]

    def in_order(self, ps: int, ids: np.ndarray) -> bool:
        """Whether ``ids`` are all of PS ``ps``'s rows in its local order, checked at 4096 places
        and both ends (for a file of that very shard whose checksum passed: placing every id of a
        GB shard took a fifth of its restart). Local."""
        n = self.shard_rows(ps)
        if ids.size != n:
            return False
        at = np.linspace(0, n - 1, min(n, 4096)).astype(np.int64)     # rising: np.unique would import numpy.ma (0.1 s)
        at = at[np.r_[True, at[1:] != at[:-1]]]
        owner, local = self.place(np.asarray(ids[at], np.int64))
        return bool((owner == ps).all() and np.array_equal(local, at))

    def _check_ps(self, ps: int) -> None:
        if not 0 <= ps < self.num_ps:
            raise ValueError(f"ps index {ps} out of range for num_ps={self.num_ps}")


@dataclass(frozen=True)
class ModuloSharding(_Sharding):
    """``owner = id % num_ps``, ``local_row = id // num_ps``."""

    name = "modulo"

    def place(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(owner, local_row)`` of each id (int64 arrays), in one pass. Local."""
        local, owner = np.divmod(np.asarray(ids, dtype=np.int64), self.num_ps)
        return owner, local

    def owner(self, ids: np.ndarray) -> np.ndarray:
        return np.asarray(ids, dtype=np.int64) % self.num_ps

    def local_row(self, ids: np.ndarray) -> np.ndarray:
        return np.asarray(ids, dtype=np.int64) // self.num_ps

    def shard_rows(self, ps: int) -> int:
        """Number of rows PS ``ps`` holds. Local."""
        self._check_ps(ps)
        return (self.num_rows - ps + self.num_ps - 1) // self.num_ps

    def global_ids(self, ps: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Global ids of local rows ``start:stop`` of PS ``ps``, ascending. Local."""
        n = self.shard_rows(ps)
        stop = n if stop is None else min(stop, n)
        return np.arange(start, stop, dtype=np.int64) * self.num_ps + ps

    def ids_of(self, ps: int, rows: np.ndarray) -> np.ndarray:
        return np.asarray(rows, np.int64) * self.num_ps + ps


@dataclass(frozen=True)
class RangeSharding(_Sharding):
    """Contiguous ranges: PS ``p`` holds ids ``[p * span, (p + 1) * span)`` with
    ``span = ceil(num_rows / num_ps)`` (the last PS may hold fewer, or none)."""

    name = "range"

    @property
    def span(self) -> int:
        return -(-self.num_rows // self.num_ps)

    def place(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        owner, local = np.divmod(np.asarray(ids, dtype=np.int64), self.span)
        return owner, local

    def shard_rows(self, ps: int) -> int:
        self._check_ps(ps)
        return max(0, min(self.num_rows, (ps + 1) * self.span) - ps * self.span)

    def global_ids(self, ps: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        n = self.shard_rows(ps)
        stop = n if stop is None else min(stop, n)
        return np.arange(start, max(start, stop), dtype=np.int64) + ps * self.span

    def ids_of(self, ps: int, rows: np.ndarray) -> np.ndarray:
        return np.asarray(rows, np.int64) + ps * self.span


_BY_NAME = {"modulo": ModuloSharding, "range": RangeSharding}
assert tuple(_BY_NAME) == SHARDINGS


def make_sharding(sharding, num_rows: int, num_ps: int):
    """The placement of a table: ``sharding`` is None (modulo), a name from
    ``hpcps.core.settings.SHARDINGS``, or a placement object for exactly ``num_rows`` rows over
    ``num_ps`` PS ranks. ``ValueError`` otherwise. Local."""
    if sharding is None:
        sharding = "modulo"
    if isinstance(sharding, str):
        if sharding not in _BY_NAME:
            raise ValueError(f"sharding must be one of {SHARDINGS} or a placement object, got {sharding!r}")
        return _BY_NAME[sharding](num_rows, num_ps)
    missing = [m for m in ("place", "owner", "local_row", "shard_rows", "global_ids", "name") if not hasattr(sharding, m)]
    if missing:
        raise ValueError(f"sharding {sharding!r} lacks {missing}")
    if (getattr(sharding, "num_rows", None), getattr(sharding, "num_ps", None)) != (num_rows, num_ps):
        raise ValueError(f"sharding {sharding!r} is for {getattr(sharding, 'num_rows', None)} rows over "
                         f"{getattr(sharding, 'num_ps', None)} PS, the table has {num_rows} rows over {num_ps} PS")
    return sharding
