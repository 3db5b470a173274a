"""What the data allow: strong single-machine learners from scikit-learn (an optional extra:
``pip install scikit-learn``) on the cross-validation folds of ``scripts/bench_quality.py``, each
scored against ``hpcps baseline``'s model (hashed logistic regression, C = 0.1) on the same rows.

    .venv/bin/python scripts/quality_ceiling.py --data NAME=CONFIG:FILE[;KEY=VALUE...] [--data ...]
        [--folds 3] [--test 0.2] [--rows N] [--out results/quality_ceiling.json]

The folds, the rows each fold trains on (less every k-th line, early stopping's in ``hpcps
train``) and the features are bench_quality's and ``hpcps baseline``'s: hpcps's own reader hashes
each file (``data.hash_rows`` rows a column) and gives the dense features. The learners:
logistic regression at C 0.03-1 (0.1 is the baseline), the same with every pair of categorical
columns crossed (Wide & Deep's cross-product features, hashed into 2^20 columns), gradient-boosted
trees over the columns' frequent values (``HistGradientBoostingClassifier``, early-stopped), and
rank averages of them. The test split is not read. Prints each learner's mean margin over the
baseline and its worst fold (the margins ``bench_quality`` prints for hpcps's models) and writes
JSON.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from bench_quality import Runner, split_lines, write  # noqa: E402

from hpcps.config import load_config  # noqa: E402
from hpcps.data import make_data  # noqa: E402

CROSS_COLUMNS = 1 << 20


def features(cfg) -> tuple:
    """``(train, held, each column's table rows)``: ``(dense, ids (n, columns), labels)`` of the
    training pass and of the eval file."""
    data = make_data(cfg.data, cfg.job.seed, 1, 0)
    b = data.train_pass()
    parts = list(data.eval_batches())
    held = (np.concatenate([p.dense for p in parts]), np.stack([np.concatenate(x) for x in zip(*(p.sparse for p in parts))], 1),
            np.concatenate([p.labels for p in parts]))
    return (b.dense, np.stack(b.sparse, 1).astype(np.int64), b.labels), held, [rows for _, rows in data.tables]


def one_hot(dense, ids, rows: list, cross: bool):
    """The sparse design matrix: each column's id (after the columns before it), the crossed pairs'
    hashed ids, the dense features."""
    from scipy import sparse
    n, k = ids.shape
    cols = [ids + np.cumsum([0] + rows[:-1])]
    width = sum(rows)
    if cross:
        i, j = np.triu_indices(k, 1)
        pair = (ids[:, i] * 1_000_003 + ids[:, j]) * 97 + np.arange(i.size)      # distinct per pair of columns
        cols.append(width + pair % CROSS_COLUMNS)
        width += CROSS_COLUMNS
    c = np.concatenate(cols, 1)
    m = sparse.csr_matrix((np.ones(c.size), c.ravel(), np.arange(0, c.size + 1, c.shape[1])), shape=(n, width))
    return sparse.hstack([m, sparse.csr_matrix(dense.astype(np.float64))]).tocsr()


def logistic(train, held, rows, c: float, cross: bool = False) -> np.ndarray:
    """Logistic regression (scikit-learn's, L-BFGS), as ``hpcps baseline`` at C = 0.1."""
    from sklearn.linear_model import LogisticRegression
    m = LogisticRegression(C=c, max_iter=3000).fit(one_hot(*train[:2], rows, cross), train[2])
    return m.predict_proba(one_hot(*held[:2], rows, cross))[:, 1]


def boosted(train, held) -> np.ndarray:
    """Trees over each column's 250 most frequent values (seen 5 times or more; the rest one value) and the dense features."""
    from sklearn.ensemble import HistGradientBoostingClassifier
    ids = train[1]
    maps = []
    for j in range(ids.shape[1]):
        vals, counts = np.unique(ids[:, j], return_counts=True)
        keep = vals[np.argsort(-counts, kind="stable")][:250]
        keep = keep[np.isin(keep, vals[counts >= 5])]
        maps.append({int(v): i for i, v in enumerate(keep)})

    def x(part):
        cat = np.array([[maps[j].get(int(v), len(maps[j])) for j, v in enumerate(row)] for row in part[1]], float)
        return np.concatenate([cat, part[0]], 1)
    m = HistGradientBoostingClassifier(learning_rate=0.05, max_leaf_nodes=15, max_iter=2000, l2_regularization=1.0,
                                       categorical_features=list(range(ids.shape[1])), early_stopping=True,
                                       validation_fraction=0.15, n_iter_no_change=30, random_state=0)
    return m.fit(x(train), train[2]).predict_proba(x(held))[:, 1]


def rank(p: np.ndarray) -> np.ndarray:
    return np.argsort(np.argsort(p)) / len(p)


def fold_scores(cfg) -> dict:
    from sklearn.metrics import roc_auc_score
    train, held, rows = features(cfg)
    p = {f"lr C={c}": logistic(train, held, rows, c) for c in (0.03, 0.1, 0.3, 1.0)}
    p |= {f"lr + crosses C={c}": logistic(train, held, rows, c, cross=True) for c in (0.03, 0.1)}
    p["boosted trees"] = boosted(train, held)
    p["mean rank: lr, trees"] = (rank(p["lr C=0.1"]) + rank(p["boosted trees"])) / 2
    p["mean rank: lr, crosses, trees"] = (rank(p["lr C=0.1"]) + rank(p["lr + crosses C=0.03"]) + rank(p["boosted trees"])) / 3
    return {k: float(roc_auc_score(held[2], v)) for k, v in p.items()}


def measure(name: str, spec: str, args) -> dict:
    rest, *extra = spec.split(";")
    config, path = rest.rsplit(":", 1)
    data = load_config(config, [f"data.path={path}", *extra]).data
    header, _, folds = split_lines(Path(path), data.format, args.rows, args.test, args.folds)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        run = Runner(name, config, extra, header, Path(tmp), 1, data.eval_fraction)
        for k in range(args.folds):
            train, _ = run.split(f"cv{k}", [x for i, f in enumerate(folds) if i != k for x in f])
            held = write(run.tmp / f"cv{k}-held", header, folds[k])
            cfg = load_config(config, [f"data.path={train}", f"data.eval_path={held}", *extra])
            for learner, auc in fold_scores(cfg).items():
                out.setdefault(learner, []).append(auc)
            print(f"  {name} fold {k}: " + ", ".join(f"{a}: {v[-1]:.4f}" for a, v in out.items()), flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", action="append", required=True, help="NAME=CONFIG:FILE[;KEY=VALUE...] (as bench_quality)")
    ap.add_argument("--rows", type=int, default=0)
    ap.add_argument("--folds", type=int, default=3)
    ap.add_argument("--test", type=float, default=0.2, help="the fraction held out (as bench_quality; not read here)")
    ap.add_argument("--out", default="results/quality_ceiling.json")
    args = ap.parse_args()
    report = {}
    for spec in args.data:
        name, rest = spec.split("=", 1)
        report[name] = got = measure(name, rest, args)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
        base = np.array(got["lr C=0.1"])
        print(f"\n{name}: margin over the baseline (lr C=0.1) in {args.folds}-fold cross-validation: mean (worst fold)")
        for learner, v in got.items():
            d = np.array(v) - base
            print(f"  {learner:32s} {np.mean(v):.4f}  {d.mean():+.4f} ({d.min():+.4f})")


if __name__ == "__main__":
    main()
