"""Model quality on real click logs: choose settings by cross-validation, then measure them once on
a held-out test split, against ``hpcps baseline`` (hashed logistic regression) on the same rows.

    .venv/bin/python scripts/bench_quality.py --data NAME=CONFIG:FILE[;KEY=VALUE...] [--data ...] [--rows N]
        [--folds 3] [--test 0.2] [--candidates FILE.json] [--kinds lr,...] [--tune N] [--tune-folds K] [--ranks 3]
        [--out results/bench_quality.json]

For each data set (a file in CONFIG's format, e.g. ``examples/criteo.toml`` and a Criteo sample;
``;KEY=VALUE`` settings after the file adapt the config to it, e.g. another CSV's label column):
its lines (after a CSV header, kept on every part) are shuffled (seed 0), at most ``--rows`` kept,
and a ``--test`` fraction held out; the rest is cut into ``--folds`` folds.

Every measurement trains on some rows and scores once on rows it never saw. ``hpcps train`` gets
the training rows less every k-th line (k = 1 / the config's ``data.eval_fraction``), which it
evaluates each epoch for early stopping and keeps the best of (``job.restore_best``); its final
checkpoint is then scored on the held-out rows by ``hpcps evaluate``. ``hpcps baseline`` trains on
the same rows (less the same lines: the split ``hpcps train`` and ``hpcps baseline`` share) and is
scored on the same held-out rows.

Each candidate (a list of ``--set`` overrides; ``--candidates`` a JSON {name: [overrides]},
default: the config as shipped) is cross-validated: trained on K-1 folds, scored on the remaining
one, K times; the baseline likewise. The test split is read once per model, at the end: the
baseline, the config as shipped, each of ``--kinds`` with the shipped settings otherwise, and with
``--tune N`` the best of an N-trial ``hpcps tune`` over the config's ``[tune.space]`` (its trials
train on the training rows less the same lines and are judged on those lines; with
``--tune-folds K`` each trial is cross-validated on K folds of the training rows, ``tune.folds``;
the test split is not read while tuning). Every run is ``hpcps train`` under ``mpiexec -n --ranks`` (1 PS + the rest
workers), as a user runs it. Prints the tables and writes JSON.
"""

import argparse
import json
import random
import shutil
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


class Runner:
    """Runs on one data set: its config and settings, a temporary folder, the rank count."""

    def __init__(self, name: str, config: str, extra: list, header: list, tmp: Path, ranks: int, fraction: float):
        self.name, self.config, self.extra, self.header, self.tmp, self.ranks = name, config, list(extra), header, tmp, ranks
        self.every = max(2, round(1 / fraction)) if fraction > 0 else 10

    def split(self, name: str, lines: list) -> tuple:
        """Training rows ``lines`` as (rows to train on, every k-th line: early stopping's)."""
        return (write(self.tmp / f"{name}-train", self.header, [x for i, x in enumerate(lines) if i % self.every]),
                write(self.tmp / f"{name}-valid", self.header, lines[::self.every]))

    def baseline(self, train: Path, held: Path) -> float:
        r = subprocess.run([sys.executable, "-m", "hpcps", "baseline", "--config", self.config, "--set",
                            f"data.path={train}", f"data.eval_path={held}", *self.extra], capture_output=True,
                           text=True, timeout=3600, cwd=ROOT)
        if r.returncode:
            raise RuntimeError(r.stderr[-2000:])
        return json.loads(r.stdout.strip().splitlines()[-1])["baseline"]["auc"]

    def train(self, sets: list, train: Path, valid: Path, held: Path, config: str | None = None) -> dict:
        """Train on ``train`` (early stopping on ``valid``), score the final model on ``held``."""
        ck = self.tmp / "ck"
        argv = ["-m", "hpcps", "train", "--config", config or self.config, "--set", f"data.path={train}",
                f"data.eval_path={valid}", "metrics.path=", "metrics.progress=false", "job.export=",
                "job.export_best=false", f"checkpoint.dir={ck}", *self.extra, *sets]
        r = run_mpi(self.ranks, argv, timeout=3600)
        final = [json.loads(x)["final"] for x in r.stdout.splitlines() if x.startswith('{"final"')][0]
        last = ck / (ck / "latest").read_text().strip()
        e = run_mpi(2, ["-m", "hpcps", "evaluate", "--checkpoint", str(last), "--data", str(held)], timeout=1800)
        got = [json.loads(x)["evaluate"] for x in e.stdout.splitlines() if x.startswith('{"evaluate"')][0][0]
        shutil.rmtree(ck)
        return {"auc": got["auc"], "logloss": got["logloss"], "steps": final["steps"],
                "best_step": (final.get("best") or {}).get("step"), "valid_auc": final["auc"]}

    def tune(self, trials: int, train: Path, valid: Path, folds: int = 0, everything: Path | None = None) -> str:
        """``hpcps tune`` over the config's space on these rows (``folds``: cross-validated trials
        over ``everything``, the training rows whole); the best config's path."""
        study = self.tmp / "tune"
        rows = [f"data.path={train}", f"data.eval_path={valid}"] if not folds else \
            [f"data.path={everything}", "data.eval_path=", f"tune.folds={folds}"]
        r = subprocess.run([sys.executable, "-m", "hpcps", "tune", "--config", self.config, "--set", *rows,
                            f"tune.study={study}",
                            f"tune.trials={trials}", f"tune.ranks={self.ranks}", *self.extra],
                           capture_output=True, text=True, timeout=6 * 3600, cwd=ROOT)
        if r.returncode:
            raise RuntimeError(r.stderr[-2000:])
        out = json.loads(r.stdout.strip().splitlines()[-1])["tune"]
        keep = ROOT / "results" / f"tuned-{self.name}.toml"
        keep.parent.mkdir(exist_ok=True)
        shutil.copy(out["best_config"], keep)
        print(f"  tune: {out['complete']} complete, {out['pruned']} pruned; best trial {out['best']['trial']}: "
              f"{out['best']['values']} (validation AUC {out['best']['auc']:.4f}); {keep}", flush=True)
        return str(keep)


def cross_validate(run: Runner, folds, candidates) -> dict:
    """Each candidate's (and the baseline's) AUC on each fold held out."""
    out = {name: [] for name in candidates}
    out["baseline"] = []
    for k in range(len(folds)):
        train, valid = run.split(f"cv{k}", [x for i, f in enumerate(folds) if i != k for x in f])
        held = write(run.tmp / f"cv{k}-held", run.header, folds[k])
        out["baseline"].append(run.baseline(train, held))
        for name, sets in candidates.items():
            out[name].append(run.train(sets, train, valid, held)["auc"])
            print(f"  fold {k} {name}: {out[name][-1]:.4f} (baseline {out['baseline'][-1]:.4f})", flush=True)
    return out


def measure(name: str, spec: str, args, candidates) -> dict:
    """Cross-validation, then the test split once, for one ``--data`` item."""
    rest, *extra = spec.split(";")
    config, path = rest.rsplit(":", 1)
    data = load_config(config, [f"data.path={path}", *extra]).data
    header, test, folds = split_lines(Path(path), data.format, args.rows, args.test, args.folds)
    with tempfile.TemporaryDirectory() as tmp:
        run = Runner(name, config, extra, header, Path(tmp), args.ranks, data.eval_fraction)
        print(f"{name}: {sum(map(len, folds))} lines in {args.folds} folds, {len(test)} held out", flush=True)
        cv = cross_validate(run, folds, candidates) if args.folds > 1 else {}
        base = np.array(cv.get("baseline", []))
        scores = {c: {"mean": float(np.mean(np.array(v) - base)), "min": float(np.min(np.array(v) - base))}
                  for c, v in cv.items() if c != "baseline"}
        train, valid = run.split("all", [x for f in folds for x in f])
        held = write(run.tmp / "test", header, test)
        rows = {"baseline": {"auc": run.baseline(train, held)}}
        todo = {"shipped": []} | {k: [f"model.kind={k}"] for k in args.kinds.split(",") if k}
        for kind, sets in todo.items():
            rows[kind] = run.train(sets, train, valid, held)
            print(f"  test {kind}: {rows[kind]['auc']:.4f} (baseline {rows['baseline']['auc']:.4f})", flush=True)
        if args.tune:
            everything = write(run.tmp / "tune-rows", header, [x for f in folds for x in f])    # train + valid
            best = run.tune(args.tune, train, valid, args.tune_folds, everything)
            rows["tuned"] = {**run.train([], train, valid, held, config=best), "config": best}
            print(f"  test tuned: {rows['tuned']['auc']:.4f}", flush=True)
    return {"config": config, "file": path, "settings": extra, "train_lines": sum(map(len, folds)),
            "test_lines": len(test), "cv": cv, "cv_vs_baseline": scores, "test": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", action="append", required=True, help="NAME=CONFIG:FILE[;KEY=VALUE...]")
    ap.add_argument("--rows", type=int, default=0, help="at most this many lines of each file (0: all)")
    ap.add_argument("--folds", type=int, default=3, help="cross-validation folds (1: none, the test split only)")
    ap.add_argument("--test", type=float, default=0.2)
    ap.add_argument("--candidates", default="", help="JSON file {name: [--set overrides]} to choose among")
    ap.add_argument("--kinds", default="lr", help="kinds also measured on the test split, the shipped settings otherwise")
    ap.add_argument("--tune", type=int, default=0, help="also the best of an N-trial hpcps tune (0: none)")
    ap.add_argument("--tune-folds", type=int, default=0,
                    help="with --tune: each trial cross-validated over this many folds of the training rows (tune.folds)")
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--out", default="results/bench_quality.json")
    args = ap.parse_args()
    candidates = json.loads(Path(args.candidates).read_text()) if args.candidates else {"shipped": []}
    report = {"folds": args.folds, "test_fraction": args.test, "ranks": args.ranks, "data": {}}
    for spec in args.data:
        name, rest = spec.split("=", 1)
        report["data"][name] = got = measure(name, rest, args, candidates)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))           # after each data set
        base = got["test"]["baseline"]["auc"]
        print(f"\n{name} (test split, AUC; baseline {base:.4f})")
        for kind, r in got["test"].items():
            if kind != "baseline":
                print(f"  {kind:10s} {r['auc']:.4f}  {r['auc'] - base:+.4f}  ({r['steps']} steps, best at {r['best_step']})")
        for c, sc in got["cv_vs_baseline"].items():
            print(f"  cross-validation, {c} - baseline: mean {sc['mean']:+.4f}, worst fold {sc['min']:+.4f}")


if __name__ == "__main__":
    main()
