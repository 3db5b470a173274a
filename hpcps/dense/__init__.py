"""Dense layers replicated on the workers and all-reduced (shared memory, MPI or NCCL)."""

from .backends import MPIBackend, NCCLBackend, ShmBackend, make_backend
from .sync import DenseSync

__all__ = ["DenseSync", "MPIBackend", "NCCLBackend", "ShmBackend", "make_backend"]
