"""Where a job's ranks run: hosts, ranks and PS per host, how each worker reaches each PS
(shared memory or RMA), the dense all-reduce backend and the MPI library. ``hpcps train`` prints it as one line at
start and puts it in the final summary as ``"layout"``."""

import os

from mpi4py import MPI

__all__ = ["gather_layout", "layout_line", "backend_name", "mpi_info"]


def gather_layout(ctx, tables) -> dict | None:
    """The job's layout, on the first worker (None on the other ranks). Collective over ``ctx.world``,
    after the tables are made (a worker's shared-memory PS are those of its first table)."""
    shm = tables[0].shared_memory_ps if (ctx.is_worker and tables) else []     # (``rma_ps``: the rest,
    # reached over RMA, or by messages for a dynamic table: ``remote``)
    me = (MPI.Get_processor_name(), ctx.node_of_rank[ctx.rank], ctx.is_ps, shm)
    every = ctx.world.gather(me, root=ctx.worker_world_ranks[0])
    if every is None:
        return None
    nodes: dict = {}                        # node key -> host name, in order of first rank
    for name, node, _, _ in every:
        nodes.setdefault(node, name)
    keys = list(nodes)
    host_of = [keys.index(node) for _, node, _, _ in every]
    ps_host = [host_of[r] for r in ctx.ps_world_ranks]
    workers = []
    for w, r in enumerate(ctx.worker_world_ranks):
        shm_ps = sorted(every[r][3])
        workers.append({"rank": r, "host": host_of[r], "shm_ps": shm_ps,
                        "rma_ps": [p for p in range(ctx.num_ps) if p not in shm_ps]})
    return {"hosts": len(keys), "host_names": [nodes[k] for k in keys], "remote": tables[0].remote if tables else "RMA",
            "ranks_per_host": [host_of.count(h) for h in range(len(keys))],
            "ps_per_host": [ps_host.count(h) for h in range(len(keys))],
            "ps_hosts": ps_host, "workers": workers, "transport": ctx.transport, "dense": None,
            "mpi": mpi_info(ctx.window_kind)}


def mpi_info(windows: str) -> dict:
    """The MPI library, how windows are made (``hpcps.core.window``) and the one-sided component
    setting this rank runs with (``OMPI_MCA_osc``: ``hpcps.core.process.mpi_settings``). Local."""
    name, version = MPI.get_vendor()
    info = {"library": name, "version": ".".join(map(str, version)), "windows": windows}
    if name == "Open MPI" and os.environ.get("OMPI_MCA_osc"):
        info["OMPI_MCA_osc"] = os.environ["OMPI_MCA_osc"]
    return info


def backend_name(dense_sync) -> str:
    """``shm``, ``mpi`` or ``nccl``: the backend a :class:`hpcps.dense.DenseSync` all-reduces with. Local."""
    return type(dense_sync.backend).__name__.removesuffix("Backend").lower()


def layout_line(layout: dict) -> str:
    """The layout as one line of text. Local, pure."""
    hosts = "; ".join(f"{name}: {n} rank{'s' * (n != 1)}, {p} PS"
                      for name, n, p in zip(layout["host_names"], layout["ranks_per_host"], layout["ps_per_host"]))
    groups: dict = {}                       # workers that reach the PS the same way, together
    for w, info in enumerate(layout["workers"]):
        groups.setdefault((tuple(info["shm_ps"]), tuple(info["rma_ps"])), []).append(w)
    over = "by messages" if layout.get("remote") == "messages" else "over RMA"
    reads = "; ".join(f"worker{'s' * (len(ws) > 1)} {_span(ws)}: " + ", ".join(
        f"PS {_span(ps)} {how}" for ps, how in ((shm, "by shared memory"), (rma, over)) if ps)
        for (shm, rma), ws in groups.items())
    mpi = layout.get("mpi")
    lib = "" if not mpi else (f"; MPI: {mpi['library']} {mpi['version']}, windows {mpi['windows']}"
                              + "".join(f", {k}={mpi[k]}" for k in ("OMPI_MCA_osc",) if k in mpi))
    lost = f"; a lost rank: {layout['failover']}" if layout.get("failover") else ""
    return (f"{layout['hosts']} host{'s' * (layout['hosts'] != 1)} ({hosts}); {reads}; "
            f"dense all-reduce: {layout['dense'] or '-'}{lib}{lost}")


def _span(xs) -> str:
    xs = list(xs)
    if len(xs) > 2 and xs == list(range(xs[0], xs[-1] + 1)):
        return f"{xs[0]}-{xs[-1]}"
    return ",".join(map(str, xs))
