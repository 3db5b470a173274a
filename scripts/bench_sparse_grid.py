"""The sparse pull/push microbenchmark (scripts/bench_sparse.py) over a grid of sizes.

    .venv/bin/python scripts/bench_sparse_grid.py [--rows 1000000] [--batches 512 4096 65536]
        [--dims 16 64 256] [--num-ps 1 2] [--out results/bench_sparse_grid.json]

Each point runs bench_sparse.py under mpiexec with num_ps PS ranks and one worker, its
baselines (local numpy gather, local torch.index_add_, two-sided send/recv) measured in the
same launch on the same batches, with about --rows-per-point ids per measurement. Prints one
line per point (pull and push M rows/s and the ratios) and writes all points to JSON.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from mpirun import run_mpi  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000, help="table rows")
    ap.add_argument("--batches", type=int, nargs="+", default=[512, 4096, 65536])
    ap.add_argument("--dims", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--num-ps", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rows-per-point", type=int, default=400_000, help="ids per measurement")
    ap.add_argument("--out", default="results/bench_sparse_grid.json")
    a = ap.parse_args()
    points = []
    print(f"{'PS':>3} {'dim':>4} {'batch':>6} | {'pull M/s':>8} {'push M/s':>8} | {'pull/gather':>11} "
          f"{'pull/2-sided':>12} {'push/index_add':>14} {'rma pull/2-sided':>16}")
    with tempfile.TemporaryDirectory() as tmp:
        for ps in a.num_ps:
            for dim in a.dims:
                for batch in a.batches:
                    out = Path(tmp) / f"p{ps}-d{dim}-b{batch}.json"
                    iters = max(4, a.rows_per_point // batch)
                    run_mpi(ps + 1, [ROOT / "scripts" / "bench_sparse.py", "--rows", a.rows, "--dim", dim,
                                     "--batch", batch, "--iters", iters, "--num-ps", ps, "--out", out],
                            timeout=1200)
                    r = json.loads(out.read_text())
                    m, q = r["per_worker_mrows_per_s"], r["ratios"]
                    points.append({"num_ps": ps, "dim": dim, "batch": batch, "iters": iters,
                                   "pull_mrows_per_s": m["hpcps_auto_pull"], "push_mrows_per_s": m["hpcps_auto_push"],
                                   **q, "raw": r})
                    print(f"{ps:>3} {dim:>4} {batch:>6} | {m['hpcps_auto_pull']:8.2f} {m['hpcps_auto_push']:8.2f} | "
                          f"{q['pull_vs_local_gather']:10.2f}x {q['pull_vs_two_sided']:11.2f}x "
                          f"{q['push_vs_local_index_add']:13.2f}x {q['rma_pull_vs_two_sided']:15.2f}x", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"rows": a.rows, "points": points,
                                       "targets": {"pull_vs_local_gather": 0.8, "pull_vs_two_sided": 1.5,
                                                   "push_vs_local_index_add": 0.5}}, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    sys.exit(main())
