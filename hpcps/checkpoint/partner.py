"""Partner copies: each PS's shard file of a node-local checkpoint, copied over MPI to a PS on
another host, so a host lost with its local disk can be rebuilt from the others.

The partner of PS ``p`` is the first PS after it (in PS order, wrapping) on another host; every
PS computes the same map from the node layout, so it knows whom it sends to and whom it receives
from. A file travels as a head (step, shard, bytes, checksum) and pieces of at most 1 GiB, over
the world communicator with tags of their own, driven by the PS's serve loop (non-blocking:
the PS keeps applying while they travel); the receiver checks the hash and writes the file.
"""

import numpy as np
from mpi4py import MPI

from .local import sidecar, write_bytes
from .shards import Background, shard_file

__all__ = ["partner_map", "Partners", "send_file", "recv_file", "TAG"]

TAG = 0x6870              # heads; pieces: TAG + 1
PIECE = 1 << 30
_HEAD = 3 * 8 + 80        # step, shard, bytes (int64), then "<algo>:<hex digest>" (local.tagged)


def partner_map(ps_nodes) -> list:
    """``ps_nodes[p]``: the node of PS ``p``; the partner of each PS (None: every PS is on its node)."""
    P = len(ps_nodes)
    return [next(((p + k) % P for k in range(1, P) if ps_nodes[(p + k) % P] != ps_nodes[p]), None)
            for p in range(P)]


def _head(step: int, shard: int, nbytes: int, digest: str) -> np.ndarray:
    head = np.zeros(_HEAD, np.uint8)
    head[:24] = np.array([step, shard, nbytes], np.int64).view(np.uint8)
    head[24:] = np.frombuffer(digest.encode().ljust(_HEAD - 24), np.uint8)
    return head


def _parse(head: np.ndarray):
    step, shard, nbytes = (int(x) for x in head[:24].view(np.int64))
    return step, shard, nbytes, bytes(head[24:]).decode().strip()


def send_file(comm, dest: int, step: int, shard: int, path, digest: str) -> list:
    """Start sending file ``path`` to world rank ``dest``; returns the requests and buffers to
    keep until they complete. Local (point to point)."""
    data = np.fromfile(path, np.uint8)
    head = _head(step, shard, data.size, digest)
    reqs = [comm.Isend([head, MPI.BYTE], dest, TAG)]
    reqs += [comm.Isend([data[i:i + PIECE], MPI.BYTE], dest, TAG + 1) for i in range(0, data.size, PIECE)]
    return [reqs, head, data]


def recv_file(comm, source: int):
    """Receive a file :func:`send_file` sent: ``(step, shard, bytes, digest)``. Blocking. Local."""
    head = np.empty(_HEAD, np.uint8)
    comm.Recv([head, MPI.BYTE], source, TAG)
    step, shard, nbytes, digest = _parse(head)
    data = np.empty(nbytes, np.uint8)
    for i in range(0, nbytes, PIECE):
        comm.Recv([data[i:i + PIECE], MPI.BYTE], source, TAG + 1)
    return step, shard, data, digest


class Partners:
    """One PS's partner copies of one local checkpoint at a time. Local to a PS; its sends and
    receives pair with the other PS ranks' (each posts what the shared map says)."""

    def __init__(self, ctx, file_mode: int):
        self.comm, self.file_mode = ctx.world, file_mode
        ps_nodes = [ctx.node_of_rank[r] for r in ctx.ps_world_ranks]
        pmap = partner_map(ps_nodes)
        me = ctx.ps_rank
        self.ps_world_ranks = ctx.ps_world_ranks
        self.partner = pmap[me]
        self.sources = [p for p, q in enumerate(pmap) if q == me]
        self._sending = None
        self._heads = {}          # source PS -> (head buffer, request) until its head arrives
        self._pieces = {}         # source PS -> (head fields, data, requests)
        self._writers = []
        self.received = []        # shards written into this checkpoint's part
        self.error = None

    def start(self, step: int, tmp) -> None:
        """A local checkpoint at ``step`` begins: post the receives of the partner copies, written
        into part directory ``tmp``."""
        self.step, self.tmp, self.received, self.error = step, tmp, [], None
        for p in self.sources:
            head = np.empty(_HEAD, np.uint8)
            self._heads[p] = (head, self.comm.Irecv([head, MPI.BYTE], self.ps_world_ranks[p], TAG))

    def send(self, shard: int, path) -> None:
        """This PS's own file is written: send it (with its checksum) to the partner, if any."""
        if self.partner is None:
            return
        digest = sidecar(path)
        self._sending = send_file(self.comm, self.ps_world_ranks[self.partner], self.step, shard, path, digest)

    def progress(self) -> bool:
        """Move the transfers on; True once every send completed and every received file is
        written (``error`` set if one failed)."""
        if self._sending is not None and MPI.Request.Testall(self._sending[0]):
            self._sending = None
        for p, (head, req) in list(self._heads.items()):
            if req.Test():
                del self._heads[p]
                step, shard, nbytes, digest = _parse(head)
                data = np.empty(nbytes, np.uint8)
                src = self.ps_world_ranks[p]
                reqs = [self.comm.Irecv([data[i:i + PIECE], MPI.BYTE], src, TAG + 1) for i in range(0, nbytes, PIECE)]
                self._pieces[p] = ((step, shard, digest), data, reqs)
        for p, ((step, shard, digest), data, reqs) in list(self._pieces.items()):
            if MPI.Request.Testall(reqs):
                del self._pieces[p]
                if step != self.step:        # never file one step's copy under another's part
                    self.error = OSError(f"the partner copy of shard {shard} is of step {step}, expected "
                                         f"step {self.step}")
                    continue
                self._writers.append(Background(write_bytes, self.tmp / shard_file(shard), data, digest,
                                                self.file_mode))
                self.received.append(shard)
        if any(w.is_alive() for w in self._writers):
            return False
        for w in self._writers:
            if w.error is not None:
                self.error = w.error
        if self._heads or self._pieces or self._sending is not None:
            return False
        self._writers = []
        return True
