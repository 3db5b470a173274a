"""16-bit rows and gradients: the codec, the PS's 16-bit copy of its rows, and the push inbox.

``pull_dtype`` bfloat16/float16: the PS keeps a 16-bit copy of its rows (rounded to
nearest even) next to the float32 ones, refreshed whenever it applies an update;
pulls read that copy (:class:`HalfCopy`). ``push_dtype`` bfloat16/float16: a
worker rounds each row's summed gradient to 16 bits; to a PS on another node the
rows travel in 16 bits into its push inbox (:class:`PushInbox`, ``MPI_Put``: MPI
has no usable 16-bit float sum), which the PS drains and widens before it applies.
"""

import numpy as np
from mpi4py import MPI

from ..core.window import Window

__all__ = ["narrow", "widen", "HalfCopy", "PushInbox", "PUSH_INBOX_ROWS"]

# push inbox (16-bit push_dtype, remote PS): up to this many rows a PS has not drained yet; a push
# that would overflow it goes as float32 by MPI_Accumulate (the same rounded values, twice the bytes)
PUSH_INBOX_ROWS = 1 << 16
_CHUNK_ROWS = 1 << 14

_torch = None


def torch_module():
    """torch, imported on first use (PS ranks of SGD tables never need it). Local."""
    global _torch
    if _torch is None:
        import torch
        _torch = torch
    return _torch


def narrow(rows: np.ndarray, dtype: str) -> np.ndarray:
    """float32 ``rows`` rounded to nearest (even) ``dtype`` ("bfloat16" or "float16"), by torch, as
    their uint16 bit patterns (numpy's float16 cast rounds the same but took 10x as long). Local."""
    torch = torch_module()
    half = torch.from_numpy(np.ascontiguousarray(rows)).to(getattr(torch, dtype))
    return half.view(torch.int16).numpy().view(np.uint16)


def widen(half: np.ndarray, dtype: str) -> np.ndarray:
    """:func:`narrow`'s bit patterns back to float32 (exact). Local."""
    torch = torch_module()
    bits = torch.from_numpy(np.ascontiguousarray(half).view(np.int16))
    return bits.view(getattr(torch, dtype)).to(torch.float32).numpy()


class HalfCopy:
    """The PS's 16-bit copy of its shard. Collective over the world (allocates a window)."""

    def __init__(self, ctx, local_rows: int, dim: int, dtype: str, what: str):
        self.dtype, self.dim = dtype, dim
        self.window = Window(ctx.world, local_rows * dim * 2, what=f"{what} {dtype} copy")
        self.rowtype = MPI.UINT16_T.Create_contiguous(dim).Commit()
        self.views = [None] * ctx.num_ps          # worker: each PS's copy on this node

    def map(self, ranks, sizes) -> None:
        """Worker: map the copies of the PS ranks in ``ranks`` (None: not on this node). Local."""
        self.views = self.window.map_shared(ranks, sizes, np.uint16, self.dim)

    def refresh(self, shard: np.ndarray, rows: np.ndarray | None = None) -> None:
        """PS: copy ``rows`` of the float32 ``shard`` (all when None) into the 16-bit copy. Local."""
        half = self.window.local(np.uint16).reshape(-1, self.dim)
        if rows is None:
            for start in range(0, shard.shape[0], _CHUNK_ROWS):
                half[start:start + _CHUNK_ROWS] = narrow(shard[start:start + _CHUNK_ROWS], self.dtype)
        elif rows.size:
            half[rows] = narrow(shard[rows], self.dtype)
        self.window.sync()

    def free(self) -> None:
        """Collective over the world; safe twice."""
        if self.window.freed:
            return
        self.views = [None] * len(self.views)
        self.rowtype.Free()
        self.window.free()


class PushInbox:
    """A PS's inbox of 16-bit pushes from other nodes. Collective over the world (allocates a window).

    Layout: int64 rows waiting, then int64 rows[cap], then uint16 grads[cap, dim].
    """

    def __init__(self, ctx, local_rows: int, dim: int, dtype: str, what: str):
        self.dtype, self.dim = dtype, dim
        # a step of sync pushes fits when each worker's rows fit in the shard
        self.cap = min(ctx.num_workers * local_rows, PUSH_INBOX_ROWS) if ctx.is_ps else 0
        cap = ctx.world.allgather(self.cap)
        self.caps = [cap[r] for r in ctx.ps_world_ranks]
        nbytes = 8 + 8 * self.cap + -(-self.cap * 2 * dim // 8) * 8 if ctx.is_ps else 0
        self.window = Window(ctx.world, nbytes, what=f"{what} {dtype} push inbox")
        if ctx.is_ps:
            self.window.local(np.int64)[:1] = 0
            self.window.sync()

    @property
    def nbytes(self) -> int:
        return self.window.nbytes

    def put(self, p: int, rank: int, uniq: np.ndarray, half: np.ndarray) -> bool:
        """Worker holding PS ``p``'s shard lock: append rows ``uniq`` and their 16-bit gradients to
        its inbox, complete on return; False, and nothing written, when they do not fit. Local."""
        win, cap, k = self.window.win, self.caps[p], uniq.size
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

    def drain(self):
        """PS holding its own shard lock: the waiting ``(rows, float32 grads)`` (rows may repeat),
        and the inbox emptied; None when empty. Local."""
        self.window.sync()
        head = self.window.local(np.int64)
        k = int(head[0])
        if k == 0:
            return None
        cap, dim = self.cap, self.dim
        rows = head[1:1 + k].copy()
        half = self.window.local(np.uint16)[(8 + 8 * cap) // 2:][:cap * dim].reshape(cap, dim)[:k]
        grads = widen(half, self.dtype)
        head[0] = 0
        self.window.sync()
        return rows, grads

    def free(self) -> None:
        """Collective over the world; safe twice."""
        self.window.free()
