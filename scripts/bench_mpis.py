"""The same benchmarks on MPICH and on Open MPI in one run, and each ratio of Open MPI's against MPICH's.

    .venv/bin/python scripts/bench_mpis.py [--mpis mpich,openmpi] [--rounds 2] [--only sparse,e2e,hosts]
                                           [--out results/bench_mpis.json]

Each round runs, under each MPI in turn (the first MPI alternates between rounds, as this VM's speed
drifts), with scripts/run's set-up and exports for it (HPCPS_MPI):
  sparse   scripts/bench_sparse.py, 1 PS + 1 worker (--sparse-args to change it)
  e2e      scripts/bench_e2e.py (--e2e-args; default --steps 300, 4 ranks)
  hosts    scripts/bench_hosts.py on pretend hosts (--hosts-args; needs root)
Every ratio those benchmarks report (each against a baseline measured in its own run: a local gather,
torch.distributed.rpc, one host) is compared across the MPIs: the second MPI's ratio divided by the
first's of the same round, inverted for the ratios where lower is better (push / pull), so that 1
is parity and higher is better; the median over rounds. Target: >= 0.8 for each. Prints the table
and writes JSON with every run's report, each naming its MPI library and version.
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from mpirun import run_mpi, using_mpi  # noqa: E402

LOWER_IS_BETTER = {"push_vs_pull_across"}
TARGET = 0.8


def run_bench(name: str, mpi: str, extra: list, tmp: str) -> dict:
    """One benchmark's report (its JSON) under ``mpi``."""
    out = Path(tmp) / f"{name}-{mpi}.json"
    with using_mpi(mpi):
        if name == "sparse":
            run_mpi(2, [str(ROOT / "scripts" / "bench_sparse.py"), *extra, "--out", str(out)], timeout=1800)
        else:
            script = ROOT / "scripts" / f"bench_{name}.py"
            r = subprocess.run([sys.executable, str(script), *extra, "--out", str(out)], capture_output=True,
                               text=True, timeout=3600)
            if r.returncode != 0:
                raise RuntimeError(f"{script.name} under {mpi} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return json.loads(out.read_text())


def ratios_of(name: str, report: dict) -> dict:
    """The ratios a benchmark's report holds, by name."""
    if name == "e2e":
        return {k: report[k] for k in ("hpcps_vs_torch_rpc", "hpcps_per_core_vs_single_process", "pipeline_on_vs_off")}
    return dict(report["ratios"])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mpis", default="mpich,openmpi", help="two MPIs of scripts/run (HPCPS_MPI), the base first")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", default="sparse,e2e,hosts")
    ap.add_argument("--sparse-args", default="", help="arguments for bench_sparse.py (one string)")
    ap.add_argument("--e2e-args", default="", help="arguments for bench_e2e.py (one string)")
    ap.add_argument("--hosts-args", default="", help="arguments for bench_hosts.py (one string)")
    ap.add_argument("--out", default="results/bench_mpis.json")
    a = ap.parse_args()
    mpis = a.mpis.split(",")
    benches = [b for b in a.only.split(",") if b]
    if len(mpis) != 2 or a.rounds < 1 or not set(benches) <= {"sparse", "e2e", "hosts"}:
        ap.error("need two MPIs, --rounds >= 1 and --only from sparse,e2e,hosts")
    if "hosts" in benches and os.geteuid() != 0:
        ap.error("hosts needs root (pretend hosts); leave it out with --only sparse,e2e")
    extra = {"sparse": shlex.split(a.sparse_args), "e2e": shlex.split(a.e2e_args), "hosts": shlex.split(a.hosts_args)}
    reports = {b: {m: [] for m in mpis} for b in benches}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for b in benches:
                for m in (mpis if r % 2 == 0 else mpis[::-1]):
                    reports[b][m].append(run_bench(b, m, extra[b], tmp))
                    print(f"round {r + 1} {b} {m}: done", flush=True)
    base, other = mpis
    table = {}
    for b in benches:
        for k in ratios_of(b, reports[b][base][0]):
            per_round = []
            for x, y in zip(reports[b][base], reports[b][other]):
                rx, ry = ratios_of(b, x)[k], ratios_of(b, y)[k]
                per_round.append(rx / ry if k in LOWER_IS_BETTER else ry / rx)
            table[f"{b}.{k}"] = {base: float(np.median([ratios_of(b, x)[k] for x in reports[b][base]])),
                                 other: float(np.median([ratios_of(b, y)[k] for y in reports[b][other]])),
                                 f"{other}_vs_{base}": float(np.median(per_round)), "rounds": per_round}
    libs = {m: next(iter(reports[b][m][0].get("mpi") or {} for b in benches)) for m in mpis}
    print(f"{'ratio':44s} {base:>9s} {other:>9s}  {other} vs {base} (target >= {TARGET})")
    for k, v in table.items():
        verdict = "met" if v[f"{other}_vs_{base}"] >= TARGET else "NOT met"
        print(f"{k:44s} {v[base]:9.2f} {v[other]:9.2f}  {v[f'{other}_vs_{base}']:.2f}  {verdict}")
    for m in mpis:
        print(f"{m}: {libs[m].get('library')} {libs[m].get('version')}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"mpis": libs, "rounds": a.rounds, "target": TARGET, "ratios": table,
                                       "reports": reports}, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
