"""The cost of deterministic sync mode, measured against the arrival-order sums in the same run.

    .venv/bin/python scripts/bench_deterministic.py [--steps 3000] [--pairs 3] [--ranks 4]
                                                    [--out results/bench_deterministic.json]

Runs the main job (examples/ctr.toml: 1 PS + 3 workers, sync) with job.deterministic = true and
= false in alternation, --pairs times each (the pair's order alternates too: this VM's speed
drifts), and reports each one's samples/s and the ratio of the medians (target: deterministic
>= 0.95x, the condition for it to be on by default in sync mode). Each run also exports its
weights; the deterministic runs must agree bit for bit, which is reported too.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from mpirun import run_mpi  # noqa: E402


def run(ranks: int, steps: int, deterministic: bool, export: Path, config: str) -> float:
    """samples/s of one run of the main job; its weights go to ``export``."""
    sets = [f"job.steps={steps}", "job.eval_every=0", "metrics.progress=false", f"job.export={export}",
            f"job.deterministic={'true' if deterministic else 'false'}"]
    r = run_mpi(ranks, ["-m", "hpcps", "train", "--config", config, "--set", *sets], timeout=1800)
    final = [json.loads(line) for line in r.stdout.splitlines() if line.startswith('{"final"')][-1]["final"]
    return float(final["samples_per_s"])


def same_bits(paths) -> bool:
    first = np.load(paths[0])
    return all(all(np.array_equal(first[k], np.load(p)[k]) for k in first.files) for p in paths[1:])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "examples" / "ctr.toml"))
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--work", default="results/bench_deterministic", help="where the runs' exports go")
    ap.add_argument("--out", default="results/bench_deterministic.json")
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    got = {True: [], False: []}
    exports = []
    for i in range(a.pairs):
        for det in ((True, False) if i % 2 == 0 else (False, True)):
            export = work / f"{'det' if det else 'arrival'}-{i}.npz"
            got[det].append(run(a.ranks, a.steps, det, export, a.config))
            if det:
                exports.append(export)
            print(f"pair {i}: deterministic={det}: {got[det][-1]:,.0f} samples/s", flush=True)
    med = {det: statistics.median(v) for det, v in got.items()}
    report = {"steps": a.steps, "ranks": a.ranks, "pairs": a.pairs,
              "deterministic_samples_s": got[True], "arrival_order_samples_s": got[False],
              "median_deterministic": med[True], "median_arrival_order": med[False],
              "ratio": med[True] / med[False], "deterministic_runs_bit_equal": same_bits(exports)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1))
    print(f"median samples/s: deterministic {med[True]:,.0f}, arrival order {med[False]:,.0f}: "
          f"ratio {report['ratio']:.3f} (target >= 0.95); deterministic runs bit-equal: "
          f"{report['deterministic_runs_bit_equal']}")


if __name__ == "__main__":
    main()
