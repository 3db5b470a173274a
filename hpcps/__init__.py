"""hpcps: a parameter server for sparse recommendation models on HPC clusters.

    import hpcps
    hpcps.prepare_process()                           # optional, before MPI starts: see below
    with hpcps.init(num_ps=1) as ctx:                 # collective over MPI.COMM_WORLD
        t = hpcps.EmbeddingTable(ctx, "items", 1_000_000, 64,
                                 optimizer=hpcps.optim.Adagrad(lr=0.05))
        if ctx.is_ps:
            ctx.serve()
        else:
            rows = t.pull(ids)
            t.push(ids, grads)

``import hpcps`` only imports: every name below is loaded on first use, and MPI
starts when a name that needs it (``init``, ``EmbeddingTable``, ...) is first
touched. :func:`prepare_process` does what ``hpcps train`` does before MPI
starts (MPI thread level ``serialized``, glibc's tcache off); a program of your
own calls it first thing, or launches with the same settings (README,
"Python API").
"""

import importlib

from ._version import __version__
from .core.errors import FreedError, HpcpsError, RoleError

__all__ = ["init", "Context", "EmbeddingTable", "DynamicEmbeddingTable", "initial_rows", "push_many", "optim", "DenseSync", "nn", "models",
           "prepare_process", "HpcpsError", "FreedError", "RoleError", "__version__"]

_LAZY = {"init": ("hpcps.runtime.context", "init"), "Context": ("hpcps.runtime.context", "Context"),
         "EmbeddingTable": ("hpcps.sparse.table", "EmbeddingTable"),
         "DynamicEmbeddingTable": ("hpcps.sparse.dynamic", "DynamicEmbeddingTable"), "push_many": ("hpcps.sparse.push", "push_many"),
         "initial_rows": ("hpcps.core.ids", "initial_rows"), "prepare_process": ("hpcps.core.process", "prepare_process"),
         "optim": ("hpcps.optim", None), "DenseSync": ("hpcps.dense", "DenseSync"), "nn": ("hpcps.nn", None),
         "models": ("hpcps.models", None)}


def __getattr__(name):
    if name in _LAZY:
        module, attr = _LAZY[name]
        mod = importlib.import_module(module)
        return getattr(mod, attr) if attr else mod
    raise AttributeError(f"module 'hpcps' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
