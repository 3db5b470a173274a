"""All-reduce backends for DenseSync: shared memory, MPI and gloo (CPU tensors), NCCL (CUDA tensors).

Each backend takes a flat tensor and starts a non-blocking in-place SUM over
the worker ranks, returning an object with ``test()`` and ``wait()``.
``prepare(flats)`` (collective) tells it, once, the flat tensors it will be given.
"""

import logging
import os
import socket
import time

import numpy as np
from mpi4py import MPI

from ..core import counts
from ..core import wait as _wait
from ..core.wait import wait_request
from ..core.errors import HpcpsError

__all__ = ["MPIBackend", "NCCLBackend", "GlooBackend", "ShmBackend", "make_backend", "SHM_MAX_BYTES"]

SHM_MAX_BYTES = 256 << 20     # "auto" picks the shared-memory backend up to this footprint per node

logger = logging.getLogger(__name__)


class _MPIWork:
    def __init__(self, req):
        self._req = req

    def test(self) -> bool:
        return self._req.Test()

    def wait(self) -> None:
        wait_request(self._req, "the dense all-reduce (mpi) of the other workers")  # MPI_Wait would spin


class MPIBackend:
    """``MPI_Iallreduce`` on the worker communicator; CPU tensors. Collective over ``comm``."""

    name = "mpi"

    def __init__(self, comm: MPI.Comm):
        self.comm = comm
        self.device = "cpu"

    def broadcast(self, tensor, root: int = 0) -> None:
        self.comm.Bcast(tensor.detach().numpy(), root=root)

    def prepare(self, flats) -> None:
        pass

    def allreduce_async(self, flat) -> _MPIWork:
        buf = flat.numpy()
        counts.allreduce(buf.nbytes)
        return _MPIWork(self.comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM))

    def close(self) -> None:
        pass


def _one_node(comm: MPI.Comm) -> bool:
    """Whether every rank of ``comm`` is on one node. Collective over ``comm``."""
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    together = local.Get_size() == comm.Get_size()
    local.Free()
    return together


class _ShmWork:
    def __init__(self, backend, b: int, target: int, flat, slots):
        self._backend, self._b, self._target, self._flat, self._slots = backend, b, target, flat, slots
        self._done = False

    def test(self) -> bool:
        return self._done or self._backend._count(self._b) >= self._target

    def wait(self) -> None:
        if self._done:
            return
        be, b = self._backend, self._b
        word = be._addr(b) if be._bells else None       # asleep until the last worker in rings
        misses, started = 0, time.monotonic()
        while (arrived := be._count(b)) < self._target:
            misses += 1
            _wait.pause(misses, word, arrived)
            _wait.overdue(started, misses, lambda: f"dense all-reduce (shm) of bucket {b}: worker rank(s) "
                                                   f"{be.missing(b, self._target // be.comm.Get_size())} of the "
                                                   f"worker communicator have not arrived")
        be._win.sync()                                 # the count before the slots it announces
        import torch
        torch.sum(self._slots, dim=0, out=self._flat)  # the same order on every worker: equal bits
        self._done = True


class ShmBackend:
    """All-reduce through a shared-memory window, for CPU tensors when every worker of ``comm``
    is on one node. Collective over ``comm`` (construction, :meth:`prepare`, :meth:`close`).

    Worker ``w`` copies bucket ``b`` into its slot (one of two, by the parity of the bucket's
    call count) and adds 1 to the bucket's arrival counter with an MPI atomic; once all ``W``
    arrived, each worker sums the ``W`` slots in worker order into its bucket, so every replica
    gets the same bits. Nothing waits for a rank to enter MPI: a worker that arrives early sleeps
    on the counter (a futex on an oversubscribed node, woken by the last to arrive; else it polls
    with yields), where ``MPI_Iallreduce`` progressed only while every rank polled it. A slot of
    one parity is written again two calls later, when every worker has read it (it arrived at
    the call in between after summing). Memory: ``2 x W`` copies of the buckets, on the node.
    """

    name = "shm"

    def __init__(self, comm: MPI.Comm):
        if not _one_node(comm):
            raise ValueError("dense backend 'shm' needs every worker on one node; use mpi")
        self.comm = comm
        self.device = "cpu"
        self._win = None
        self._bells = _wait.bells()

    def broadcast(self, tensor, root: int = 0) -> None:
        self.comm.Bcast(tensor.detach().numpy(), root=root)

    def prepare(self, flats) -> None:
        """Allocate the slots for ``flats`` (the buckets, in order). Collective over ``comm``."""
        import torch
        from ..core.window import Window
        for f in flats:
            if f.device.type != "cpu" or f.dtype not in (torch.float32, torch.float64):
                raise ValueError(f"dense backend 'shm' all-reduces float32/float64 CPU tensors, got "
                                 f"{f.dtype} on {f.device}")
        W, me = self.comm.Get_size(), self.comm.Get_rank()
        self._index, self._slots, self._calls = {}, [], []
        if not flats:                           # nothing to all-reduce: no window
            return
        # int64 words: an arrival counter per bucket, then per bucket and worker the calls it arrived at
        head = -(-8 * len(flats) * (1 + W) // 64) * 64
        offsets, nbytes = [], head
        for f in flats:
            offsets.append(nbytes)
            nbytes += 2 * W * f.numel() * f.element_size()
        self._win = Window(self.comm, nbytes if me == 0 else 0, what="dense all-reduce")
        mem = self._win.shared(0, np.uint8)
        if mem is None:
            raise HpcpsError("dense backend 'shm': this MPI cannot map the window's shared memory")
        if me == 0:
            mem[:head] = 0
        self._win.sync()
        self.comm.Barrier()
        self._words = mem[:head].view(np.int64)
        self._arrivals = self._words[len(flats):len(flats) * (1 + W)].reshape(len(flats), W)
        self._base = mem.ctypes.data
        self._calls = [0] * len(flats)
        for b, (f, off) in enumerate(zip(flats, offsets)):
            n = f.numel()
            arr = torch.from_numpy(mem[off:off + 2 * W * n * f.element_size()].view(f.numpy().dtype))
            self._slots.append(arr.view(2, W, n))
            self._index[f.data_ptr()] = b
        self._one = np.ones(1, np.int64)
        self._old = np.zeros(1, np.int64)

    def _count(self, b: int) -> int:
        self._win.sync()
        return int(self._words[b])

    def missing(self, b: int, calls: int) -> list[int]:
        """Ranks of ``comm`` that have not arrived at call ``calls`` of bucket ``b``. Local."""
        self._win.sync()
        return np.flatnonzero(self._arrivals[b] < calls).tolist()

    def _addr(self, b: int) -> int:
        return self._base + 8 * b

    def allreduce_async(self, flat) -> _ShmWork:
        b = self._index.get(flat.data_ptr())
        if b is None:
            raise ValueError("dense backend 'shm': allreduce_async of a tensor not given to prepare()")
        W, me = self.comm.Get_size(), self.comm.Get_rank()
        g = self._calls[b]
        self._calls[b] = g + 1
        slots = self._slots[b][g % 2]
        slots[me].copy_(flat)
        counts.allreduce(flat.numel() * flat.element_size())
        self._arrivals[b, me] = g + 1           # this worker's own word: who came, for a stall's report
        win = self._win.win
        self._win.sync()                        # the slot before the count that announces it
        win.Fetch_and_op(self._one, self._old, 0, 8 * b, MPI.SUM)
        win.Flush(0)
        target = W * (g + 1)
        if self._bells and int(self._old[0]) + 1 == target:
            _wait.futex_wake(self._addr(b), W)
        return _ShmWork(self, b, target, flat, slots)

    def close(self) -> None:
        if self._win is not None:
            self._win.free()
            self._win = None


class _TorchWork:
    def __init__(self, work):
        self._work = work

    def test(self) -> bool:
        return self._work.is_completed()

    def wait(self) -> None:
        self._work.wait()


def _torch_group(comm: MPI.Comm, backend: str, host: str | None, **init):
    """A ``torch.distributed`` process group of ``backend`` over the ranks of ``comm``, bootstrapped
    through MPI: rank 0 opens a ``TCPStore`` on a free port of ``host`` (default
    ``$HPCPS_NCCL_HOST``, else its hostname's address) and sends the address. Returns
    ``(torch.distributed, store)``. Collective over ``comm``."""
    import torch.distributed as dist
    rank, size = comm.Get_rank(), comm.Get_size()
    addr = None
    if rank == 0:
        host = host or os.environ.get("HPCPS_NCCL_HOST") or socket.gethostbyname(socket.gethostname())
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        addr = (host, port)
    host, port = comm.bcast(addr, root=0)
    try:
        store = dist.TCPStore(host, port, size, is_master=(rank == 0))
        if not dist.is_initialized():
            dist.init_process_group(backend, store=store, rank=rank, world_size=size, **init)
    except Exception as e:      # noqa: BLE001 - wrapped once at the boundary
        raise HpcpsError(f"{backend} bootstrap over MPI failed ({host}:{port}): {e}") from e
    return dist, store


class _TorchBackend:
    """All-reduces through a ``torch.distributed`` process group of the worker ranks."""

    def broadcast(self, tensor, root: int = 0) -> None:
        self._dist.broadcast(tensor.data, src=root)

    def prepare(self, flats) -> None:
        pass

    def allreduce_async(self, flat) -> _TorchWork:
        counts.allreduce(flat.numel() * flat.element_size())
        return _TorchWork(self._dist.all_reduce(flat, op=self._dist.ReduceOp.SUM, async_op=True))

    def close(self) -> None:
        if self._dist.is_initialized():
            self._dist.destroy_process_group()


class NCCLBackend(_TorchBackend):
    """NCCL over the worker ranks only, bootstrapped through MPI (:func:`_torch_group`), each
    worker on ``cuda:(node-local worker index % device count)``. Collective over ``comm``."""

    name = "nccl"

    def __init__(self, comm: MPI.Comm, host: str | None = None):
        import torch
        import torch.distributed as dist
        if not torch.cuda.is_available():
            raise HpcpsError("dense backend 'nccl' needs CUDA, and torch sees no GPU")
        if not dist.is_nccl_available():
            raise HpcpsError("dense backend 'nccl': this torch build has no NCCL")
        self.comm = comm
        local = comm.Split_type(MPI.COMM_TYPE_SHARED)
        self.device = torch.device("cuda", local.Get_rank() % torch.cuda.device_count())
        local.Free()
        torch.cuda.set_device(self.device)
        self._dist, self.store = _torch_group(comm, "nccl", host, device_id=self.device)


class GlooBackend(_TorchBackend):
    """Gloo over the worker ranks only (CPU tensors), bootstrapped through MPI
    (:func:`_torch_group`). Its all-reduce runs on gloo's own threads over TCP while the worker
    computes, where ``MPI_Iallreduce`` moves only while its ranks poll it: on hosts joined by TCP
    alone (no RDMA) that polling is most of a step. Gloo picks the interface of the store's
    address, or ``GLOO_SOCKET_IFNAME``. Collective over ``comm``."""

    name = "gloo"

    def __init__(self, comm: MPI.Comm, host: str | None = None):
        self.comm = comm
        self.device = "cpu"
        self._dist, self.store = _torch_group(comm, "gloo", host)


def make_backend(name: str, comm: MPI.Comm, device, nbytes: int = 0,
                 nccl_host: str | None = None) -> "MPIBackend | NCCLBackend | ShmBackend | GlooBackend":
    """``auto`` picks NCCL for CUDA modules; for CPU ones shared memory when every worker is on
    one node and its ``2 x workers x nbytes`` (the buckets' bytes) fit in ``SHM_MAX_BYTES``, else
    MPI; ``gloo`` only when asked. ``nccl_host``: the address worker 0 offers for the NCCL or gloo bootstrap (config key
    ``model.nccl_host``; default ``$HPCPS_NCCL_HOST``, else its hostname's). Collective over ``comm``."""
    cpu = getattr(device, "type", str(device)) == "cpu"
    if name == "auto":
        name = "mpi" if cpu else "nccl"
        if cpu and 2 * comm.Get_size() * nbytes <= SHM_MAX_BYTES and _one_node(comm):
            name = "shm"
    if name in ("mpi", "shm", "gloo") and not cpu:
        raise ValueError(f"dense backend '{name}' needs CPU tensors, the module is on {device}")
    if name == "mpi":
        return MPIBackend(comm)
    if name == "shm":
        return ShmBackend(comm)
    if name == "nccl":
        return NCCLBackend(comm, nccl_host)
    if name == "gloo":
        return GlooBackend(comm, nccl_host)
    raise ValueError(f"dense backend must be auto, shm, mpi, gloo or nccl, got {name!r}")
