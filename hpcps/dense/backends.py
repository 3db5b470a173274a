"""All-reduce backends for DenseSync: MPI (CPU tensors) and NCCL (CUDA tensors).

Each backend takes a flat tensor and starts a non-blocking in-place SUM over
the worker ranks, returning an object with ``test()`` and ``wait()``.
"""

import logging
import os
import socket

from mpi4py import MPI

from .._wait import wait_request
from ..errors import HpcpsError

__all__ = ["MPIBackend", "NCCLBackend", "make_backend"]

logger = logging.getLogger(__name__)


class _MPIWork:
    def __init__(self, req):
        self._req = req

    def test(self) -> bool:
        return self._req.Test()

    def wait(self) -> None:
        wait_request(self._req)        # MPI_Wait would spin on a core other ranks may need


class MPIBackend:
    """``MPI_Iallreduce`` on the worker communicator; CPU tensors. Collective over ``comm``."""

    name = "mpi"

    def __init__(self, comm: MPI.Comm):
        self.comm = comm
        self.device = "cpu"

    def broadcast(self, tensor, root: int = 0) -> None:
        self.comm.Bcast(tensor.detach().numpy(), root=root)

    def allreduce_async(self, flat) -> _MPIWork:
        buf = flat.numpy()
        return _MPIWork(self.comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM))

    def close(self) -> None:
        pass


class _NCCLWork:
    def __init__(self, work):
        self._work = work

    def test(self) -> bool:
        return self._work.is_completed()

    def wait(self) -> None:
        self._work.wait()


class NCCLBackend:
    """NCCL over the worker ranks only, bootstrapped through MPI. Collective over ``comm``.

    Worker 0 opens a ``torch.distributed.TCPStore`` on a free port and sends
    its address over MPI; every worker then joins a NCCL process group of the
    worker ranks on ``cuda:(node-local worker index % device count)``.
    """

    name = "nccl"

    def __init__(self, comm: MPI.Comm):
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
        rank, size = comm.Get_rank(), comm.Get_size()
        addr = None
        if rank == 0:
            host = os.environ.get("HPCPS_NCCL_HOST") or socket.gethostbyname(socket.gethostname())
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
            addr = (host, port)
        host, port = comm.bcast(addr, root=0)
        try:
            self.store = dist.TCPStore(host, port, size, is_master=(rank == 0))
            self.group = None
            if not dist.is_initialized():
                dist.init_process_group("nccl", store=self.store, rank=rank, world_size=size,
                                        device_id=self.device)
            self.group = dist.group.WORLD
        except Exception as e:      # noqa: BLE001 - wrapped once at the boundary
            raise HpcpsError(f"NCCL bootstrap over MPI failed ({host}:{port}): {e}") from e
        self._dist = dist

    def broadcast(self, tensor, root: int = 0) -> None:
        self._dist.broadcast(tensor.data, src=root, group=self.group)

    def allreduce_async(self, flat) -> _NCCLWork:
        return _NCCLWork(self._dist.all_reduce(flat, op=self._dist.ReduceOp.SUM, group=self.group,
                                               async_op=True))

    def close(self) -> None:
        if self._dist.is_initialized():
            self._dist.destroy_process_group()


def make_backend(name: str, comm: MPI.Comm, device) -> "MPIBackend | NCCLBackend":
    """``auto`` picks NCCL for CUDA modules, MPI otherwise. Collective over ``comm``."""
    if name == "auto":
        name = "nccl" if getattr(device, "type", str(device)) == "cuda" else "mpi"
    if name == "mpi":
        if getattr(device, "type", str(device)) != "cpu":
            raise ValueError(f"dense backend 'mpi' needs CPU tensors, the module is on {device}")
        return MPIBackend(comm)
    if name == "nccl":
        return NCCLBackend(comm)
    raise ValueError(f"dense backend must be auto, mpi or nccl, got {name!r}")
