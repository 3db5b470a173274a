"""A PS shard's snapshot copied a chunk at a time between the PS's applies (copy on write).

A checkpoint's cut must see the rows as they were after step ``t - 1``'s apply. Copying a large
shard and its optimizer state at once stops the PS for as long (~0.3 s a GB here), and in sync
mode every worker waits for that PS's next apply. Where only the PS's apply changes rows
(deterministic sync mode: workers' pushes wait in the mailboxes), the copy can go on while
training does: the PS copies the next chunk of rows whenever its serve loop polls, and before
an apply changes rows not copied yet it copies those rows first. Chunks are copied in order, so
"not copied yet" is "at or past the next chunk, and not saved ahead".
"""

import numpy as np

__all__ = ["ChunkedSnapshot", "CHUNK_ROWS"]

CHUNK_ROWS = 1 << 16


class ChunkedSnapshot:
    """The snapshot of one table's shard in progress. Local to the PS that owns it.

    ``sources``: name -> the live array (rows first); ``fixed``: the parts of the snapshot taken
    at once (ids, applies, version stamps). :meth:`result` gives what ``EmbeddingTable.snapshot``
    gives."""

    def __init__(self, sources: dict, fixed: dict, state_keys: dict):
        self.sources, self.fixed, self.state_keys = sources, fixed, state_keys
        self.rows = next(iter(sources.values())).shape[0]
        self.out = {k: np.empty(v.shape, np.uint8 if v.dtype == np.bool_ else v.dtype) for k, v in sources.items()}
        self.saved = np.zeros(self.rows, bool)
        self.next = 0

    @property
    def done(self) -> bool:
        return self.next >= self.rows

    def before_apply(self, rows: np.ndarray) -> None:
        """``rows`` (local) are about to change: copy those not copied yet."""
        if self.done:
            return
        todo = rows[rows >= self.next]
        todo = todo[~self.saved[todo]]
        if todo.size:
            for k, src in self.sources.items():
                self.out[k][todo] = src[todo]
            self.saved[todo] = True

    def step(self, chunks: int = 1) -> bool:
        """Copy the next ``chunks`` chunks (rows saved ahead are kept); True once all are copied."""
        for _ in range(chunks):
            if self.done:
                break
            lo, hi = self.next, min(self.rows, self.next + CHUNK_ROWS)
            keep = ~self.saved[lo:hi]
            whole = bool(keep.all())
            for k, src in self.sources.items():
                if whole:
                    self.out[k][lo:hi] = src[lo:hi]
                else:
                    dst = self.out[k][lo:hi]
                    dst[keep] = src[lo:hi][keep]
            self.next = hi
        return self.done

    def result(self) -> dict:
        """The snapshot (once :attr:`done`): ``{"ids", "weights", "state", "applies"[, "versions"]}``."""
        state = {name: self.out[k] for k, name in self.state_keys.items()}
        return {**self.fixed, "weights": self.out["weights"], "state": state}
