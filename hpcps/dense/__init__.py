"""Dense layers replicated on the workers and all-reduced (shared memory, MPI or NCCL), and their
optimizer (torch's fused kernels)."""

from .backends import MPIBackend, NCCLBackend, ShmBackend, make_backend
from .optim import FusedOptimizer, make_dense_optimizer
from .sync import DenseSync

__all__ = ["DenseSync", "MPIBackend", "NCCLBackend", "ShmBackend", "make_backend", "FusedOptimizer", "make_dense_optimizer"]
