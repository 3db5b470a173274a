"""hpcps: a parameter server for sparse recommendation models on HPC clusters.

    import hpcps
    with hpcps.init(num_ps=1) as ctx:                 # collective over MPI.COMM_WORLD
        t = hpcps.EmbeddingTable(ctx, "items", 1_000_000, 64,
                                 optimizer=hpcps.optim.Adagrad(lr=0.05))
        if ctx.is_ps:
            ctx.serve()
        else:
            rows = t.pull(ids)
            t.push(ids, grads)

``hpcps.DenseSync``, ``hpcps.nn`` and ``hpcps.models`` import torch on first use.
"""

import importlib
import os
import sys

from . import _malloc

# `hpcps train` starts itself again with glibc's per-thread cache of small chunks off, before MPI
# starts (the tcache fragments a worker's heap: hpcps/_malloc.py); a program that imports hpcps
# keeps its allocator
_malloc.restart_without_tcache()

# MPI starts at the first import of mpi4py.MPI (just below, unless the program imported it
# already): ask for MPI_THREAD_SERIALIZED, not mpi4py's default MULTIPLE. Under MULTIPLE, MPICH
# guards every call with a global lock and yields the CPU (sched_yield) while it progresses an
# RMA flush or atomic, which on a node with more ranks than CPUs made such calls wait for
# other ranks' time slices (a fetch-and-add + flush: median 186 us against 17 us under
# SERIALIZED, 4 ranks on 2 CPUs). Only the pipeline's communication thread calls MPI off the
# main thread: HPCPS_MPI_THREADS=multiple (or mpi4py's own MPI4PY_RC_THREAD_LEVEL) enables it.
if "mpi4py.MPI" not in sys.modules and "MPI4PY_RC_THREAD_LEVEL" not in os.environ:
    import mpi4py
    mpi4py.rc.thread_level = os.environ.get("HPCPS_MPI_THREADS", "serialized")

from . import optim
from ._version import __version__
from .errors import FreedError, HpcpsError, RoleError
from .sparse import EmbeddingTable, initial_rows, push_many
from .topology import Context, init

__all__ = ["init", "Context", "EmbeddingTable", "initial_rows", "push_many", "optim", "DenseSync", "nn", "models",
           "HpcpsError", "FreedError", "RoleError", "__version__"]

_LAZY = {"DenseSync": ("hpcps.dense", "DenseSync"), "nn": ("hpcps.nn", None), "models": ("hpcps.models", None)}


def __getattr__(name):
    if name in _LAZY:
        module, attr = _LAZY[name]
        mod = importlib.import_module(module)
        return getattr(mod, attr) if attr else mod
    raise AttributeError(f"module 'hpcps' has no attribute {name!r}")
