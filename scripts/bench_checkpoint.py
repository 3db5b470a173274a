"""Checkpoint benchmark with its baselines measured in the same run.

    .venv/bin/python scripts/bench_checkpoint.py [--dir /scratch/me/bench-ckpt] [--ranks 4]

Runs `hpcps train` on the synthetic DLRM job (1 PS + workers) with a large table and reports:
  write bandwidth   checkpoint bytes / (request -> commit, checksums and fsyncs included),
                    against `dd ... conv=fsync` of the same number of bytes to the same directory
                    (target >= 0.7x)
  training stall    the pause per checkpoint, as a share of a 60 s interval (target <= 2%)
  incremental size  a checkpoint holding only rows changed since the previous one, against the
                    full one, on the Zipf workload after a short interval (target >= 6x smaller)
  restart time      start of a resumed job to its first step, against the bytes it read
Writes JSON (--out) and prints the ratios.
"""

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from mpirun import run_mpi  # noqa: E402



def final(stdout):
    return [json.loads(line) for line in stdout.splitlines() if line.startswith('{"final"')][-1]["final"]


def dd(path: Path, nbytes: int) -> float:
    count = max(1, nbytes // (4 << 20))
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=4M", f"count={count}", "conv=fsync"],
                   check=True, capture_output=True)
    dt = time.perf_counter() - t0
    path.unlink()
    return count * (4 << 20) / dt


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="results/bench-ckpt")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rows", type=int, default=400_000, help="rows per table (8 tables, dim 16)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default="results/bench_checkpoint.json")
    a = ap.parse_args()
    root = Path(a.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    base = ["-m", "hpcps", "train", "--config", ROOT / "examples" / "ctr.toml", "--set",
            f"data.rows_per_table={a.rows}", "data.eval_samples=2000", "metrics.progress=false", "metrics.path=",
            "job.eval_every=0"]
    # 1. full checkpoints every 10 steps: bandwidth and stall
    full_dir = root / "full"
    r = run_mpi(a.ranks, base + [f"checkpoint.dir={full_dir}", "checkpoint.every_steps=10", "checkpoint.keep=1",
                                 f"job.steps={a.steps}"], timeout=1200)
    f = final(r.stdout)
    timings = f["checkpoint_timings"]
    nbytes = max(t["bytes"] for t in timings)
    bw = [t["bytes"] / t["write_s"] for t in timings]
    dd_bw = dd(root / "dd.bin", nbytes)
    stall = max(t["stall_s"] for t in timings)
    # 2. incremental: a full one, then one holding the rows of the next 10 steps only
    inc_dir = root / "inc"
    r = run_mpi(a.ranks, base + [f"checkpoint.dir={inc_dir}", "checkpoint.every_steps=10", "checkpoint.full_every=100",
                                 "checkpoint.keep=0", "job.steps=20"], timeout=1200)
    inc = {t["kind"]: t["bytes"] for t in final(r.stdout)["checkpoint_timings"]}
    # 3. restart: resume the full run and time start -> first step
    t0 = time.perf_counter()
    r = run_mpi(a.ranks, base + [f"checkpoint.dir={full_dir}", f"job.steps={a.steps + 1}"], timeout=1200)
    wall = time.perf_counter() - t0
    rf = final(r.stdout)
    report = {
        "config": {"ranks": a.ranks, "rows_per_table": a.rows, "tables": 8, "dim": 16, "dir": str(root)},
        "checkpoint_bytes": nbytes,
        "write_bandwidth_mb_s": max(bw) / 1e6, "dd_bandwidth_mb_s": dd_bw / 1e6,
        "write_vs_dd": max(bw) / dd_bw,
        "stall_s": stall, "stall_share_of_60s": stall / 60,
        "incremental_bytes": inc.get("delta"), "full_bytes": inc.get("full"),
        "incremental_ratio": inc["full"] / inc["delta"] if inc.get("delta") else None,
        "restore_s": rf["restore_s"], "restore_mb_s": nbytes / max(rf["restore_s"], 1e-9) / 1e6,
        "resumed_job_wall_s": wall,
        "targets": {"write_vs_dd": 0.7, "stall_share_of_60s": 0.02, "incremental_ratio": 6.0},
    }
    print(f"checkpoint bench: {nbytes / 1e6:.1f} MB per full checkpoint, {a.ranks} ranks")
    print(f"  write {report['write_bandwidth_mb_s']:.0f} MB/s vs dd {report['dd_bandwidth_mb_s']:.0f} MB/s: "
          f"{report['write_vs_dd']:.2f}x (target >= 0.7)")
    print(f"  stall {stall * 1e3:.0f} ms per checkpoint = {100 * stall / 60:.2f}% of a 60 s interval (target <= 2%)")
    if report["incremental_ratio"]:
        print(f"  incremental {inc['delta'] / 1e6:.2f} MB vs full {inc['full'] / 1e6:.2f} MB: "
              f"{report['incremental_ratio']:.1f}x smaller (target >= 6)")
    print(f"  restore {rf['restore_s']:.2f} s for {nbytes / 1e6:.1f} MB ({report['restore_mb_s']:.0f} MB/s)")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1))
    print(f"  wrote {a.out}")


if __name__ == "__main__":
    sys.exit(main())
