"""Which world ranks become parameter servers. Pure: imports no MPI.

By default (``spread``) PS ranks are spread round-robin over nodes so that a
multi-node job does not stack every PS on node 0. On each node the highest
local ranks are taken first, so world rank 0 stays a worker (worker 0 logs and
prints results). ``last`` takes the highest world ranks: with ranks placed in
blocks, that puts the PS on the last node(s) of the job, away from the workers.
"""

from collections.abc import Sequence

__all__ = ["check_num_ps", "check_launch", "spread_ps", "place_ps", "PS_LAYOUTS", "check_standby", "place_standby"]

PS_LAYOUTS = ("spread", "last")   # config key job.ps_layout

# Variables in which launchers tell each process how many tasks they started.
# (Under ``mpiexec`` inside a Slurm allocation, SLURM_STEP_NUM_TASKS counts the launcher's own
# per-node proxies, fewer than the MPI world: only a world *smaller* than a count is an error.)
LAUNCHER_SIZE_VARS = ("SLURM_STEP_NUM_TASKS", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE")


def check_num_ps(num_ps, world_size: int) -> int:
    """Return ``num_ps`` as an int, or raise ``ValueError`` naming the problem. Local."""
    if isinstance(num_ps, bool) or not isinstance(num_ps, int):
        try:
            if isinstance(num_ps, str) and num_ps.strip().lstrip("-").isdigit():
                num_ps = int(num_ps)
            else:
                raise TypeError
        except TypeError:
            raise ValueError(f"num_ps must be an integer, got {num_ps!r}") from None
    if num_ps < 1:
        raise ValueError(f"num_ps must be >= 1, got {num_ps}")
    if num_ps >= world_size:
        hint = (" (a world of 1 rank: was the job started with mpiexec/srun, and does mpi4py "
                "use the same MPI as the launcher?)" if world_size == 1 else "")
        raise ValueError(
            f"num_ps={num_ps} leaves no worker rank in a world of {world_size} "
            f"rank{'s' if world_size != 1 else ''}: need num_ps < world size{hint}")
    return num_ps


def check_launch(world_size: int, environ, want=None) -> None:
    """Raise ``ValueError`` when the MPI world is smaller than the launch: every task then runs
    as rank 0 of its own world and would train a separate copy of the job. ``want`` (config key
    ``job.world_size``; default ``HPCPS_WORLD_SIZE`` in ``environ``), when set, must equal the
    world size exactly. Local, pure (``environ``: a mapping)."""
    name = "job.world_size" if want else "HPCPS_WORLD_SIZE"
    want = str(want if want else environ.get("HPCPS_WORLD_SIZE", "")).strip()
    if want:
        if not want.isdigit() or int(want) != world_size:
            raise ValueError(f"{name}={want} but the MPI world has {world_size} "
                             f"rank{'s' if world_size != 1 else ''}")
    for var in LAUNCHER_SIZE_VARS:
        value = environ.get(var, "").strip()
        if value.isdigit() and int(value) > world_size:
            raise ValueError(
                f"the launcher started {value} tasks ({var}={value}) but this process sees an MPI world "
                f"of {world_size}: the tasks did not join one job. mpi4py's MPI library does not speak "
                f"to this launcher: with srun use --mpi=pmi2 (MPICH) or --mpi=pmix (Open MPI), or "
                f"launch with the mpiexec of the MPI that mpi4py uses")


def spread_ps(node_of_rank: Sequence[int], num_ps: int) -> list[int]:
    """World ranks chosen as PS, ascending. Local, pure.

    ``node_of_rank[r]`` is any hashable node key of world rank ``r``. Nodes are
    visited round-robin in order of first appearance; on each node the
    highest ranks are taken first.
    """
    num_ps = check_num_ps(num_ps, len(node_of_rank))
    nodes: dict = {}
    for rank, node in enumerate(node_of_rank):
        nodes.setdefault(node, []).append(rank)
    stacks = [sorted(ranks) for ranks in nodes.values()]  # pop() takes the highest
    chosen: list[int] = []
    while len(chosen) < num_ps:
        for stack in stacks:
            if stack and len(chosen) < num_ps:
                chosen.append(stack.pop())
    return sorted(chosen)


def place_ps(node_of_rank: Sequence[int], num_ps: int, how: str = "spread") -> list[int]:
    """World ranks chosen as PS, ascending, by ``how`` (one of ``PS_LAYOUTS``). Local, pure."""
    if how == "spread":
        return spread_ps(node_of_rank, num_ps)
    if how == "last":
        num_ps = check_num_ps(num_ps, len(node_of_rank))
        return list(range(len(node_of_rank) - num_ps, len(node_of_rank)))
    raise ValueError(f"ps_layout must be one of {PS_LAYOUTS}, got {how!r}")


def check_standby(standby, num_ps: int, world_size: int) -> int:
    """Return ``standby`` (config key ``job.standby``) as an int, or raise ``ValueError`` naming the
    problem: the ranks left must hold ``num_ps`` PS and at least one worker. Local, pure."""
    if isinstance(standby, bool) or not isinstance(standby, int) or standby < 0:
        raise ValueError(f"job.standby must be an integer >= 0, got {standby!r}")
    if standby and world_size - standby < num_ps + 1:
        raise ValueError(f"job.standby = {standby} leaves {world_size - standby} of the {world_size} ranks to train, "
                         f"fewer than job.num_ps = {num_ps} PS and one worker: launch at least "
                         f"{num_ps + 1 + standby} ranks, or fewer standbys")
    return standby


def place_standby(node_of_rank: Sequence[int], standby: int) -> list[int]:
    """World ranks held back as standbys, ascending. Local, pure.

    Nodes are visited round-robin from the last one (node keys in order of first appearance), the
    highest rank of each first: the standbys are spread over the nodes, so a lost node takes as few
    of them as it can, and world rank 0 trains.
    """
    nodes: dict = {}
    for rank, node in enumerate(node_of_rank):
        nodes.setdefault(node, []).append(rank)
    stacks = [sorted(ranks) for ranks in reversed(list(nodes.values()))]
    chosen: list[int] = []
    while len(chosen) < min(standby, len(node_of_rank)):
        for stack in stacks:
            if stack and len(chosen) < standby:
                chosen.append(stack.pop())
    return sorted(chosen)
