"""The columns of the monitor's board (:mod:`hpcps.monitor.board`): one row of float64 per rank,
:data:`FIELDS` then a worker's figures per PS (:func:`per_ps`). Pure."""

__all__ = ["FIELDS", "WORKER", "PS", "at", "per_ps"]

WORKER, PS = 0.0, 1.0
FIELDS = (
    "seq",          # samples this rank put (0: none yet)
    "done",         # 1 once this worker left its training loop
    "role",         # WORKER or PS
    "cpu_proc",     # CPUs this process used since its previous sample (1.0: one CPU all the time)
    "cpu_node",     # busy share of the node's CPUs since then
    "rss",          # resident bytes now
    "mem_used",     # bytes in use on the node (or in the job's cgroup)
    "mem_limit",    # bytes the node (or the cgroup) has
    "local_free",   # bytes free in checkpoint.local_dir on this host (NaN: no local_dir)
    "busy",         # PS: share of the time applying, serving or writing checkpoints
    "apply",        # PS: share of the time applying pushed gradients
    "checkpoint",   # PS: share of the time writing checkpoints
    "serve",        # PS: share of the time serving requests (a dynamic table's messages; reads are one-sided)
    "rows_s",       # PS: rows applied per second
    "steps",        # worker: steps since its previous sample
    "step_s",       # worker: seconds per step
    "compute_s",    # worker: seconds per step of its own work (the step but its waits on other ranks)
    "rpc_s",        # worker: seconds per step waiting for its pulls and pushes
)
_AT = {name: i for i, name in enumerate(FIELDS)}


def at(name: str) -> int:
    """The column of a field. Local, pure."""
    return _AT[name]


def per_ps(name: str, num_ps: int) -> slice:
    """The columns of a worker's figure per PS after :data:`FIELDS`: ``wait_ps`` (seconds per step
    of fence wait on each PS), ``bytes_ps`` (bytes per second pulled from and pushed to each). Local, pure."""
    k = ("wait_ps", "bytes_ps").index(name)
    return slice(len(FIELDS) + k * num_ps, len(FIELDS) + (k + 1) * num_ps)
