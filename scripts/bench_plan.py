"""hpcps plan's model against measurements on layouts this machine does not oversubscribe.

    .venv/bin/python scripts/bench_plan.py [--steps 300] [--warmup 50] [--out results/bench_plan.json]

Needs root for the pretend hosts (scripts/cluster.sh, cluster "bp", removed after). Each case
runs 1 PS + 1 worker (2 ranks on 2 cores) of a workload and predicts it with
hpcps.plan.model.predict from per-row costs timed here (hpcps.plan.costs.measure, one CPU) and,
across hosts, the network of the pretend hosts as a ping-pong measures it (an 8-byte round trip
for the latency; a message of the step's bytes for the bandwidth):
  <workload>_one_host   both ranks on this machine (1 node of 2 CPUs)
  <workload>_two_hosts  the worker on h0, the PS on h1, each host on a CPU of its own
                        (--split-cpus; 2 nodes of 1 CPU, every row on the other node)
Workloads: main (examples/ctr.toml) and large (examples/large.toml at data.scale 0.001 with the
small dense part of scripts/bench_host_loss.py). Prints measured and predicted samples/s and
their ratio against the target: within 25%.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_e2e import bench_hpcps  # noqa: E402
from bench_host_loss import SMALL_DENSE  # noqa: E402
from bench_hosts import PING  # noqa: E402
from mpirun import CLUSTER, run_mpi  # noqa: E402

WORKLOADS = {"main": (ROOT / "examples" / "ctr.toml", []),
             "large": (ROOT / "examples" / "large.toml", ["data.scale=0.001", *SMALL_DENSE])}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--workloads", default="main,large")
    p.add_argument("--out", default="results/bench_plan.json")
    a = p.parse_args(argv)
    a.workloads = a.workloads.split(",")
    if not set(a.workloads) <= set(WORKLOADS) or a.steps <= a.warmup:
        p.error(f"--workloads from {sorted(WORKLOADS)}; --steps above --warmup")
    return a


def cluster(*args):
    subprocess.run([str(CLUSTER), *args], check=True, capture_output=True, text=True)


# an RMA round trip as a worker makes them (an 8-byte atomic read of a PS's word and a flush) to a
# rank in its polling loop (hpcps's windows: Win.Allocate, Lock_all(MODE_NOCHECK)), median of 200
RMA_PING = """
import time, numpy as np
from mpi4py import MPI
c = MPI.COMM_WORLD
win = MPI.Win.Allocate(64, 8, comm=c)
win.Lock_all(MPI.MODE_NOCHECK)
c.Barrier()
if c.rank == 0:
    res, ign, best = np.zeros(1, np.int64), np.zeros(1, np.int64), []
    for rep in range(200):
        t = time.perf_counter()
        win.Get_accumulate([ign, MPI.INT64_T], [res, MPI.INT64_T], 1, (0, 1, MPI.INT64_T), op=MPI.NO_OP)
        win.Flush(1)
        best.append(time.perf_counter() - t)
    c.send(None, 1)
    print("RMAPING", sorted(best)[len(best) // 2], flush=True)
else:
    while not c.Iprobe(0):
        win.Flush_all()
    c.recv(source=0)
win.Unlock_all()
win.Free()
"""


def ping(message_bytes: int) -> dict:
    """Round trips between h0 and h1 (the cluster is up): 8 bytes, ``message_bytes``, and an RMA
    round trip as hpcps makes them (the model's latency: every round trip it charges is one)."""
    r = run_mpi(2, ["-c", PING, str(max(int(message_bytes), 8))], mpi4py_run=False, hosts="h0:1,h1:1")
    small, size, big = r.stdout.split("PING")[1].split()[:3]
    rma = run_mpi(2, ["-c", RMA_PING], mpi4py_run=False, hosts="h0:1,h1:1")
    return {"rtt_8b_s": float(small), "rma_rtt_s": float(rma.stdout.split("RMAPING")[1].split()[0]),
            "bytes": int(size), "bandwidth_bytes_s": 2 * int(size) / float(big)}


def predicted(cfg_path, sets, nodes: int, cpus: int, net: dict | None) -> dict:
    from hpcps.config import load_config
    from hpcps.plan.costs import measure
    from hpcps.plan.model import Cluster, predict
    from hpcps.plan.workload import workload
    cfg = load_config(cfg_path, sets + ["job.num_ps=1"], environ={})
    kw = {} if net is None else {"net_gbps": net["bandwidth_bytes_s"] * 8 / 1e9, "latency_s": net["rma_rtt_s"]}
    cl = Cluster(nodes, cpus_per_node=cpus, mem_per_node=24e9, ranks_per_node=2 // nodes, **kw)
    x = predict(workload(cfg), measure(cfg), cl, 1, remote=None if nodes == 1 else 1.0, loader=False)
    return {"samples_per_s": x["samples_per_s"], "terms_ms": {k: 1e3 * v for k, v in x["terms_s"].items()},
            "bottleneck": x["bottleneck"]}


def run_case(args, name: str, two_hosts: bool, tmp) -> dict:
    cfg_path, sets = WORKLOADS[name]
    extra = [*sets, "job.num_ps=1", "job.ps_layout=last", "pipeline.loader=off"]
    if not two_hosts:
        got = bench_hpcps(str(cfg_path), args.steps, args.warmup, 2, tmp, extra=extra)
        return {"measured": got["samples_per_s"], "measured_ms": _phases(got), "model": predicted(cfg_path, sets, 1, 2, None)}
    cluster("up", "2", "--split-cpus")
    try:
        got = bench_hpcps(str(cfg_path), args.steps, args.warmup, 2, tmp, extra=extra, hosts="h0:1,h1:1")
        net = ping(got["bytes_per_step"])
    finally:
        cluster("down", "--force")
    return {"measured": got["samples_per_s"], "measured_ms": _phases(got), "network": net,
            "model": predicted(cfg_path, sets, 2, 1, net)}


def _phases(got: dict) -> dict:
    """A measured run's pull and push and its step's phases, ms a step."""
    return {"pull": got["pull_ms"], "push": got["push_ms"], **got["phase_ms"]}


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ["HPCPS_CLUSTER"] = os.environ.get("HPCPS_CLUSTER_BENCH", "bp")
    res = {"config": vars(args), "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.workloads:
            for two in (False, True):
                case = f"{name}_{'two_hosts' if two else 'one_host'}"
                r = res["cases"][case] = run_case(args, name, two, tmp)
                r["model_vs_measured"] = r["model"]["samples_per_s"] / r["measured"]
                r["within_25pct"] = abs(r["model_vs_measured"] - 1) <= 0.25
                terms = " ".join(f"{k} {v:.2f}" for k, v in r["model"]["terms_ms"].items())
                print(f"{case:18s} measured {r['measured']:>10,.0f}  model {r['model']['samples_per_s']:>10,.0f} "
                      f"samples/s  model/measured {r['model_vs_measured']:.2f} (target 0.75-1.25)  ms: {terms}",
                      flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
