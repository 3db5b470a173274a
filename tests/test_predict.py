"""Using a trained model: ``hpcps predict`` (1 PS + 2 workers and 2 PS + 3 workers give single-process
PyTorch's scores on the exported model, in input order, for gzipped CSV parts; a killed predict
goes on to the same output), ``hpcps evaluate``, and the bad inputs refused before any work."""

import gzip
import json
import shutil

import numpy as np
import pytest

from hpcps.config import load_config
from hpcps.data.textfiles import LineReader
from hpcps.predict.inputs import Shape, index_inputs, input_layout, plan_parts, read_part, resolve_checkpoint
from hpcps.predict.serving import torch_model, torch_scores
from mpirun import run_mpi

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
    files = index_inputs(cfg.data)
    model = None
    lines, scores, labels = [], [], []
    start = 0
    for k, fi in enumerate(files):
        lay, id_col = input_layout(cfg.data, [fi])
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


def test_predict_matches_one_process_torch_on_the_export_with_any_ranks_and_resumes(trained, tmp_path):
    import pyarrow.csv as pacsv
    d, sets = trained
    lines, want, labels = _expected(d, sets, d / "inputs" / "part-[01].csv.gz")
    # one file from 1 PS + 2 workers; a directory of parts from 2 PS + 3 workers
    r = _predict(3, d, d / "inputs" / "part-[01].csv.gz", tmp_path / "one.csv", "--part-lines", "90")
    summary = json.loads(r.stdout.strip().splitlines()[-1])["predict"]
    assert summary["rows"] == len(want) == 250 + 290 and summary["parts"] == 7 and summary["labelled"]
    one = pacsv.read_csv(tmp_path / "one.csv").to_pandas()
    assert list(one.columns) == ["line", "id", "label", "probability"]
    assert one["line"].tolist() == lines.tolist() and one["label"].tolist() == labels.tolist()
    assert one["id"].tolist() == [f"s{i}" for i in range(250)] + [f"s{10_000 + i}" for i in range(290)]
    np.testing.assert_allclose(one["probability"], want, rtol=1e-5, atol=1e-6)
    assert 0.02 < want.std()                                     # the scores differ: a trained model
    parts = tmp_path / "parts"
    _predict(5, d, d / "inputs" / "part-[01].csv.gz", parts, "--part-lines", "90", "--set", "job.num_ps=2")
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


def test_predict_without_labels_parquet_and_evaluate(trained, tmp_path):
    import pyarrow.parquet as pq
    d, sets = trained
    lines, want, _ = _expected(d, sets, d / "inputs" / "part-2.csv.gz")
    _predict(3, d, d / "inputs" / "part-2.csv.gz", tmp_path / "s.parquet")
    got = pq.read_table(tmp_path / "s.parquet").to_pandas()
    assert list(got.columns) == ["line", "id", "probability"] and got["line"].tolist() == lines.tolist()
    np.testing.assert_allclose(got["probability"], want, rtol=1e-5, atol=1e-6)
    # evaluate: every checkpoint of the directory, a row per step; the metrics of the scores above
    r = run_mpi(3, ["-m", "hpcps", "evaluate", "--checkpoint", d / "ck", "--data", d / "inputs" / "part-[01].csv.gz"],
                timeout=240)
    rows = json.loads(next(x for x in r.stdout.splitlines() if x.startswith('{"evaluate"')))["evaluate"]
    assert [x["step"] for x in rows] == sorted(x["step"] for x in rows) and len(rows) >= 2
    _, p, y = _expected(d, sets, d / "inputs" / "part-[01].csv.gz")
    from hpcps.metrics import auc
    best = next(x for x in rows if str(resolve_checkpoint(str(d / "ck" / "best"))) == x["checkpoint"])
    assert best["auc"] == pytest.approx(auc(y, p), abs=1e-6) and best["samples"] == 540
    assert best["calibration"] == pytest.approx(p.mean() / y.mean(), rel=1e-5)
    assert "| step | auc |" in r.stdout


@pytest.mark.parametrize("case, message", [
    ("exists", "exists (use --overwrite"),
    ("inside", "inside the checkpoint directory"),
    ("kind", "model.kind = 'dlrm', but"),
    ("no-dir", "does not exist"),
    ("not-ours", "not a predict output"),
    ("no-ckpt", "no such file"),
])
def test_predict_refuses_bad_input_before_any_communication(trained, tmp_path, case, message):
    """What every rank checks before MPI communicates (hpcps.predict.cli.prepare): nothing written."""
    from hpcps.cli import _parser
    from hpcps.predict.cli import prepare
    d, _ = trained
    ckpt, out, extra = d / "ck" / "best", tmp_path / "s.csv", []
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
    before = sorted(p.name for p in tmp_path.iterdir())
    job, error = prepare(_parser().parse_args(["predict", "--checkpoint", str(ckpt), "--data",
                                               str(d / "inputs" / "part-0.csv.gz"), "--out", str(out), *extra]))
    assert job is None and message in str(error)
    assert sorted(p.name for p in tmp_path.iterdir()) == before and not (d / "ck" / "s.csv").exists()
    if case == "exists":
        assert out.read_text() == "keep me\n"


def test_predict_refuses_columns_that_do_not_give_the_tables(trained, tmp_path):
    d, _ = trained
    r = _predict(3, d, d / "inputs" / "part-0.csv.gz", tmp_path / "s.csv", "--set", "data.drop=w", check=False)
    assert r.returncode != 0 and "do not give" in r.stderr and "'u' (500 rows)" not in r.stderr
    assert not any(tmp_path.iterdir())
