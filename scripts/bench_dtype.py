"""16-bit pulls and pushes against float32: final AUC, samples/s and bytes moved, same job and
data, one run.

    .venv/bin/python scripts/bench_dtype.py [--steps 3000] [--ranks 4] [--transport auto]
        [--variants float32,pull_bf16,...] [--out results/bench_dtype.json]

Runs the job of examples/ctr.toml (sync, Adagrad; evaluated on 50,000 held-out samples) once per
variant, each a (pipeline.pull_dtype, pipeline.push_dtype) pair:

    float32      float32  / float32          pull_bf16 bfloat16 / float32
    pull_fp16    float16  / float32          push_bf16 float32  / bfloat16
    push_fp16    float32  / float16          both_bf16 bfloat16 / bfloat16
    both_fp16    float16  / float16

and prints each one's AUC and its difference from float32, samples/s and the ratio, and the bytes
pulled + pushed per step (worker 0). Tables, optimizer state and checkpoints stay float32 in all.
Through shared memory (`--transport auto` on one node) a 16-bit push moves float32 values (only
their rounding is 16-bit); `--transport rma` shows the bytes a push saves between nodes.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from mpirun import run_mpi  # noqa: E402

VARIANTS = {"float32": ("float32", "float32"), "pull_bf16": ("bfloat16", "float32"),
            "pull_fp16": ("float16", "float32"), "push_bf16": ("float32", "bfloat16"),
            "push_fp16": ("float32", "float16"), "both_bf16": ("bfloat16", "bfloat16"),
            "both_fp16": ("float16", "float16")}


def run(config, variant, steps, ranks, transport, tmp):
    pull, push = VARIANTS[variant]
    metrics = Path(tmp) / f"{variant}.jsonl"
    out = run_mpi(ranks, ["-m", "hpcps", "train", "--config", config, "--set", "metrics.progress=false",
                          f"metrics.path={metrics}", "job.eval_every=0", f"job.steps={steps}",
                          f"job.transport={transport}", f"pipeline.pull_dtype={pull}",
                          f"pipeline.push_dtype={push}"], timeout=3600).stdout
    final = [json.loads(line) for line in out.splitlines() if line.startswith('{"final"')][-1]["final"]
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    last = [r for r in recs if "bytes_per_ps" in r][-1]
    return {"pull_dtype": pull, "push_dtype": push, "auc": final["auc"], "logloss": final["logloss"],
            "planted_auc": final.get("planted_auc"), "samples_per_s": final["samples_per_s"],
            "bytes_per_step": sum(last["bytes_per_ps"]) / last["step"],
            "push_mailbox_full": final.get("pipeline", {}).get("push_mailbox_full", 0)}


def variants(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in names if v not in VARIANTS]
    if bad or "float32" not in names:
        raise argparse.ArgumentTypeError(f"variants must include float32 (the baseline) and be among "
                                         f"{', '.join(VARIANTS)}; got {text!r}")
    return names


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "examples" / "ctr.toml"))
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--transport", choices=("auto", "rma"), default="auto")
    ap.add_argument("--variants", type=variants, default=list(VARIANTS),
                    help=f"comma-separated, float32 included (default: all of {', '.join(VARIANTS)})")
    ap.add_argument("--out", default="results/bench_dtype.json")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        res = {v: run(a.config, v, a.steps, a.ranks, a.transport, tmp) for v in a.variants}
    base = res["float32"]
    for r in res.values():
        r["auc_minus_float32"] = r["auc"] - base["auc"]
        r["samples_per_s_vs_float32"] = r["samples_per_s"] / base["samples_per_s"]
        r["bytes_vs_float32"] = r["bytes_per_step"] / base["bytes_per_step"]
    report = {"config": {"file": a.config, "steps": a.steps, "ranks": a.ranks, "transport": a.transport},
              "results": res}
    print(f"pull and push dtypes, {a.ranks} ranks, {a.steps} steps, transport {a.transport}:")
    for v, r in res.items():
        print(f"  {v:9s} (pull {r['pull_dtype']:8s} push {r['push_dtype']:8s}) AUC {r['auc']:.4f} "
              f"({r['auc_minus_float32']:+.4f})  {r['samples_per_s']:9.0f} samples/s "
              f"({r['samples_per_s_vs_float32']:.2f}x)  {r['bytes_per_step'] / 1e3:7.1f} kB/step "
              f"({r['bytes_vs_float32']:.2f}x)" + (f"  mailbox full {r['push_mailbox_full']}x"
                                                  if r["push_mailbox_full"] else ""))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1))
    print(f"  wrote {a.out}")


if __name__ == "__main__":
    sys.exit(main())
