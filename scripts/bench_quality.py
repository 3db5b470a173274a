"""Model quality on real click logs: choose settings by cross-validation, then measure them once on
a held-out test split, against ``hpcps baseline`` (hashed logistic regression) on the same splits.

    .venv/bin/python scripts/bench_quality.py --data NAME=CONFIG:FILE[;KEY=VALUE...] [--data ...] [--rows N]
        [--folds 3] [--test 0.2] [--candidates FILE.json] [--kinds lr,wide_deep,...] [--ranks 3]
        [--out results/bench_quality.json]

For each data set (a file in CONFIG's format, e.g. ``examples/criteo.toml`` and a Criteo sample;
``;KEY=VALUE`` settings after the file adapt the config to it, e.g. another CSV's label column):
its lines (after a CSV header, kept on every part) are shuffled (seed 0), at most ``--rows`` kept,
and a ``--test`` fraction held out; the rest is cut into ``--folds`` folds. Each candidate (a list
of ``--set`` overrides; ``--candidates`` a JSON {name: [overrides]}, default: the config as it is)
trains on K-1 folds and is evaluated on the remaining one, K times; the baseline likewise. The
selection score is the mean over folds of (candidate AUC - baseline AUC); the test split is not
read while choosing. Then the config as shipped, and each of ``--kinds`` with the shipped settings
otherwise, train on all the folds and are evaluated once on the test split. Every run is
``hpcps train`` under ``mpiexec -n --ranks`` (1 PS + the rest workers), as a user runs it.
Prints the tables and writes JSON.
"""

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from mpirun import run_mpi  # noqa: E402

from hpcps.config import load_config  # noqa: E402


def split_lines(path: Path, fmt: str, rows: int, test: float, folds: int, seed: int = 0):
    """``(header, test lines, [fold lines])`` of a shuffled file."""
    lines = [line + "\n" for line in path.read_text().splitlines() if line.strip()]
    header = []
    if fmt == "csv":
        header, lines = lines[:1], lines[1:]
    random.Random(seed).shuffle(lines)
    lines = lines[:rows] if rows else lines
    n_test = int(len(lines) * test)
    rest = lines[n_test:]
    return header, lines[:n_test], [rest[i::folds] for i in range(folds)]


def write(path: Path, header: list, lines: list) -> Path:
    path.write_text("".join(header + lines))
    return path


def train_auc(config: str, sets: list, train: Path, evaluation: Path, ranks: int) -> dict:
    """``hpcps train``'s final line on a train/eval pair: its eval AUC, the best evaluation's, epochs."""
    argv = ["-m", "hpcps", "train", "--config", config, "--set", f"data.path={train}",
            f"data.eval_path={evaluation}", "metrics.path=", "metrics.progress=false", "job.export=",
            "job.export_best=false", "checkpoint.dir=", "checkpoint.keep_best=", *sets]
    r = run_mpi(ranks, argv, timeout=1800)
    final = [json.loads(l)["final"] for l in r.stdout.splitlines() if l.startswith('{"final"')][0]
    return {"auc": final["auc"], "best_auc": (final.get("best") or {}).get("auc", final["auc"]),
            "steps": final["steps"], "logloss": final["logloss"]}


def baseline_auc(config: str, train: Path, evaluation: Path, extra=()) -> float:
    r = subprocess.run([sys.executable, "-m", "hpcps", "baseline", "--config", config, "--set", f"data.path={train}",
                        f"data.eval_path={evaluation}", *extra], capture_output=True, text=True, timeout=1800, cwd=ROOT)
    if r.returncode:
        raise RuntimeError(r.stderr[-2000:])
    return json.loads(r.stdout.strip().splitlines()[-1])["baseline"]["auc"]


def cross_validate(config, header, folds, candidates, ranks, tmp: Path, extra=()) -> dict:
    """Each candidate's (and the baseline's) AUC on each fold held out."""
    out = {name: [] for name in candidates}
    out.update({f"{name} (best evaluation)": [] for name in candidates})
    out["baseline"] = []
    for k in range(len(folds)):
        train = write(tmp / f"cv{k}-train", header, [l for i, f in enumerate(folds) if i != k for l in f])
        valid = write(tmp / f"cv{k}-valid", header, folds[k])
        out["baseline"].append(baseline_auc(config, train, valid, extra))
        for name, sets in candidates.items():
            got = train_auc(config, [*extra, *sets], train, valid, ranks)
            out[name].append(got["auc"])
            out[f"{name} (best evaluation)"].append(got["best_auc"])
            print(f"  fold {k} {name}: {out[name][-1]:.4f} (baseline {out['baseline'][-1]:.4f})", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", action="append", required=True, help="NAME=CONFIG:FILE")
    ap.add_argument("--rows", type=int, default=0, help="at most this many lines of each file (0: all)")
    ap.add_argument("--folds", type=int, default=3)
    ap.add_argument("--test", type=float, default=0.2)
    ap.add_argument("--candidates", default="", help="JSON file {name: [--set overrides]} to choose among")
    ap.add_argument("--kinds", default="lr,wide_deep,deepfm,dcn,dlrm", help="kinds measured on the test split")
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--out", default="results/bench_quality.json")
    args = ap.parse_args()
    candidates = json.loads(Path(args.candidates).read_text()) if args.candidates else {"shipped": []}
    report = {"folds": args.folds, "test_fraction": args.test, "ranks": args.ranks, "data": {}}
    for spec in args.data:
        name, rest = spec.split("=", 1)
        rest, *extra = rest.split(";")
        config, path = rest.rsplit(":", 1)
        fmt = load_config(config, [f"data.path={path}", *extra]).data.format
        header, test, folds = split_lines(Path(path), fmt, args.rows, args.test, args.folds)
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            print(f"{name}: {sum(map(len, folds))} lines in {args.folds} folds, {len(test)} held out", flush=True)
            cv = cross_validate(config, header, folds, candidates, args.ranks, tmp, extra)
            base = np.array(cv["baseline"])
            scores = {c: float(np.mean(np.array(v) - base)) for c, v in cv.items() if c != "baseline"}
            train = write(tmp / "train", header, [l for f in folds for l in f])
            held = write(tmp / "test", header, test)
            rows = {"baseline": baseline_auc(config, train, held, extra)}
            for kind in ["shipped"] + [k for k in args.kinds.split(",") if k]:
                sets = [] if kind == "shipped" else [f"model.kind={kind}"]
                rows[kind] = train_auc(config, [*extra, *sets], train, held, args.ranks)
                print(f"  test {kind}: {rows[kind]['auc']:.4f} (baseline {rows['baseline']:.4f})", flush=True)
        report["data"][name] = {"config": config, "file": path, "settings": extra, "train_lines": sum(map(len, folds)),
                                "test_lines": len(test), "cv": cv, "cv_score_vs_baseline": scores, "test": rows}
        print(f"\n{name} (test split, AUC; baseline {rows['baseline']:.4f})")
        for kind, r in rows.items():
            if kind != "baseline":
                print(f"  {kind:10s} {r['auc']:.4f}  {r['auc'] - rows['baseline']:+.4f}  ({r['steps']} steps)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
