"""Dense layers replicated on the workers and all-reduced (MPI or NCCL)."""

from .backends import MPIBackend, NCCLBackend, make_backend
from .sync import DenseSync

__all__ = ["DenseSync", "MPIBackend", "NCCLBackend", "make_backend"]
