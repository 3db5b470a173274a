"""Using a trained model: ``hpcps predict`` (1 PS + 2 workers and 2 PS + 3 workers give single-process
PyTorch's scores on the exported model, in input order, for gzipped CSV parts; a killed predict
goes on to the same output), ``hpcps evaluate``, and the bad inputs refused before any work."""

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List

import numpy as np
import pytest
import torch

from hpcps.checkpoint import read_manifest, store
from hpcps.config import load_config
from hpcps.data.textfiles import LineReader
from hpcps.predict.inputs import Shape, index_inputs, input_layout, plan_parts, resolve_checkpoint
from hpcps.predict.reading import read_part
from hpcps.predict.serving import torch_model, torch_scores
from mpirun import ROOT, mpi_env, mpiexec, run_mpi

COLUMNS = ["sid", "click", "u", "v", "w", "x"]


def _rows(rng, n, start, labelled=True):
    out = []
    for i in range(start, start + n):
        u, v = rng.integers(0, 40), rng.integers(0, 7)
        click = int(rng.random() < 1 / (1 + np.exp(-((u % 5) - 2 + (v == 3) * 2))))
        row = [f"s{i}", str(click), f"u{u}", f"v{v}", f"w{rng.integers(0, 300)}", f"x{rng.integers(0, 3)}"]
        out.append(",".join(row if labelled else row[:1] + row[2:]))
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A wide_deep model trained on a CSV (1 PS + 2 workers), its checkpoints and export."""
    d = tmp_path_factory.mktemp("predict")
    rng = np.random.default_rng(5)
    (d / "train.csv").write_text(",".join(COLUMNS) + "\n" + "\n".join(_rows(rng, 3000, 0)) + "\n")
    sets = ["data.format=csv", f"data.path={d / 'train.csv'}", "data.label=click", "data.id=sid",
            "data.hash_rows=500", "data.batch_size=64", "data.eval_fraction=0.2", "model.kind=wide_deep",
            "model.dim=4", "model.top_mlp=[8]", "job.epochs=2", "job.eval_each_epoch=true", "metrics.progress=false",
            f"checkpoint.dir={d / 'ck'}", "checkpoint.keep_best=auc", f"job.export={d / 'model.npz'}",
            "job.export_best=true", "optimizer.wide.name=ftrl", "optimizer.wide.lr=0.3", "optimizer.sparse.lr=0.05"]
    run_mpi(3, ["-m", "hpcps", "train", "--set", *sets], timeout=240)
    inputs = d / "inputs"
    inputs.mkdir()
    for k in range(3):                          # gzipped parts, the last without the label column
        labelled = k < 2
        head = ",".join(c for c in COLUMNS if labelled or c != "click")
        with gzip.open(inputs / f"part-{k}.csv.gz", "wt") as f:
            f.write(head + "\n" + "\n".join(_rows(rng, 250 + 40 * k, 10_000 * k, labelled)) + "\n")
    return d, sets


def _expected(d, sets, data):
    """Single-process PyTorch on the exported (best) model, reading ``data`` as predict does."""
    path = resolve_checkpoint(str(d / "ck" / "best"))
    cfg = load_config(None, [*sets, f"data.path={data}"])
    files = index_inputs(cfg.data, trained=read_manifest(path)["layout"])
    model = None
    lines, scores, labels = [], [], []
    start = 0
    for k, fi in enumerate(files):
        lay, id_col = input_layout(cfg.data, [fi], "auto", read_manifest(path)["layout"])
        model = model or torch_model(cfg, Shape(lay), dict(np.load(d / "model.npz")))
        for dense, keys, y, ln, ids in read_part(LineReader([fi]), [fi], (0, 0, fi.lines), lay, id_col, False, {}):
            lines.append(ln + start)
            scores.append(torch_scores(model, dense, keys))
            labels.append(y if y is not None else np.full(len(ln), -1))
        start += fi.lines
    assert path.name == f"step-{json.loads((d / 'ck' / 'best').read_text())['step']:09d}"
    return np.concatenate(lines), np.concatenate(scores), np.concatenate(labels)


def _predict(n, d, data, out, *extra, check=True):
    return run_mpi(n, ["-m", "hpcps", "predict", "--checkpoint", d / "ck" / "best", "--data", data, "--out", out,
                       *extra], timeout=240, check=check)


@pytest.mark.openmpi
def test_predict_matches_one_process_torch_on_the_export_with_any_ranks_and_resumes(trained, tmp_path):
    import pyarrow.csv as pacsv
    d, sets = trained
    lines, want, labels = _expected(d, sets, d / "inputs" / "part-[01].csv.gz")
    # one file from 1 PS + 2 workers; a directory of parts from 2 PS + 3 workers
    r = _predict(3, d, d / "inputs" / "part-[01].csv.gz", tmp_path / "one.csv", "--part-lines", "90",
                 "--set", "pipeline.loader=on")                # each worker parses in a child process
    summary = json.loads(r.stdout.strip().splitlines()[-1])["predict"]
    assert summary["rows"] == len(want) == 250 + 290 and summary["parts"] == 7 and summary["labelled"]
    one = pacsv.read_csv(tmp_path / "one.csv").to_pandas()
    assert list(one.columns) == ["line", "id", "label", "probability"]
    assert one["line"].tolist() == lines.tolist() and one["label"].tolist() == labels.tolist()
    assert one["id"].tolist() == [f"s{i}" for i in range(250)] + [f"s{10_000 + i}" for i in range(290)]
    np.testing.assert_allclose(one["probability"], want, rtol=1e-5, atol=1e-6)
    assert 0.02 < want.std()                                     # the scores differ: a trained model
    # slurm/predict.sbatch as a batch job runs it (outside Slurm: HPCPS_LAUNCH=mpiexec), 2 PS + 3 workers
    parts = tmp_path / "parts"
    env = mpi_env({"HPCPS_LAUNCH": "mpiexec", "HPCPS_NTASKS": "5", "HPCPS_NUM_PS": "2", "HPCPS_PYTHON": sys.executable,
                   "HPCPS_CHECKPOINT": str(d / "ck" / "best"), "HPCPS_DATA": str(d / "inputs" / "part-[01].csv.gz"),
                   "HPCPS_OUT": str(parts), "PATH": f"{Path(mpiexec()).parent}:{os.environ['PATH']}"})
    r = subprocess.run(["bash", str(ROOT / "slurm" / "predict.sbatch"), "--part-lines", "90"], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and "every part written" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    summary = json.loads(next(x for x in r.stdout.splitlines() if x.startswith('{"predict"')))["predict"]
    assert (summary["num_ps"], summary["num_workers"], summary["rows"]) == (2, 3, 540)
    index = json.loads((parts / "index.json").read_text())
    assert [p["file"] for p in index["parts"]] == [f"part-{i:05d}.csv" for i in range(7)]
    joined = np.concatenate([pacsv.read_csv(parts / p["file"]).to_pandas()["probability"] for p in index["parts"]])
    np.testing.assert_allclose(joined, want, rtol=1e-5, atol=1e-6)
    # what a kill leaves: two parts missing, one half written, no index; the rerun writes those two
    kept = {p: (parts / p).read_bytes() for p in ("part-00000.csv", "part-00003.csv", "part-00005.csv")}
    (parts / "index.json").unlink()
    (parts / "part-00001.csv").unlink()
    (parts / "part-00004.csv").rename(parts / ".part-00004.csv.tmp123")
    r = _predict(3, d, d / "inputs" / "part-[01].csv.gz", parts, "--part-lines", "90")
    assert json.loads(r.stdout.strip().splitlines()[-1])["predict"]["parts_written"] == 2
    assert json.loads((parts / "index.json").read_text())["parts"] == index["parts"]
    assert all((parts / p).read_bytes() == b for p, b in kept.items())
    again = np.concatenate([pacsv.read_csv(parts / p["file"]).to_pandas()["probability"] for p in index["parts"]])
    assert np.array_equal(again, joined)


def test_predict_without_labels_equals_the_torchscript_export_with_torch_alone_and_evaluate(trained, tmp_path):
    """Parquet of unlabelled lines; the TorchScript export, run in a process where only torch
    imports (hpcps, numpy, h5py, mpi4py, pyarrow blocked) on the raw columns, gives the same scores."""
    import subprocess
    import sys
    import pyarrow.parquet as pq
    d, sets = trained
    data = d / "inputs" / "part-2.csv.gz"
    lines, want, _ = _expected(d, sets, data)
    _predict(3, d, data, tmp_path / "s.parquet")
    got = pq.read_table(tmp_path / "s.parquet").to_pandas()
    assert list(got.columns) == ["line", "id", "probability"] and got["line"].tolist() == lines.tolist()
    np.testing.assert_allclose(got["probability"], want, rtol=1e-5, atol=1e-6)
    best = resolve_checkpoint(str(d / "ck" / "best"))
    r = subprocess.run([sys.executable, "-m", "hpcps", "ckpt", "export", str(best), "--format", "torchscript",
                        "--out", str(tmp_path / "model.pt")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    # issue 51.3: an existing file is replaced only with --overwrite
    saved = (tmp_path / "model.pt").read_bytes()
    again = [sys.executable, "-m", "hpcps", "ckpt", "export", str(best), "--format", "torchscript",
             "--out", str(tmp_path / "model.pt")]
    r = subprocess.run(again, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "exists (use --overwrite" in r.stderr and (tmp_path / "model.pt").read_bytes() == saved
    r = subprocess.run([*again, "--overwrite"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    (tmp_path / "run.py").write_text(TORCH_ONLY)
    r = subprocess.run([sys.executable, "-I", str(tmp_path / "run.py"), str(tmp_path / "model.pt"), str(data)],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    np.testing.assert_allclose([float(x) for x in r.stdout.split()], got["probability"], rtol=1e-5, atol=1e-7)
    # evaluate: every checkpoint of the directory, a row per step; the metrics of the scores above
    r = run_mpi(3, ["-m", "hpcps", "evaluate", "--checkpoint", d / "ck", "--data", d / "inputs" / "part-[01].csv.gz"],
                timeout=240)
    rows = json.loads(next(x for x in r.stdout.splitlines() if x.startswith('{"evaluate"')))["evaluate"]
    assert [x["step"] for x in rows] == sorted(x["step"] for x in rows) and len(rows) >= 2
    _, p, y = _expected(d, sets, d / "inputs" / "part-[01].csv.gz")
    from hpcps.core.metrics import auc
    best = next(x for x in rows if str(resolve_checkpoint(str(d / "ck" / "best"))) == x["checkpoint"])
    assert best["auc"] == pytest.approx(auc(y, p), abs=1e-6) and best["samples"] == 540
    assert best["calibration"] == pytest.approx(p.mean() / y.mean(), rel=1e-5)
    assert "warning" not in r.stderr                    # none of these lines was trained on
    # issue 51.5: without --data, each checkpoint's held-out split (the last 20% of train.csv), as training scored it
    r = run_mpi(3, ["-m", "hpcps", "evaluate", "--checkpoint", d / "ck" / "best"], timeout=240)
    held = json.loads(next(x for x in r.stdout.splitlines() if x.startswith('{"evaluate"')))["evaluate"][0]
    kept = json.loads((d / "ck" / "best").read_text())
    assert held["samples"] == 600 and held["split"] == "the last 0.2 (held out)"
    assert held["auc"] == pytest.approx(kept["value"], abs=1e-6)
    from hpcps.cli import _parser
    from hpcps.predict.cli import _trained_on
    from hpcps.predict.inputs import scoring_config
    args = _parser().parse_args(["evaluate", "--checkpoint", str(d / "ck" / "best"), "--data", str(d / "train.csv")])
    ck = resolve_checkpoint(args.checkpoint[0])
    assert _trained_on(scoring_config(ck, None, args.data), ck)
    assert not _trained_on(scoring_config(ck, None, str(d / "inputs" / "part-0.csv.gz")), ck)
    assert "| step | auc |" in r.stdout


SERVE = """
import runpy, sys
for m in ("hpcps", "mpi4py", "pyarrow", "pandas"):
    sys.modules[m] = None                      # importable: torch, numpy, h5py
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_parse_child_reads_as_the_worker_and_raises_its_errors(tmp_path):
    """hpcps.predict.reading: the forked parser gives the blocks the worker's own parse gives, in
    order, with each part's end; a bad line's error names the line in the worker."""
    from hpcps.predict.reading import read_parts
    rng = np.random.default_rng(1)
    (tmp_path / "a.csv").write_text(",".join(COLUMNS) + "\n" + "\n".join(_rows(rng, 700, 0)) + "\n")
    cfg = load_config(None, ["data.format=csv", f"data.path={tmp_path / 'a.csv'}", "data.label=click", "data.id=sid"])
    files = index_inputs(cfg.data)
    lay, id_col = input_layout(cfg.data, files)
    parts = plan_parts(files, 300)
    got = [list(read_parts(files, parts, [0, 2], lay, id_col, False, {}, child=c)) for c in (False, True)]
    assert [(i, b is None) for i, b in got[1]] == [(0, False), (0, True), (2, False), (2, True)]
    for (i, a), (j, b) in zip(*got):
        assert i == j and (a is None) == (b is None)
        if a is not None:
            assert all(np.array_equal(x, y) for x, y in zip(a[:4], b[:4])) and a[4].to_pylist() == b[4].to_pylist()
    text = (tmp_path / "a.csv").read_text().splitlines()
    text[650] = ",".join(["s649", "maybe", *text[650].split(",")[2:]])     # line 651: its label
    (tmp_path / "a.csv").write_text("\n".join(text) + "\n")
    files = index_inputs(cfg.data)
    with pytest.raises(ValueError, match=r"a\.csv:651"):
        list(read_parts(files, parts, [0, 1, 2], lay, id_col, False, {}, child=True))


def test_serving_export_scores_as_predict_with_torch_numpy_and_h5py(trained, tmp_path):
    """--format serving: dense.pt + tables.h5 (sorted ids, rows); examples/serve.py, with hpcps,
    mpi4py and pyarrow blocked, gives the single-process scores on labelled and unlabelled lines;
    a non-empty --out is refused and left alone."""
    import h5py
    d, sets = trained
    best = resolve_checkpoint(str(d / "ck" / "best"))
    out = tmp_path / "served"
    r = subprocess.run([sys.executable, "-m", "hpcps", "ckpt", "export", str(d / "ck" / "best"), "--format", "serving",
                        "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    with h5py.File(out / "tables.h5", "r") as f:
        names = list(f["tables"])
        ids = f["tables"][names[0]]["ids"][...]
        assert f["tables"][names[0]]["rows"].shape == (500, 4) and np.array_equal(ids, np.arange(500))
    assert len(names) == 2 * len(json.loads((out / "serving.json").read_text())["categorical"])    # deep + wide
    (tmp_path / "serve.py").write_text(SERVE)
    for part in (0, 2):                                    # with and without the label column
        data = d / "inputs" / f"part-{part}.csv.gz"
        _, want, _ = _expected(d, sets, data)
        r = subprocess.run([sys.executable, "-I", str(tmp_path / "serve.py"), str(ROOT / "examples" / "serve.py"),
                            str(out), str(data), "--batch", "100"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        np.testing.assert_allclose([float(x) for x in r.stdout.split()], want, rtol=1e-5, atol=1e-7)
    # issue 51.6: predict's rule. A column missing: refused, naming it (it scored the header as data,
    # columns shifted); .bz2 read; --batch 0 refused; one line each, exit 2
    import bz2
    text = gzip.decompress((d / "inputs" / "part-0.csv.gz").read_bytes()).decode()
    (tmp_path / "no_w.csv").write_text("".join(",".join(x.split(",")[:4] + x.split(",")[5:]) + "\n"
                                               for x in text.splitlines()))
    (tmp_path / "in.csv.bz2").write_bytes(bz2.compress(text.encode()))
    _, want, _ = _expected(d, sets, d / "inputs" / "part-0.csv.gz")
    for args, message in [(["no_w.csv"], "its header has no column w"), (["in.csv.bz2"], None),
                          (["in.csv.bz2", "--batch", "0"], "--batch 0: must be >= 1")]:
        r = subprocess.run([sys.executable, "-I", str(tmp_path / "serve.py"), str(ROOT / "examples" / "serve.py"),
                            str(out), str(tmp_path / args[0]), *args[1:]], capture_output=True, text=True, timeout=120)
        if message is None:
            assert r.returncode == 0, r.stderr
            np.testing.assert_allclose([float(x) for x in r.stdout.split()], want, rtol=1e-5, atol=1e-7)
        else:
            assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
            assert message in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("keep")
    r = subprocess.run([sys.executable, "-m", "hpcps", "ckpt", "export", str(best), "--format", "serving",
                        "--out", str(tmp_path / "taken")], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "not an empty directory" in r.stderr
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["x"]


@pytest.mark.parametrize("case, message", [
    ("exists", "exists (use --overwrite"),
    ("inside", "inside the checkpoint directory"),
    ("kind", "model.kind = 'dlrm', but"),
    ("no-dir", "does not exist"),
    ("not-ours", "not a predict output"),
    ("no-ckpt", "no such file"),
    ("columns", "do not give"),
    ("labels", "has no label column"),
    ("input", "is the input"),
    ("busy", "another predict writes it"),
])
def test_predict_refuses_bad_input_before_any_communication(trained, tmp_path, case, message):
    """What every rank checks before MPI communicates (hpcps.predict.cli.prepare): nothing written."""
    from hpcps.cli import _parser
    from hpcps.predict.cli import prepare
    d, _ = trained
    ckpt, out, extra, data = d / "ck" / "best", tmp_path / "s.csv", [], d / "inputs" / "part-0.csv.gz"
    if case == "exists":
        out.write_text("keep me\n")
    elif case == "inside":
        out = d / "ck" / "s.csv"
    elif case == "kind":
        extra = ["--set", "model.kind=dlrm"]
    elif case == "no-dir":
        out = tmp_path / "nowhere" / "s.csv"
    elif case == "not-ours":
        out = tmp_path / "mine"
        out.mkdir()
        (out / "notes.txt").write_text("x")
    elif case == "no-ckpt":
        ckpt = d / "ck" / "step-999"
    elif case == "columns":
        extra = ["--set", "data.drop=w"]
    elif case == "labels":
        data, extra = d / "inputs" / "part-2.csv.gz", ["--labels", "yes"]
    elif case == "input":                               # issue 51.2: --overwrite never replaces the input
        import gzip
        out = data = tmp_path / "in.csv"
        data.write_bytes(gzip.decompress((d / "inputs" / "part-0.csv.gz").read_bytes()))
        extra, kept = ["--overwrite"], data.read_bytes()
    elif case == "busy":                                # issue 51.12: a second predict into one --out
        import socket
        import subprocess
        first = subprocess.Popen(["sleep", "60"])
        (tmp_path / ".s.csv.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": first.pid,
                                                          "slurm_job": None, "time": 0}))
    before = sorted(p.name for p in tmp_path.iterdir())
    job, error = prepare(_parser().parse_args(["predict", "--checkpoint", str(ckpt), "--data", str(data),
                                               "--out", str(out), *extra]))
    if case == "busy":
        first.kill()
        first.wait()
    assert job is None and message in str(error)
    assert sorted(p.name for p in tmp_path.iterdir()) == before and not (d / "ck" / "s.csv").exists()
    if case == "exists":
        assert out.read_text() == "keep me\n"
    if case == "input":
        assert data.read_bytes() == kept


TORCH_ONLY = """
import csv, gzip, sys
for m in ("hpcps", "numpy", "h5py", "mpi4py", "pyarrow", "pandas"):
    sys.modules[m] = None                      # importable: torch alone
import torch
model = torch.jit.load(sys.argv[1])
rows = list(csv.reader(gzip.open(sys.argv[2], "rt")))
head, rows = rows[0], rows[1:]
cats = [[r[head.index(n)] for r in rows] for n in model.categorical_names]
dense = torch.tensor([[float(r[head.index(n)] or 0) for n in model.dense_names] for r in rows]).reshape(len(rows), -1)
p = model(dense, cats)
assert torch.equal(model(dense[:5], [c[:5] for c in cats]), p[:5])      # any batch size
print(" ".join(repr(x) for x in p.tolist()))
"""


class _Sum(torch.nn.Module):
    def forward(self, dense: torch.Tensor, ids: List[torch.Tensor]) -> torch.Tensor:
        return dense.sum(1)


@pytest.mark.parametrize("fmt", ["criteo", "csv"])
def test_torchscript_hashing_is_the_readers(fmt):
    """The scripted module's row ids of raw values equal the readers' (criteo's hex with missing
    values; csv's hash of any UTF-8 value, the empty one included)."""
    from hpcps.data.columns import criteo_layout, parse_block, resolve_layout
    from hpcps.data.hashing import column_key
    from hpcps.predict.torchscript import RawColumns, _s64
    rng = np.random.default_rng(0)
    if fmt == "criteo":
        lay = criteo_layout(1000)
        lines = ["\t".join(["1"] + [str(rng.integers(0, 9)) for _ in range(13)]
                           + [("" if rng.random() < 0.2 else f"{rng.integers(0, 1 << 32):08x}"[:rng.integers(1, 9)])
                              for _ in range(26)]) for _ in range(200)]
    else:
        from hpcps.config.schema import DataConfig
        d = DataConfig(format="csv", label="0", hash_rows=997)
        lay = resolve_layout(d, None, 4, "x")
        words = ["", "a", "ü", "日本語", "emoji😀", "x" * 40, "0", "12,5".replace(",", ";")]
        lines = [",".join(["0"] + [words[rng.integers(0, len(words))] + str(rng.integers(0, 3)) * int(rng.integers(0, 2))
                                   for _ in range(3)]) for _ in range(200)]
    block = "".join(x + "\n" for x in lines).encode()
    _, keys, _, slots = parse_block(block, len(lines), lambda i: f"x:{i}", lay, False, {})
    assert slots is None
    ck = [_s64(int(column_key(k if lay.keys == "hex" else c))) for k, c in enumerate(lay.categorical)]
    module = torch.jit.script(RawColumns(_Sum(), lay.keys, ck, lay.rows, lay.dense_log, [], []))
    cats = [[x.split(lay.delimiter)[c] for x in lines] for c in lay.categorical]
    got = module.ids(cats)
    assert all(np.array_equal(g.numpy(), keys[:, t]) for t, g in enumerate(got))


def test_torchscript_refuses_what_predict_refuses_naming_the_column():
    """Issue 51.6: the TorchScript module took NaN/inf dense values, non-hex and 20-digit Criteo
    values that predict refuses; its shape errors were raw torch messages. One rule: the readers'."""
    from hpcps.data.columns import _check_line, criteo_layout
    from hpcps.data.hashing import column_key
    from hpcps.predict.torchscript import RawColumns, _s64
    lay = criteo_layout(1000)
    ck = [_s64(int(column_key(k))) for k in range(26)]
    module = torch.jit.script(RawColumns(_Sum(), "hex", ck, 1000, True, [lay.names[c] for c in lay.categorical],
                                         [lay.names[c] for c in lay.dense]))
    good = ["1"] + ["3"] * 13 + ["68fd1e64"] * 26
    dense, cats = torch.full((1, 13), 3.0), [[v] for v in good[14:]]
    module(dense, cats)                                                         # a good line scores
    for col, value, where in [(15, "zz", "categorical column C2 is not a hex value"),
                              (16, "1" * 20, "categorical column C3 is not a hex value")]:
        line = list(good)
        line[col] = value
        assert _check_line(line, lay) is not None                               # predict refuses the line
        with pytest.raises(Exception, match=where):
            module(dense, [[v] for v in line[14:]])
    for value in (float("nan"), float("inf"), 1e39):
        assert _check_line(["1"] + [str(value)] * 13 + good[14:], lay) is not None
        with pytest.raises(Exception, match="dense column I1 is not a finite number"):
            module(torch.full((1, 13), value, dtype=torch.float64), cats)
    with pytest.raises(Exception, match=r"dense: expected a \(n, 13\) tensor"):
        module(torch.zeros(1, 12), cats)
    with pytest.raises(Exception, match="categorical: expected 26 lists"):
        module(dense, cats[:-1])
    with pytest.raises(Exception, match="categorical column C1: 2 values where"):
        module(dense, [["1", "2"]] + cats[1:])


def test_ratings_example_trains_then_predict_and_evaluate_by_the_checkpoints_own_ids(tmp_path):
    """examples/ratings.toml as shipped on a generated file trains well (predicting the mean gives
    RMSE 0.91 / MAE 0.77 there; the planted noise floor is ~0.4); evaluate on 2 PS + 1 worker gives
    training's own eval RMSE and MAE of the same lines; predict maps raw ids by the ids the
    checkpoint keeps (an unknown one to the last row) and gives single-process torch's ratings on
    the export, for lines without a rating."""
    from hpcps.predict.ratings import RatingsInput
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_ratings.py"), str(tmp_path / "r.dat"), "--ratings",
                    "20000"], check=True, capture_output=True)
    lines = (tmp_path / "r.dat").read_text().splitlines()
    (tmp_path / "eval.dat").write_text("\n".join(lines[-2000:]) + "\n")             # eval_fraction's lines
    (tmp_path / "new.dat").write_text("\n".join(["::".join(x.split("::")[:2]) for x in lines[:50]] + ["nobody::nothing"]) + "\n")
    r = run_mpi(3, ["-m", "hpcps", "train", "--config", ROOT / "examples" / "ratings.toml", "--set",
                    f"data.path={tmp_path / 'r.dat'}", f"checkpoint.dir={tmp_path / 'ck'}",
                    f"job.export={tmp_path / 'model.npz'}", "metrics.progress=false", "metrics.path="], timeout=240)
    final = json.loads(next(x for x in r.stdout.splitlines() if x.startswith('{"final"')))["final"]
    assert final["rmse"] < 0.7 and final["mae"] < 0.55
    r = run_mpi(3, ["-m", "hpcps", "evaluate", "--checkpoint", resolve_checkpoint(str(tmp_path / "ck")), "--data",
                    tmp_path / "eval.dat", "--set", "job.num_ps=2"], timeout=240)
    got = json.loads(next(x for x in r.stdout.splitlines() if x.startswith('{"evaluate"')))["evaluate"][-1]
    assert got["samples"] == 2000 and "auc" not in got and "| step | rmse | mae |" in r.stdout
    assert got["rmse"] == pytest.approx(final["rmse"], abs=1e-6) and got["mae"] == pytest.approx(final["mae"], abs=1e-6)
    _ = run_mpi(2, ["-m", "hpcps", "predict", "--checkpoint", tmp_path / "ck", "--data", tmp_path / "new.dat",
                    "--out", tmp_path / "out.csv"], timeout=240)
    out = np.genfromtxt(tmp_path / "out.csv", delimiter=",", names=True)
    assert out.dtype.names == ("line", "rating") and out["line"].tolist() == list(range(51))
    path = resolve_checkpoint(str(tmp_path / "ck"))
    man = read_manifest(path)
    lay = RatingsInput(man["ratings_ids"], labelled=False)
    _, keys, _, _ = lay.parse((tmp_path / "new.dat").read_bytes(), 51, str, False, {})
    assert keys[-1].tolist() == [len(man["ratings_ids"]["users"]), len(man["ratings_ids"]["items"])]
    cfg = load_config(None, [], base=man["config"])
    model = torch_model(cfg, Shape(lay), dict(np.load(tmp_path / "model.npz")))
    np.testing.assert_allclose(out["rating"], torch_scores(model, np.zeros((51, 0), np.float32), keys, "ratings"),
                               rtol=1e-5, atol=1e-5)


def test_a_resume_with_another_model_kind_is_refused_naming_the_kind(trained, tmp_path):
    """Issue 51.4: wide_deep -> deepfm resumed and trained from rows of another model, silently; to
    lr the message blamed the MLPs. Now the first differing model key is named, before any row loads."""
    import shutil
    from hpcps.train.compat import check_same_model
    d, sets = trained
    shutil.copytree(d / "ck", tmp_path / "ck", symlinks=True)
    ours = lambda: sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name not in ("STARTED", "LOCK"))  # noqa: E731
    kept = ours()           # a run's STARTED and (stale once it is gone) LOCK aside
    r = run_mpi(3, ["-m", "hpcps", "train", "--set", *sets, f"checkpoint.dir={tmp_path / 'ck'}", "job.epochs=3",
                    "model.kind=deepfm", f"job.export={tmp_path / 'm.npz'}"], timeout=240, check=False)
    assert r.returncode != 0 and "model.kind = 'wide_deep', this run has 'deepfm'" in r.stderr
    assert ours() == kept
    manifest = read_manifest(resolve_checkpoint(str(d / "ck" / "best")))
    with pytest.raises(ValueError, match="model.kind = 'wide_deep', this run has 'lr'"):
        check_same_model(load_config(None, [*sets, "model.kind=lr"]), manifest, "ck")


def test_what_is_scored_is_said_one_class_labels_header_only_input_upper_case_names_and_broken_checkpoints(
        trained, tmp_path, capsys):
    """Issue 51.7: one-class labels gave "auc": NaN (not JSON); a header-only input a 0-byte CSV or a
    traceback; --out X.CSV a directory; evaluate DIR dropped a truncated checkpoint without a word."""
    import shutil
    from hpcps.cli import _parser
    from hpcps.predict.cli import _checkpoints, prepare
    from hpcps.predict.evaluate import metrics
    from hpcps.predict.output import Output
    got = metrics(np.zeros(5), np.full(5, 0.3), "ctr")
    assert got["auc"] is None and "every label is 0" in got["undefined"]["auc"] and got["logloss"] > 0
    json.dumps(got, allow_nan=False)                    # strict JSON
    assert Output(tmp_path / "S.CSV").single and Output(tmp_path / "S.CSV").fmt == "csv"
    d, _ = trained
    (tmp_path / "head.csv").write_text(",".join(COLUMNS) + "\n")
    for command in (["predict", "--out", str(tmp_path / "s.parquet")], ["evaluate"]):
        job, error = prepare(_parser().parse_args([*command, "--checkpoint", str(d / "ck" / "best"),
                                                   "--data", str(tmp_path / "head.csv")]))
        assert job is None and "no data lines to score" in str(error)
    assert not list(tmp_path.glob(".*parts"))
    shutil.copytree(d / "ck", tmp_path / "ck", symlinks=True)
    steps = store.list_checkpoints(tmp_path / "ck")
    part = steps[-1] / "ps-00000.h5"
    part.write_bytes(part.read_bytes()[:1000])
    capsys.readouterr()
    listed = _checkpoints(_parser().parse_args(["evaluate", "--checkpoint", str(tmp_path / "ck")]))
    assert [p.name for p in listed] == [p.name for p in steps[:-1]]
    assert f"{steps[-1].name} does not verify" in capsys.readouterr().err


def test_mismatched_inputs_name_the_cause(trained, tmp_path, capsys):
    """Issue 51.11: a missing column gave "42 tables, the checkpoint has 44"; another config's data
    format "'C2' was not in the training input"; a ratings checkpoint on a CSV suggested
    data.skip_bad_lines; a garbage manifest "a checkpoint it builds on is unreadable"; exporting a
    truncated checkpoint an HDF5 message without the file."""
    import gzip
    import shutil
    from hpcps.cli import _parser, main
    from hpcps.data.textfiles import FileIndex
    from hpcps.predict.cli import prepare
    from hpcps.predict.ratings import ratings_input
    d, _ = trained
    lines = gzip.decompress((d / "inputs" / "part-0.csv.gz").read_bytes()).decode().splitlines()
    (tmp_path / "no_v.csv").write_text("".join(",".join(x.split(",")[:3] + x.split(",")[4:]) + "\n" for x in lines))
    for data, extra, message in [(tmp_path / "no_v.csv", [], "no column for the checkpoint's tables v, wide_v"),
                                 (d / "inputs" / "part-0.csv.gz", ["--set", "data.format=criteo"],
                                  "data.format = 'criteo', but")]:
        job, error = prepare(_parser().parse_args(["predict", "--checkpoint", str(d / "ck" / "best"), "--data",
                                                   str(data), "--out", str(tmp_path / "s.csv"), *extra]))
        assert job is None and message in str(error), error
    fi = FileIndex("x.csv", False, None, 3, 30, first=lines[1])
    with pytest.raises(ValueError, match="its first line has 6 fields, not 'user item \\[rating\\]': ck is a ratings model"):
        ratings_input([fi], "auto", {"ratings_ids": {"users": [], "items": []}}, "ck")
    shutil.copytree(d / "ck", tmp_path / "ck", symlinks=True)
    first, last = store.list_checkpoints(tmp_path / "ck")[:2]
    (first / "manifest.json").write_text("garbage{")
    assert store.verify_chain(first) == (False, f"{first.name}: manifest.json is not JSON (Expecting value: line 1 "
                                                "column 1 (char 0)): the checkpoint is damaged")
    part = last / "ps-00000.h5"
    part.write_bytes(part.read_bytes()[:1000])
    capsys.readouterr()
    assert main(["ckpt", "export", str(last), "--out", str(tmp_path / "e.h5")]) == 2
    assert f"does not verify: {last.name}: ps-00000.h5 has 1000 bytes" in capsys.readouterr().err
    assert not (tmp_path / "e.h5").exists()


def test_predict_reads_a_header_in_another_order_and_lines_without_a_header(trained, tmp_path):
    """Issue 51.6: predict refused a header naming the training columns in another order, and
    headerless lines of training's columns (serve.py scored both right). One rule now: by name
    where there is a header, else training's columns in training's order (the label may be left out)."""
    from hpcps.cli import _parser
    from hpcps.predict.cli import prepare
    d, sets = trained
    lines = gzip.decompress((d / "inputs" / "part-0.csv.gz").read_bytes()).decode().splitlines()
    order = [0, 1, 4, 3, 2, 5]                                    # u and w swapped
    (tmp_path / "swapped.csv").write_text("".join(",".join(x.split(",")[i] for i in order) + "\n" for x in lines))
    (tmp_path / "bare.csv").write_text("".join(x + "\n" for x in lines[1:]))
    (tmp_path / "bare_unlabelled.csv").write_text("".join(",".join(x.split(",")[:1] + x.split(",")[2:]) + "\n"
                                                          for x in lines[1:]))
    (tmp_path / "bare_short.csv").write_text("".join(",".join(x.split(",")[:4]) + "\n" for x in lines[1:]))
    _, want, _ = _expected(d, sets, d / "inputs" / "part-0.csv.gz")
    for name in ("swapped.csv", "bare.csv", "bare_unlabelled.csv"):
        _, got, _ = _expected(d, sets, tmp_path / name)
        np.testing.assert_array_equal(got, want)
        job, error = prepare(_parser().parse_args(["predict", "--checkpoint", str(d / "ck" / "best"), "--data",
                                                   str(tmp_path / name), "--out", str(tmp_path / "s.csv")]))
        assert error is None and job is not None
    job, error = prepare(_parser().parse_args(["predict", "--checkpoint", str(d / "ck" / "best"), "--data",
                                               str(tmp_path / "bare_short.csv"), "--out", str(tmp_path / "s.csv")]))
    assert job is None and "no header line, and 4 fields a line where training read 6" in str(error)
