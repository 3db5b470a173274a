"""hpcps: a parameter server for sparse recommendation models on HPC clusters.

    import hpcps
    with hpcps.init(num_ps=1) as ctx:                 # collective over MPI.COMM_WORLD
        t = hpcps.EmbeddingTable(ctx, "items", 1_000_000, 64,
                                 optimizer=hpcps.optim.SGD(lr=0.05))
        if ctx.is_ps:
            ctx.serve()
        else:
            rows = t.pull(ids)
            t.push(ids, grads)
"""

from . import optim
from ._version import __version__
from .errors import FreedError, HpcpsError, RoleError
from .sparse import EmbeddingTable, initial_rows
from .topology import Context, init

__all__ = ["init", "Context", "EmbeddingTable", "initial_rows", "optim",
           "HpcpsError", "FreedError", "RoleError", "__version__"]
