"""hpcps predict's throughput against training and against one process of PyTorch, on the same model.

    .venv/bin/python scripts/bench_predict.py [--rows 300000] [--steps 600] [--ranks 3] [--repeat 3]
                                              [--out results/bench_predict.json]

An Avazu-style CSV (scripts/make_ctr_files.py) is made here; examples/avazu.toml's model
(wide_deep) is trained for --steps steps of global batches of 1024 on 1 PS + (ranks - 1) workers
with a checkpoint and an export; then:
  train      training samples/s per worker (the final line's samples_per_s / workers)
  predict    hpcps predict on the same file with the same ranks: samples/s per worker over the
             workers' reading, scoring and writing (score_seconds), and over the whole job;
             --repeat runs alternating with torch's, medians
  torch      one process: the same readers parse the file, the exported model over plain
             torch.nn.EmbeddingBag tables scores it (hpcps.predict.serving), one thread
Ratios (targets): predict per worker / train per worker (>= 3), predict per worker / torch.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from mpirun import run_mpi  # noqa: E402


def _line(stdout: str, key: str) -> dict:
    return json.loads(next(x for x in stdout.splitlines() if x.startswith(f'{{"{key}"')))[key]


def torch_scoring(ckpt: Path, export: Path, data: Path) -> dict:
    """Parse and score ``data`` in this process with the exported model."""
    import numpy as np
    import torch
    from hpcps.checkpoint import read_manifest
    from hpcps.config import load_config
    from hpcps.data.textfiles import LineReader
    from hpcps.predict.inputs import SCORING, Shape, index_inputs, input_layout
    from hpcps.predict.reading import read_part
    from hpcps.predict.serving import torch_model, torch_scores
    man = read_manifest(ckpt)
    cfg = load_config(None, [f"data.path={data}", *SCORING], base=man["config"])
    files = index_inputs(cfg.data, trained=man["layout"])
    lay, _ = input_layout(cfg.data, files, "auto", man["layout"])
    model = torch_model(cfg, Shape(lay), dict(np.load(export)))
    torch.set_num_threads(1)
    t = time.perf_counter()
    n = 0
    for k, fi in enumerate(files):
        for dense, keys, _, _, _ in read_part(LineReader(files), files, (k, 0, fi.lines), lay, None, False, {}):
            for a in range(0, len(dense), 4096):
                n += len(torch_scores(model, dense[a:a + 4096], keys[a:a + 4096]))
    return {"samples": n, "seconds": time.perf_counter() - t, "samples_per_s": n / (time.perf_counter() - t)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=300_000)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=3, help="predict and torch runs, alternating (medians)")
    ap.add_argument("--out", default="results/bench_predict.json")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = tmp / "avazu.csv"
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_ctr_files.py"), "avazu", "--rows", str(a.rows),
                        "--out", str(data)], check=True, capture_output=True)
        r = run_mpi(a.ranks, ["-m", "hpcps", "train", "--config", ROOT / "examples" / "avazu.toml", "--set",
                              f"data.path={data}", "data.batch_size=1024", f"job.steps={a.steps}", "job.epochs=0",
                              "job.early_stop_patience=0", "data.eval_fraction=0.01", f"checkpoint.dir={tmp / 'ck'}",
                              "checkpoint.keep_best=", "job.export_best=false", f"job.export={tmp / 'model.npz'}",
                              "metrics.path=", "metrics.progress=false"], timeout=3600)
        final = _line(r.stdout, "final")
        workers = final["num_workers"]
        train = final["samples_per_s"] / workers
        runs, ones = [], []
        for k in range(a.repeat):                  # predict and torch alternating; medians
            t = time.perf_counter()
            r = run_mpi(a.ranks, ["-m", "hpcps", "predict", "--checkpoint", tmp / "ck", "--data", data,
                                  "--out", tmp / f"scores{k}"], timeout=3600)
            pred = _line(r.stdout, "predict")
            runs.append((pred["rows"] / pred["score_seconds"] / workers, pred["rows"] / (time.perf_counter() - t),
                         time.perf_counter() - t, pred["score_seconds"]))
            ckpt = sorted((tmp / "ck").glob("step-*"))[-1]
            ones.append(torch_scoring(ckpt, tmp / "model.npz", data)["samples_per_s"])
    per_worker, job_rate, job_s, score_s = (statistics.median(x) for x in zip(*runs))
    one = {"samples_per_s": statistics.median(ones)}
    res = {"rows": a.rows, "ranks": a.ranks, "workers": workers, "repeat": a.repeat,
           "train_samples_per_s_per_worker": train, "predict_samples_per_s_per_worker": per_worker,
           "predict_runs_samples_per_s_per_worker": [x[0] for x in runs],
           "predict_job_samples_per_s": job_rate, "predict_job_seconds": job_s,
           "predict_score_seconds": score_s, "torch_one_process_samples_per_s": one["samples_per_s"],
           "ratio_predict_vs_train_per_worker": per_worker / train,
           "ratio_predict_per_worker_vs_torch": per_worker / one["samples_per_s"]}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    print(f"predict per worker {per_worker:,.0f} samples/s: {res['ratio_predict_vs_train_per_worker']:.2f}x training "
          f"per worker (target >= 3), {res['ratio_predict_per_worker_vs_torch']:.2f}x one torch process")


if __name__ == "__main__":
    main()
