"""The alpha-beta model of a sync step, a checkpoint and a restore, and the search for a layout.
Local, pure.

Per step of global batch ``B`` on ``W`` workers and ``P`` PS over ``N`` nodes (``R`` ranks a node),
each worker with ``b = B / W`` samples:

- ``pull``: a worker's distinct rows of ``b`` samples (:meth:`Workload.unique_bytes`): a round
  trip to each PS (``P x alpha``; counted by scripts/bench_scale.py), the bytes of the PS on other nodes over the node's link (shared by
  the node's workers, ``beta``), or, when slower, over each PS's end: every worker's remote bytes
  over the PS ranks, through a PS node's link shared by its PS; those on its own node gathered from
  memory (``gather``);
- ``compute``: ``b x dense_s_per_sample`` on the worker's cores (``cores_per_worker``);
- ``draw``: ``b x draw_s_per_sample`` on them too, where the worker draws its own batches (no loader
  process: ``pipeline.loader`` auto runs one where a node has two CPUs a worker); else 0;
- ``push``: the same rows' gradients, as the pull but with three round trips to each PS
  (``3 P x alpha``, counted);
- ``apply``: a PS applies its share of the global batch's distinct rows (``apply_s_per_row``);
- ``allreduce``: the dense part's gradients (Rabenseifner's reduce-scatter and all-gather):
  ``2 log2(W) alpha + 2 (W - 1) / W x bytes / beta``; it overlaps the PS's apply (the next pull
  waits for both).

``step = draw + pull + compute + push + max(apply, allreduce)``; the bottleneck is the largest term.
Checkpoint: every PS writes its share, ``bytes / min(fs, P x write_bytes_s)``; restore the same with
reads. Memory per node: its PS ranks' shards (rows, state, staging, push mailboxes) and its workers
(a base per process plus the dense parameters, gradients and optimizer state)."""

import math
from dataclasses import dataclass

from ..data.loader import fits as loader_fits
from .costs import Costs
from .workload import Workload

__all__ = ["Cluster", "predict", "search", "WORKER_BASE_BYTES", "MEMORY_SHARE", "PULL_TRIPS", "PUSH_TRIPS"]

# round trips a worker makes to each PS per step, as scripts/bench_scale.py counts them (deterministic
# sync, every push through the mailbox: 3.87 per PS and step in all); taken one after another
PULL_TRIPS = 1                  # one read of the rows
PUSH_TRIPS = 3                  # the mailbox's two flushes, and the step's flag
WORKER_BASE_BYTES = 0.35e9      # a rank's python, torch and MPI (measured: ~0.3 GB RSS at start)
MEMORY_SHARE = 0.85             # of a node's memory a plan may use


@dataclass(frozen=True)
class Cluster:
    nodes: int
    cpus_per_node: int = 64
    mem_per_node: float = 512e9     # bytes
    net_gbps: float = 200.0         # each node's link, Gb/s
    latency_s: float = 2e-6         # one message or RMA round trip
    fs_gbps: float = 100.0          # the parallel filesystem's aggregate, GB/s
    ranks_per_node: int = 0         # 0: one rank per 8 CPUs (a worker's torch threads), at least 2

    @property
    def ranks(self) -> int:
        return self.nodes * (self.ranks_per_node or max(2, self.cpus_per_node // 8))

    @property
    def beta(self) -> float:
        """A node's link in bytes per second."""
        return self.net_gbps * 1e9 / 8


def predict(w: Workload, c: Costs, cl: Cluster, num_ps: int, remote: float | None = None,
            loader: bool | None = None) -> dict:
    """The figures of one layout: ``num_ps`` PS spread over the nodes, the other ranks workers.
    ``remote``: the share of a worker's rows on other nodes, where the layout is not that (a PS
    node without workers: 1); default ``1 - 1/N``. ``loader``: whether a loader process draws each
    worker's batches off its step; default as ``pipeline.loader = auto`` decides."""
    R, N = cl.ranks, cl.nodes
    W = R - num_ps
    if W < 1 or num_ps < 1:
        raise ValueError(f"{num_ps} PS of {R} ranks leaves no worker")
    b = w.batch / W
    per_node = R // N
    cores = max(1.0, cl.cpus_per_node / per_node)
    workers_here = W / N
    if remote is None:
        remote = 1 - 1 / N          # a worker's share of rows on other nodes (PS spread evenly over them)
    rows_bytes = w.unique_bytes(b)
    link = cl.beta / max(workers_here, 1)                               # a worker's share of its node's link
    ps_here = math.ceil(num_ps / N)
    ps_end = W * remote * rows_bytes / num_ps * ps_here / cl.beta       # every worker's bytes at a PS node's link
    wire = max(remote * rows_bytes / link, ps_end)
    moved = wire + (1 - remote) * rows_bytes * c.gather_s_per_byte
    pull = num_ps * PULL_TRIPS * cl.latency_s + moved
    push = num_ps * PUSH_TRIPS * cl.latency_s + moved
    compute = b * c.dense_s_per_sample / cores
    if loader is None:
        loader = loader_fits(math.ceil(workers_here), cl.cpus_per_node)
    draw = 0.0 if loader else b * c.draw_s_per_sample / cores
    apply = w.unique_rows(w.batch) / num_ps * c.apply_s_per_row
    dense_bytes = 4 * w.dense_params
    allreduce = (2 * math.log2(W) * cl.latency_s + 2 * (W - 1) / W * dense_bytes / cl.beta) if W > 1 else 0.0
    terms = {"draw": draw, "pull": pull, "compute": compute, "push": push, "apply": apply, "allreduce": allreduce}
    step = draw + pull + compute + push + max(apply, allreduce)
    on_path = {"draw": draw, "pull": pull, "compute": compute, "push": push,
               ("apply" if apply >= allreduce else "allreduce"): max(apply, allreduce)}
    ps_bytes = w.ps_bytes(num_ps, far_workers=round(W * remote), workers=W)
    mem = (ps_here * ps_bytes + math.ceil(workers_here) * (WORKER_BASE_BYTES + dense_bytes * (2 + w.stateful_dense))
           + (ps_here * WORKER_BASE_BYTES))
    ckpt = w.row_bytes
    fs = cl.fs_gbps * 1e9
    return {"num_ps": num_ps, "workers": W, "ranks": R, "samples_per_s": w.batch / step, "step_s": step,
            "terms_s": terms, "bottleneck": max(on_path, key=on_path.get),
            "ps_bytes": ps_bytes, "node_bytes": mem, "fits": mem <= MEMORY_SHARE * cl.mem_per_node,
            "checkpoint_bytes": ckpt, "checkpoint_s": ckpt / min(fs, num_ps * c.write_bytes_s),
            "restore_s": ckpt / min(fs, num_ps * c.read_bytes_s)}


def search(w: Workload, c: Costs, cl: Cluster) -> tuple[dict | None, dict]:
    """``(the fastest layout that fits, the layout with the fewest PS that fits)``; ``(None, the
    layout with every rank but one a PS)`` when nothing fits. PS counts tried: 1 to 8, then about
    10% apart, each multiple of the nodes among them, and every rank but one; never fewer than
    leave at most one worker a sample of the global batch (``train`` refuses more workers)."""
    R, N = cl.ranks, cl.nodes
    least = max(1, R - w.batch)
    tries = {p for p in range(1, 9)} | {int(round(1.1 ** k)) for k in range(200) if 1.1 ** k < R}
    tries |= {N * k for k in (1, 2, 3, 4, 6, 8)} | {least, R - 1}
    tries = sorted(p for p in tries if least <= p < R)
    fits = [x for x in (predict(w, c, cl, p) for p in tries) if x["fits"]]
    if not fits:
        return None, predict(w, c, cl, R - 1)
    return max(fits, key=lambda x: x["samples_per_s"]), min(fits, key=lambda x: x["num_ps"])
