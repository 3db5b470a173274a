"""16-bit rows and gradients: the codec and the PS's 16-bit copy of its rows.

``pull_dtype`` bfloat16/float16: the PS keeps a 16-bit copy of its rows (rounded to
nearest even) next to the float32 ones, refreshed whenever it applies an update;
pulls read that copy (:class:`HalfCopy`). ``push_dtype`` bfloat16/float16: a
worker rounds each row's summed gradient to 16 bits; to a PS on another node the
rows travel in 16 bits into its push mailbox (:mod:`hpcps.sparse.mailbox`, ``MPI_Put``:
MPI has no usable 16-bit float sum), which the PS drains and widens before it applies.
"""

import numpy as np
from mpi4py import MPI

from ..core.torchlib import torch_module
from ..core.window import Window

__all__ = ["narrow", "widen", "HalfCopy"]
_CHUNK_ROWS = 1 << 14

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

    def local(self) -> np.ndarray:
        """PS: its 16-bit copy as a writable ``(shard_rows, dim)`` uint16 view (bit patterns). Local."""
        return self.window.local(np.uint16).reshape(-1, self.dim)

    def refresh(self, shard: np.ndarray, rows: np.ndarray | None = None) -> None:
        """PS: copy ``rows`` of the float32 ``shard`` (all when None) into the 16-bit copy. Local."""
        half = self.local()
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
