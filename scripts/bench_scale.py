"""Counted, not timed: how hpcps' traffic, memory, start-up and checkpoints grow with the workers
W and the PS ranks P (on 2 cores, time at 32 ranks says little; counts do not depend on it).

    .venv/bin/python scripts/bench_scale.py [--workers 2,4,8,16,24] [--ps 1,2,4,8] [--at-ps 4]
        [--at-workers 8] [--scale 0.001] [--steps 6] [--out results/bench_scale.json]

Every run is examples/large.toml (26 tables, dim 128, Adagrad, deterministic sync, global batch
512) with data.scale --scale and a small dense part, on one host with job.transport=rma (every
pull and push is an MPI one-sided operation, as between nodes), HPCPS_COUNT_MPI=1 (each rank
counts its operations: hpcps.core.counts) and a filesystem checkpoint at the last step. The runs:
W over --workers at P = --at-ps, and P over --ps at W = --at-workers.

For each it records, per training step: each worker's one-sided operations, bytes and round trips
to the PS ranks (and to other workers: the step control), its dense all-reduces and their bytes;
each PS's operations and bytes received and rows applied. Once per run: start-up (a process's age
at its first step), peak RSS per rank, the PS's table bytes (rows, optimizer state, mailboxes),
and the checkpoint's files and bytes. Then it fits each quantity's growth exponent against W and
against P (log-log least squares) and prints it beside the exponent of its data: a quantity that
grows faster (by 0.3 or more) is marked FASTER. Writes everything to --out.
"""

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from mpirun import run_mpi  # noqa: E402

SMALL_DENSE = ["model.bottom_mlp=[64]", "model.top_mlp=[64,32]", "model.cross_rank=32"]

# quantity -> (the exponent of its data against W, against P): what it should grow as
EXPECTED = {
    "worker_ops_to_ps": (0, 1),          # one read and one push per table and PS, whatever W
    "worker_bytes_to_ps": (-1, 0),       # the worker's share of the global batch
    "worker_round_trips_to_ps": (0, 1),
    "worker_ops_to_workers": (0, 0),     # the step control
    "worker_allreduce_bytes": (0, 0),    # the dense gradients
    "worker_setup_ops": (0, 1),          # outside the steps (start-up, the final evaluation, the checkpoint)
    "ps_ops_received": (1, 0),           # every worker reads from and pushes to every PS each step
    "ps_bytes_received": (0, -1),        # the global batch's rows, spread over the PS
    "ps_rows_applied": (0, -1),
    "ps_table_mb": (0, -1),              # rows and state of a shard, mailboxes capped per PS
    "ps_peak_rss_mb": (0, -1),
    "worker_peak_rss_mb": (0, 0),
    "startup_s": (0, 0),
    "checkpoint_files_per_ps": (0, 0),
    "checkpoint_mb": (0, 0),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="2,4,8,16,24", help="W of the runs at P = --at-ps")
    p.add_argument("--ps", default="1,2,4,8", help="P of the runs at W = --at-workers")
    p.add_argument("--at-ps", type=int, default=4)
    p.add_argument("--at-workers", type=int, default=8)
    p.add_argument("--scale", type=float, default=0.001, help="data.scale of examples/large.toml")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default="results/bench_scale.json")
    a = p.parse_args(argv)
    a.workers = [int(x) for x in a.workers.split(",")]
    a.ps = [int(x) for x in a.ps.split(",")]
    if min(a.workers + a.ps + [a.at_ps, a.at_workers]) < 1 or a.steps < 2:
        p.error("workers and PS counts must be at least 1, --steps at least 2")
    return a


def _per_target(counts: list, key: str, targets) -> list:
    """For each worker: its per-step ``key`` (ops, bytes, round_trips) to ``targets``."""
    return [sum(c["steps"][key].get(str(t), 0) for t in targets) for c in counts if not c["ps"]]


def figures(final: dict, ck: Path, steps: int) -> dict:
    """The per-step and per-run quantities of one run's final summary and checkpoint."""
    counts = final["counts"]
    ps = [r for r, c in enumerate(counts) if c["ps"]]
    workers = [r for r, c in enumerate(counts) if not c["ps"]]
    ran = steps - final["start_step"]
    per = lambda xs: median(xs) / ran  # noqa: E731
    out = {"P": len(ps), "W": len(workers),
           "worker_ops_to_ps": per(_per_target(counts, "ops", ps)),
           "worker_bytes_to_ps": per(_per_target(counts, "bytes", ps)),
           "worker_round_trips_to_ps": per(_per_target(counts, "round_trips", ps + [-1])),
           "worker_ops_to_workers": per(_per_target(counts, "ops", workers)),
           "worker_allreduce_calls": per([counts[w]["steps"]["allreduce_calls"] for w in workers]),
           "worker_allreduce_bytes": per([counts[w]["steps"]["allreduce_bytes"] for w in workers]),
           "worker_setup_ops": median(sum(counts[w]["total"]["ops"].values()) - sum(counts[w]["steps"]["ops"].values())
                                      for w in workers)}
    rec = {p: (sum(counts[w]["steps"]["ops"].get(str(p), 0) for w in workers),
               sum(counts[w]["steps"]["bytes"].get(str(p), 0) for w in workers)) for p in ps}
    out["ps_ops_received"] = median(o for o, _ in rec.values()) / ran
    out["ps_bytes_received"] = median(b for _, b in rec.values()) / ran
    out["ps_rows_applied"] = median(counts[p]["rows_applied"] for p in ps) / ran
    mem = final["memory"]
    out["ps_table_mb"] = max(mem["ps_table_mb"])
    out["ps_peak_rss_mb"] = max(mem["ps_peak_rss_mb"])
    out["worker_peak_rss_mb"] = max(mem["worker_peak_rss_mb"])
    out["startup_s"] = max(counts[w]["startup_s"] for w in workers)
    step_dir = ck / f"step-{steps:09d}"
    files = [f for f in step_dir.rglob("*") if f.is_file()]
    out["checkpoint_files"] = len(files)
    out["checkpoint_files_per_ps"] = len(files) / len(ps)
    out["checkpoint_mb"] = sum(f.stat().st_size for f in files) / 1e6
    return out


def run_one(args, P: int, W: int, tmp: Path) -> dict:
    ck = tmp / f"ck-{P}-{W}"
    sets = [f"data.scale={args.scale}", f"job.num_ps={P}", f"job.steps={args.steps}", *SMALL_DENSE,
            "job.transport=rma", "metrics.progress=false", "data.eval_samples=2000", f"checkpoint.dir={ck}",
            f"checkpoint.every_steps={args.steps}"]
    t = time.perf_counter()
    r = run_mpi(P + W, ["-m", "hpcps", "train", "--config", ROOT / "examples" / "large.toml", "--set", *sets],
                timeout=args.timeout, env={"HPCPS_COUNT_MPI": "1"})
    final = json.loads([x for x in r.stdout.splitlines() if x.startswith('{"final"')][0])["final"]
    out = figures(final, ck, args.steps)
    out["launch_s"] = time.perf_counter() - t
    subprocess.run(["rm", "-rf", str(ck)], check=False)
    return out


def exponent(xs, ys) -> float | None:
    """The slope of log y against log x (least squares); None where it is not defined."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y > 0]
    if len(pts) < 2 or len({x for x, _ in pts}) < 2:
        return None
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def fits(runs: list, by: str) -> dict:
    """``{quantity: {"exponent", "data", "faster"}}`` of ``runs`` against ``by`` ("W" or "P")."""
    out = {}
    for q, (ew, ep) in EXPECTED.items():
        e = exponent([r[by] for r in runs], [r[q] for r in runs])
        want = ew if by == "W" else ep
        out[q] = {"exponent": e, "data": want, "faster": e is not None and e >= want + 0.3}
    return out


def show(title: str, runs: list, fit: dict, by: str) -> None:
    print(f"\n{title}")
    print(f"{'quantity':26s}" + "".join(f"{by}={r[by]:<10d}" for r in runs) + " exponent (data)")
    for q, f in fit.items():
        e = "n/a" if f["exponent"] is None else f"{f['exponent']:+.2f}"
        print(f"{q:26s}" + "".join(f"{r[q]:<12.4g}" for r in runs) + f" {e} ({f['data']:+d})"
              + ("  FASTER" if f["faster"] else ""))


def main(argv=None) -> int:
    args = parse_args(argv)
    res = {"config": {k: v for k, v in vars(args).items()}, "by_workers": [], "by_ps": []}
    with tempfile.TemporaryDirectory(prefix="hpcps-scale-") as tmp:
        done = {}
        for W in args.workers:
            done[(args.at_ps, W)] = run_one(args, args.at_ps, W, Path(tmp))
            res["by_workers"].append(done[(args.at_ps, W)])
            print(f"P={args.at_ps} W={W}: {done[(args.at_ps, W)]['launch_s']:.0f} s", flush=True)
        for P in args.ps:
            if (P, args.at_workers) not in done:
                done[(P, args.at_workers)] = run_one(args, P, args.at_workers, Path(tmp))
                print(f"P={P} W={args.at_workers}: {done[(P, args.at_workers)]['launch_s']:.0f} s", flush=True)
            res["by_ps"].append(done[(P, args.at_workers)])
    res["fit_workers"] = fits(res["by_workers"], "W")
    res["fit_ps"] = fits(res["by_ps"], "P")
    show(f"against W (P = {args.at_ps}), per step unless named", res["by_workers"], res["fit_workers"], "W")
    show(f"against P (W = {args.at_workers})", res["by_ps"], res["fit_ps"], "P")
    faster = [f"{q} vs {by}" for by, k in (("W", "fit_workers"), ("P", "fit_ps"))
              for q, f in res[k].items() if f["faster"]]
    res["faster_than_data"] = faster
    print(f"\ngrowing faster than its data: {', '.join(faster) if faster else 'none'}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
