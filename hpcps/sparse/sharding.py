"""Row placement of a sparse table over PS ranks. Pure: imports no MPI.

A sharding maps a global row id to ``(owner, local_row)``: ``owner`` is the
PS index (0..num_ps-1) holding the row and ``local_row`` its row inside that
PS's shard. The default is row-wise modulo, which spreads Zipf-hot low ids
evenly. Another scheme plugs in by implementing the same four methods.
"""

from dataclasses import dataclass

import numpy as np

__all__ = ["ModuloSharding", "logical_tables"]


def logical_tables(name: str, num_rows: int, segments=None) -> list:
    """A table's logical tables as ``[(name, first row, rows)]``: its ``segments`` (``[(name, rows),
    ...]``) back to back, as a table-batched table holds them, or else the table itself. Local."""
    out, start = [], 0
    for seg, rows in segments or ((name, num_rows),):
        out.append((seg, start, int(rows)))
        start += int(rows)
    return out


@dataclass(frozen=True)
class ModuloSharding:
    """``owner = id % num_ps``, ``local_row = id // num_ps``."""

    num_rows: int
    num_ps: int

    name = "modulo"

    def __post_init__(self):
        if self.num_rows < 1 or self.num_ps < 1:
            raise ValueError(f"num_rows and num_ps must be >= 1, got {self.num_rows}, {self.num_ps}")

    def owner(self, ids: np.ndarray) -> np.ndarray:
        """PS index owning each id (array of int64). Local."""
        return np.asarray(ids, dtype=np.int64) % self.num_ps

    def local_row(self, ids: np.ndarray) -> np.ndarray:
        """Row of each id inside its owner's shard. Local."""
        return np.asarray(ids, dtype=np.int64) // self.num_ps

    def shard_rows(self, ps: int) -> int:
        """Number of rows PS ``ps`` holds. Local."""
        if not 0 <= ps < self.num_ps:
            raise ValueError(f"ps index {ps} out of range for num_ps={self.num_ps}")
        return (self.num_rows - ps + self.num_ps - 1) // self.num_ps

    def global_ids(self, ps: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Global ids of local rows ``start:stop`` of PS ``ps``. Local."""
        n = self.shard_rows(ps)
        stop = n if stop is None else min(stop, n)
        return np.arange(start, stop, dtype=np.int64) * self.num_ps + ps
