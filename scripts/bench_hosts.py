"""Crossing hosts: the main job with the same ranks and CPUs on one pretend host and across two.

    .venv/bin/python scripts/bench_hosts.py [--steps 300] [--repeat 2] [--out results/bench_hosts.json]
    HPCPS_MPI=openmpi .venv/bin/python scripts/bench_hosts.py     (launched by Open MPI's prterun)

Needs root: it makes pretend hosts h0 and h1 (scripts/cluster.sh, cluster "bh") and removes them
after. Every run has 3 ranks, 1 PS + 2 workers, and this machine's CPUs in all; the DLRM job of
examples/ctr.toml (sync mode, Adagrad), timed after --warmup steps:
  one_host        the 3 ranks on h0, which has every CPU
  across          the 2 workers on h0, the PS on h1 (job.ps_layout=last), the CPUs split between
                  the hosts (each host pinned to its own)
  across_shared   the same, both hosts on every CPU (oversubscribed, as on a busy node)
  rpc_across      the torch.distributed.rpc PS (scripts/rpc_ps_baseline.py), its server on h1,
                  the CPUs split
  ping_pong       MPI Send/Recv between h0 and h1, CPUs split: the round trip of 8 bytes and of
                  a message of the bytes a worker moves per step; the bandwidth this gives
  *_dynamic       (--dynamic) one_host and across with model.dynamic_tables = true: the DLRM on one
                  dynamic table (same-host workers read the PS's window; across hosts, messages)
--only a,b runs only those contenders.
Prints each run's samples/s, pull and push ms per step, and the ratios against the targets:
across / one_host >= 0.5, across_shared / one_host >= 0.25, across / rpc_across >= 2, and push /
pull <= 1.5 across hosts. --repeat N runs N interleaved rounds, each contender's median reported.
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

from bench_e2e import _median, bench_hpcps  # noqa: E402
from mpirun import CLUSTER, mpi_env, run_mpi, using_mpi  # noqa: E402

NAME = "bh"
PING = """
import sys, time, numpy as np
from mpi4py import MPI
c = MPI.COMM_WORLD
out = {}
for size in (8, int(sys.argv[1])):
    buf = np.zeros(max(size, 8), np.uint8)
    best = []
    for rep in range(60):
        c.Barrier()
        t = time.perf_counter()
        if c.rank == 0:
            c.Send(buf, 1); c.Recv(buf, 1)
        else:
            c.Recv(buf, 0); c.Send(buf, 0)
        best.append(time.perf_counter() - t)
    out[size] = sorted(best)[len(best) // 2]
if c.rank == 0:
    print("PING", out[8], int(sys.argv[1]), out[int(sys.argv[1])], flush=True)
"""


def cluster(*args):
    subprocess.run([str(CLUSTER), *args], check=True, capture_output=True, text=True)


def run_one(name, args, tmp):
    """One contender; returns its figures. The cluster is brought up split or shared to suit."""
    split = name in ("across", "across_dynamic", "rpc_across", "ping_pong")
    cluster("up", "2", *(["--split-cpus"] if split else []))
    try:
        if name == "rpc_across":
            r = run_mpi(3, [str(ROOT / "scripts" / "rpc_ps_baseline.py"), args.config, str(args.steps),
                            str(args.warmup), "h0"], mpi4py_run=False, hosts="h0:2,h1:1", timeout=1200,
                        env={"TP_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0"})
            return json.loads([x for x in r.stdout.splitlines() if x.startswith('{"rpc"')][0])["rpc"]
        if name == "ping_pong":
            r = run_mpi(2, ["-c", PING, str(int(args.message_bytes))], mpi4py_run=False, hosts="h0:1,h1:1")
            small, size, big = r.stdout.split("PING")[1].split()[:3]
            return {"rtt_8b_ms": 1e3 * float(small), "message_bytes": int(size), "rtt_message_ms": 1e3 * float(big),
                    "bandwidth_mb_s": 2 * int(size) / float(big) / 1e6}
        hosts = "h0:3" if name.startswith("one_host") else "h0:2,h1:1"
        dyn = ["model.dynamic_tables=true"] if name.endswith("_dynamic") else []
        return bench_hpcps(args.config, args.steps, args.warmup, 3, tmp, extra=["job.ps_layout=last", *dyn], hosts=hosts)
    finally:
        cluster("down", "--force")


def main():
    with using_mpi(os.environ.get("HPCPS_MPI")):        # HPCPS_MPI=openmpi: launches by Open MPI's prterun
        _main()


def _main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "examples" / "ctr.toml"))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_hosts.json"))
    ap.add_argument("--dynamic", action="store_true", help="also one_host and across on a dynamic table")
    ap.add_argument("--only", default="", help="comma-separated contenders to run (default: all)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_hosts.py: needs root (pretend hosts are network namespaces)")
    mpi_env()                                   # fails early when no mpiexec is found
    os.environ["HPCPS_CLUSTER"] = NAME          # the launches' pretend hosts
    names = ["one_host", "across", "across_shared", "rpc_across"]
    if args.dynamic:
        names += ["one_host_dynamic", "across_dynamic"]
    if args.only:
        names = [n for n in names if n in args.only.split(",")]
    runs = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeat):
            for n in names[r % len(names):] + names[:r % len(names)]:
                runs[n].append(run_one(n, args, tmp))
                print(f"round {r + 1} {n}: {runs[n][-1]['samples_per_s']:,.0f} samples/s", flush=True)
    res = {n: min(v, key=lambda x: abs(x["samples_per_s"] - _median([y["samples_per_s"] for y in v])))
           for n, v in runs.items()}
    rate = {n: res[n]["samples_per_s"] for n in names}
    res["mpi"] = next((res[n]["mpi"] for n in names if "mpi" in res[n]), None)
    ratios = {"across_vs_one_host": ("across", "one_host"), "across_shared_vs_one_host": ("across_shared", "one_host"),
              "across_vs_rpc_across": ("across", "rpc_across"),
              "one_host_dynamic_vs_fixed": ("one_host_dynamic", "one_host"),
              "across_dynamic_vs_fixed": ("across_dynamic", "across")}
    res["ratios"] = {k: rate[a] / rate[b] for k, (a, b) in ratios.items() if a in rate and b in rate}
    if "across" in res:
        res["ratios"]["push_vs_pull_across"] = res["across"]["push_ms"] / max(res["across"]["pull_ms"], 1e-9)
        args.message_bytes = res["across"]["bytes_per_step"]
        with tempfile.TemporaryDirectory() as tmp:
            ping = res["ping_pong"] = run_one("ping_pong", args, tmp)
        res["wire"] = {                                             # 2 workers: the wire carries both
            "bytes_per_step_per_worker": res["across"]["bytes_per_step"],
            "wire_ms_per_step": 1e3 * 2 * res["across"]["bytes_per_step"] / (ping["bandwidth_mb_s"] * 1e6),
            "step_ms": 1e3 * 1024 / rate["across"]}
    if res["mpi"]:
        print(f"MPI: {res['mpi']['library']} {res['mpi']['version']}")
    for n in names:
        x = res[n]
        extra = (f"  pull {x['pull_ms']:.2f} ms  push {x['push_ms']:.2f} ms  per step: "
                 + " ".join(f"{k} {v:.2f}" for k, v in x["phase_ms"].items())) if "pull_ms" in x else ""
        print(f"{n:14s} {x['samples_per_s']:>10,.0f} samples/s{extra}")
    if "wire" in res:
        ping, w = res["ping_pong"], res["wire"]
        print(f"ping-pong h0<->h1: 8 B round trip {ping['rtt_8b_ms']:.3f} ms; {ping['message_bytes']:,} B round trip "
              f"{ping['rtt_message_ms']:.3f} ms ({ping['bandwidth_mb_s']:,.0f} MB/s)")
        print(f"a step across hosts: {w['step_ms']:.2f} ms; its bytes on the wire (2 workers x "
              f"{w['bytes_per_step_per_worker']:,.0f} B) take {w['wire_ms_per_step']:.2f} ms at that bandwidth")
    targets = {"across_vs_one_host": ">= 0.5", "across_shared_vs_one_host": ">= 0.25", "across_vs_rpc_across": ">= 2",
               "push_vs_pull_across": "<= 1.5", "one_host_dynamic_vs_fixed": ">= 0.7", "across_dynamic_vs_fixed": ">= 0.7"}
    for k, v in res["ratios"].items():
        print(f"{k:26s} {v:.2f}  (target {targets[k]})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": {k: v for k, v in vars(args).items()}, **res}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
