"""hpcps against TorchRec, the standing peer: the same model, data, steps, optimizers and initial
rows, at equal ranks, alternating.

    .venv/bin/python scripts/bench_peers.py [--workloads main,large] [--ranks 2,4] [--steps 300]
        [--warmup 50] [--repeat 1] [--shardings table_wise,column_wise,table_column_wise,data_parallel]
        [--hosts 1 [--split-cpus]] [--dense-backend auto] [--large-scale 0.001] [--out results/bench_peers.json]

Needs the optional peers (`scripts/run setup --peers`: torchrec 1.8.0 and fbgemm-gpu-cpu 1.8.0,
which load with torch 2.13.0); without them it says so and exits 3. On this machine, or with --hosts H on H
pretend hosts (the ranks spread over them, hosts sharing the CPUs), for each workload and rank count N:
  hpcps            `hpcps train`, 1 PS + N-1 workers, deterministic sync (its defaults)
  torchrec_<type>  scripts/torchrec_peer.py: DistributedModelParallel over gloo, N trainers, every
                   table sharded <type> (the types TorchRec shards on CPU; row_wise it refuses there)
Workloads: main (examples/ctr.toml: 8 tables, dot interaction, batch 1024) and large
(examples/large.toml's 26 tables at data.scale --large-scale: 204k rows at 0.001, dim 128, the small dense part
of scripts/bench_host_loss.py, batch 512). Samples/s timed after --warmup steps; AUC on 20,000
held-out samples at the end. --repeat N runs N rounds, each starting with another contender; the
medians are reported. Prints hpcps / the best TorchRec sharding (target >= 1.5) and the AUC
difference (target within 0.003).
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
from bench_host_loss import SMALL_DENSE  # noqa: E402
from mpirun import CLUSTER, run_mpi  # noqa: E402

WORKLOADS = {"main": (ROOT / "examples" / "ctr.toml", []),
             "large": (ROOT / "examples" / "large.toml", ["data.scale=0.001", *SMALL_DENSE])}
EVAL = ["data.eval_samples=20000"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="main,large")
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--shardings", default="table_wise,column_wise,table_column_wise,data_parallel")
    p.add_argument("--hosts", type=int, default=1, help="pretend hosts (scripts/cluster.sh, needs root); 1: this machine")
    p.add_argument("--split-cpus", action="store_true",
                   help="with --hosts: each pretend host gets CPUs of its own (scripts/cluster.sh up --split-cpus), "
                        "as real hosts have; else they share this machine's and each sees them all")
    p.add_argument("--dense-backend", default="auto", help="hpcps's model.dense_backend (gloo: across TCP hosts)")
    p.add_argument("--large-scale", type=float, default=0.001,
                   help="data.scale of the large workload (0.01: 2.04M rows, 2.1 GB of rows and Adagrad state)")
    p.add_argument("--out", default="results/bench_peers.json")
    a = p.parse_args(argv)
    a.workloads, a.shardings = a.workloads.split(","), a.shardings.split(",")
    a.ranks = [int(x) for x in a.ranks.split(",")]
    if not set(a.workloads) <= set(WORKLOADS) or min(a.ranks) < 2 or a.steps <= a.warmup:
        p.error(f"--workloads from {sorted(WORKLOADS)}, --ranks of 2 or more, --steps above --warmup")
    return a


def have_torchrec() -> bool:
    try:
        import fbgemm_gpu  # noqa: F401
        import torchrec  # noqa: F401
    except Exception:
        return False
    return True


def spread(n: int, hosts: int) -> str | None:
    """``h0:a,h1:b,...``: ``n`` ranks over the pretend hosts (None: this machine)."""
    if hosts <= 1:
        return None
    return ",".join(f"h{h}:{n // hosts + (h < n % hosts)}" for h in range(hosts))


def gloo_env(args) -> dict | None:
    """Pretend hosts: gloo (TorchRec's, and hpcps's dense_backend = gloo) on their network's interface."""
    return {"GLOO_SOCKET_IFNAME": "eth0"} if args.hosts > 1 else None


def run_torchrec(args, cfg, sets, sharding: str, n: int) -> dict:
    r = run_mpi(n, [ROOT / "scripts" / "torchrec_peer.py", cfg, sharding, str(args.steps), str(args.warmup),
                    "--set", *sets, *EVAL], timeout=1200, hosts=spread(n, args.hosts), env=gloo_env(args))
    return json.loads([x for x in r.stdout.splitlines() if x.startswith('{"torchrec"')][0])["torchrec"]


def run_round(args, name: str, n: int, r: int, tmp) -> dict:
    cfg, sets = WORKLOADS[name]
    if name == "large":
        sets = [f"data.scale={args.large_scale}" if x.startswith("data.scale=") else x for x in sets]
    contenders = ["hpcps"] + [f"torchrec_{s}" for s in args.shardings]
    out = {}
    for c in contenders[r % len(contenders):] + contenders[:r % len(contenders)]:
        if c == "hpcps":
            x = bench_hpcps(str(cfg), args.steps, args.warmup, n, tmp, hosts=spread(n, args.hosts),
                            extra=[*sets, *EVAL, f"model.dense_backend={args.dense_backend}"],
                            env=gloo_env(args))
        else:
            x = run_torchrec(args, cfg, sets, c[len("torchrec_"):], n)
        out[c] = {"samples_per_s": x["samples_per_s"], "auc": x["auc"]}
        print(f"{name} {n} ranks, round {r + 1}: {c:28s} {x['samples_per_s']:>10,.0f} samples/s  AUC {x['auc']:.4f}",
              flush=True)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if not have_torchrec():
        print("bench_peers.py: TorchRec is not installed: `scripts/run setup --peers` installs torchrec 1.8.0 and "
              "fbgemm-gpu-cpu 1.8.0", file=sys.stderr)
        return 3
    res = {"config": vars(args), "cases": {}}
    if args.hosts > 1:
        os.environ["HPCPS_CLUSTER"] = os.environ.get("HPCPS_CLUSTER_BENCH", "bq")
        subprocess.run([str(CLUSTER), "up", str(args.hosts), *(["--split-cpus"] if args.split_cpus else [])],
                       check=True, capture_output=True, text=True)
    try:
        _cases(args, res)
    finally:
        if args.hosts > 1:
            subprocess.run([str(CLUSTER), "down", "--force"], capture_output=True, text=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {args.out}")
    return 0


def _cases(args, res) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.workloads:
            for n in args.ranks:
                rounds = [run_round(args, name, n, r, tmp) for r in range(args.repeat)]
                case = {c: {"samples_per_s": _median([x[c]["samples_per_s"] for x in rounds]),
                            "auc": _median([x[c]["auc"] for x in rounds])} for c in rounds[0]}
                peers = {c: v for c, v in case.items() if c != "hpcps"}
                best = max(peers, key=lambda c: peers[c]["samples_per_s"])
                case["best_torchrec"] = best
                case["hpcps_vs_best_torchrec"] = case["hpcps"]["samples_per_s"] / peers[best]["samples_per_s"]
                case["auc_hpcps_minus_best"] = case["hpcps"]["auc"] - peers[best]["auc"]
                res["cases"][f"{name}_{n}"] = case
                print(f"{name}, {n} ranks: hpcps {case['hpcps']['samples_per_s']:,.0f} vs {best} "
                      f"{peers[best]['samples_per_s']:,.0f} samples/s: {case['hpcps_vs_best_torchrec']:.2f}x "
                      f"(target >= 1.5); AUC {case['hpcps']['auc']:.4f} vs {peers[best]['auc']:.4f} "
                      f"(difference {case['auc_hpcps_minus_best']:+.4f}, target within 0.003)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
