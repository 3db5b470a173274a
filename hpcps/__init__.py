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
