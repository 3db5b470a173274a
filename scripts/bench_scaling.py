"""Scaling of the end-to-end DLRM job: 1 -> 3 workers (1 PS) and 1 -> 2 PS ranks (3 workers).

    .venv/bin/python scripts/bench_scaling.py [--steps 300] [--warmup 30] [--layouts 1+1,1+2,1+3,2+3]
                                              [--out results/bench_scaling.json]

Each point is `hpcps train` of examples/ctr.toml under mpiexec, timed from step --warmup to the
end from worker 0's per-step metrics (as scripts/bench_e2e.py). On a machine with fewer cores
than ranks the runs are oversubscribed: the output says so, and reports samples/s per core used
(min(ranks, CPUs)) and the efficiency against the smallest run per core.
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))

from bench_e2e import bench_hpcps  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "examples" / "ctr.toml"))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--layouts", default="1+1,1+2,1+3,2+3", help="PS+workers of each point, the first the base")
    ap.add_argument("--out", default="results/bench_scaling.json")
    a = ap.parse_args()
    cores = os.cpu_count() or 1
    layouts = [tuple(int(x) for x in point.split("+")) for point in a.layouts.split(",")]   # (PS, workers)
    points = []
    with tempfile.TemporaryDirectory() as tmp:
        for ps, w in layouts:
            r = bench_hpcps(a.config, a.steps, a.warmup, ps + w, tmp, extra=[f"job.num_ps={ps}"])
            used = min(ps + w, cores)
            points.append({"num_ps": ps, "workers": w, "ranks": ps + w, "cores_used": used,
                           "oversubscribed": ps + w > cores, "samples_per_s": r["samples_per_s"],
                           "per_core": r["samples_per_s"] / used})
    base = points[0]["per_core"]
    print(f"scaling on {cores} CPUs, {a.steps - a.warmup} timed steps of examples/ctr.toml:")
    for p in points:
        p["efficiency_per_core"] = p["per_core"] / base
        print(f"  {p['num_ps']} PS + {p['workers']} workers ({p['ranks']} ranks"
              f"{', oversubscribed' if p['oversubscribed'] else ''}): {p['samples_per_s']:9.0f} samples/s, "
              f"{p['per_core']:8.0f} per core, efficiency per core {p['efficiency_per_core']:.2f}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"cpus": cores, "points": points}, indent=1))
    print(f"  wrote {a.out}")


if __name__ == "__main__":
    sys.exit(main())
