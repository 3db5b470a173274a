"""16-bit pulls against float32: final AUC, samples/s and bytes moved, same job and data, one run.

    .venv/bin/python scripts/bench_pull_dtype.py [--steps 3000] [--ranks 4] [--transport auto]
        [--out results/bench_pull_dtype.json]

Runs the job of examples/ctr.toml (sync, Adagrad; evaluated on 50,000 held-out samples) three
times, with pipeline.pull_dtype = float32, bfloat16 and float16, and prints each one's AUC and
its difference from float32, samples/s and the ratio, and the bytes pulled+pushed per step
(worker 0). Tables, optimizer state and checkpoints stay float32 in all three.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from mpirun import run_mpi  # noqa: E402

DTYPES = ("float32", "bfloat16", "float16")


def run(config, dtype, steps, ranks, transport, tmp):
    metrics = Path(tmp) / f"{dtype}.jsonl"
    out = run_mpi(ranks, ["-m", "hpcps", "train", "--config", config, "--set", "metrics.progress=false",
                          f"metrics.path={metrics}", "job.eval_every=0", f"job.steps={steps}",
                          f"job.transport={transport}", f"pipeline.pull_dtype={dtype}"], timeout=3600).stdout
    final = [json.loads(line) for line in out.splitlines() if line.startswith('{"final"')][-1]["final"]
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    last = [r for r in recs if "bytes_per_ps" in r][-1]
    return {"auc": final["auc"], "logloss": final["logloss"], "planted_auc": final.get("planted_auc"),
            "samples_per_s": final["samples_per_s"], "bytes_per_step": sum(last["bytes_per_ps"]) / last["step"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "examples" / "ctr.toml"))
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--transport", choices=("auto", "rma"), default="auto")
    ap.add_argument("--out", default="results/bench_pull_dtype.json")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        res = {d: run(a.config, d, a.steps, a.ranks, a.transport, tmp) for d in DTYPES}
    base = res["float32"]
    for d in DTYPES:
        res[d]["auc_minus_float32"] = res[d]["auc"] - base["auc"]
        res[d]["samples_per_s_vs_float32"] = res[d]["samples_per_s"] / base["samples_per_s"]
        res[d]["bytes_vs_float32"] = res[d]["bytes_per_step"] / base["bytes_per_step"]
    report = {"config": {"file": a.config, "steps": a.steps, "ranks": a.ranks, "transport": a.transport},
              "results": res}
    print(f"pull_dtype, {a.ranks} ranks, {a.steps} steps, transport {a.transport}:")
    for d, r in res.items():
        print(f"  {d:9s} AUC {r['auc']:.4f} ({r['auc_minus_float32']:+.4f})  {r['samples_per_s']:9.0f} samples/s "
              f"({r['samples_per_s_vs_float32']:.2f}x)  {r['bytes_per_step'] / 1e3:7.1f} kB/step "
              f"({r['bytes_vs_float32']:.2f}x)")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1))
    print(f"  wrote {a.out}")


if __name__ == "__main__":
    sys.exit(main())
