"""Pulls by messages: a worker asks a PS on another node for rows, the PS answers from its serve loop.

Where a job's one-sided operations between nodes run over an emulation (Open MPI's ``osc/rdma``
over ``btl/tcp``, with no RDMA device: every contiguous piece of a ``Get`` is one active message,
so a pull of a few thousand scattered rows took 11 ms across pretend hosts), a pull goes as two
messages instead (``rma_read = "messages"``, :func:`hpcps.init`): the worker sends the owner the
shard rows it wants, the owner gathers them with numpy and sends them back. Same-node PS ranks are
still read from shared memory, and pushes still go one-sided (mailboxes and staged rows).

One :class:`PullServer` per context (made by it) serves every fixed table, on a communicator of
its own: a request is ``[table, half, tag, n]`` (int64) and ``n`` int64 shard rows; the reply is
the rows (float32, or the uint16 bit patterns of the 16-bit copy) on the request's own ``tag``, so
pulls in flight on several threads of a worker never take each other's reply.

Ordering: a worker waits for a pull's reply before its comm thread sends that step's push, so a
PS never answers a pull after an apply that the same pull, read one-sidedly, would have preceded:
the rows are those an RMA read at the same point of the step protocol gives.
"""

import itertools
import threading

import numpy as np
from mpi4py import MPI

from ..core.faults import track

__all__ = ["PullServer"]

_REQUEST = 1                    # a request's tag; replies use tags from _FIRST_REPLY on
_FIRST_REPLY, _REPLY_TAGS = 16, 1 << 14


class PullServer:
    """The message pulls of one context's fixed tables. Collective over the world (duplicates it)."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.comm = track(ctx.world.Dup())
        self._tables = {}                   # table number -> table (every rank numbers them alike)
        self._numbers = itertools.count()
        self._tags = itertools.count()      # worker: the reply tag of its next request
        self._sends = []                    # (request, buffer) still in flight: a buffer lives until its send is done
        self._lock = threading.Lock()       # worker: the comm thread and the main thread both send
        if ctx.is_ps:
            ctx.add_service_hook(self.serve, "serve")

    def register(self, table) -> int:
        """A table made on every rank, in the same order: its number in requests. Local."""
        number = next(self._numbers)
        self._tables[number] = table
        return number

    def forget(self, number: int) -> None:
        """A freed table. Local."""
        self._tables.pop(number, None)

    # ------------------------------------------------------------ worker side
    def request(self, table, p: int, rows: np.ndarray, half: bool) -> tuple:
        """Worker: ask PS ``p`` for its shard rows ``rows`` of ``table`` (its 16-bit copy when
        ``half``). Returns ``(receive request, buffer)``: the rows are in the buffer once the
        request completed. Local (two messages; the PS answers from its serve loop)."""
        rank = self.ctx.ps_world_ranks[p]
        tag = _FIRST_REPLY + next(self._tags) % _REPLY_TAGS
        buf = np.empty((rows.size, table.dim), np.uint16 if half else np.float32)
        recv = self.comm.Irecv(buf, source=rank, tag=tag)
        head = np.array([table.pull_number, int(half), tag, rows.size], np.int64)
        msg = np.concatenate([head, np.asarray(rows, np.int64)])
        send = self.comm.Isend(msg, dest=rank, tag=_REQUEST)
        self.ctx.control.ring(rank)         # a PS asleep on its doorbell looks now
        with self._lock:
            self._sends.append((send, msg))
            self._prune()
        return recv, buf

    # ------------------------------------------------------------ PS side
    def serve(self) -> bool:
        """PS (a service hook): answer every request that has arrived. Local."""
        if self.comm == MPI.COMM_NULL:         # freed (finalize frees it before a dynamic table)
            return False
        worked = False
        status = MPI.Status()
        while self.comm.Iprobe(MPI.ANY_SOURCE, _REQUEST, status):
            raw = np.empty(status.Get_count(MPI.INT64_T), np.int64)
            src = status.Get_source()
            self.comm.Recv(raw, source=src, tag=_REQUEST)
            number, half, tag, n = (int(x) for x in raw[:4])
            table = self._tables[number]
            if half:
                shard = table.half.local()
            else:
                table.rows.sync()           # pushes other ranks accumulated into it are seen
                shard = table.shard()
            reply = np.take(shard, raw[4:4 + n], axis=0)
            send = self.comm.Isend(reply, dest=src, tag=tag)
            with self._lock:
                self._sends.append((send, reply))
            worked = True
        with self._lock:
            self._prune()
        return worked

    def _prune(self) -> None:
        """Drop the sends that completed (their buffers with them); under ``_lock``. Local."""
        self._sends = [s for s in self._sends if not s[0].Test()]

    def free(self) -> None:
        """Collective over the world (the context frees it at ``finalize``, after its tables);
        safe twice."""
        if self.comm == MPI.COMM_NULL:
            return
        with self._lock:
            MPI.Request.Waitall([r for r, _ in self._sends])
            self._sends = []
        self.comm.Free()
