"""Evaluations during training: each epoch's end and every ``job.eval_every`` steps, the best
checkpoint (``checkpoint.keep_best``, never pruned), early stopping, the export of the best, the
best model restored at the end (``job.restore_best``), and a restart of an early-stopped run that trains no more (and refuses other data)."""

import json
import subprocess
import sys

import numpy as np
import pytest

from hpcps.checkpoint import store, tools
from mpirun import ROOT, run_mpi

TINY = ROOT / "tests" / "configs" / "tiny_ctr.toml"


def _final(stdout):
    return [json.loads(line)["final"] for line in stdout.splitlines() if line.startswith('{"final"')][-1]


@pytest.fixture(scope="module")
def ratings(tmp_path_factory):
    """Random ratings: nothing to learn, so an over-eager model's eval RMSE soon gets worse."""
    path = tmp_path_factory.mktemp("ratings") / "r.dat"
    rng = np.random.default_rng(1)
    path.write_text("".join(f"{rng.integers(60)}::{rng.integers(50)}::{rng.integers(1, 6)}\n" for _ in range(3000)))
    return path


def _ratings_run(ratings, tmp_path, *sets, timeout=240, check=True):
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    r = run_mpi(3, ["-m", "hpcps", "train", "--config", ROOT / "examples" / "ratings.toml", "--set",
                    f"data.path={ratings}", "data.batch_size=100", "job.epochs=30", "optimizer.sparse.lr=0.05",
                    "metrics.progress=false", f"metrics.path={metrics}", f"checkpoint.dir={ck}", "checkpoint.keep=1",
                    *sets], timeout=timeout, check=check)
    return r, ck, [json.loads(line) for line in metrics.read_text().splitlines()] if check else []


def test_best_checkpoint_early_stop_export_and_a_restart_that_trains_no_more(ratings, tmp_path):
    out = tmp_path / "best.npz"
    r, ck, recs = _ratings_run(ratings, tmp_path, "checkpoint.keep_best=rmse", "job.early_stop_patience=2",
                               f"job.export={out}", "job.export_best=true")
    final = _final(r.stdout)
    evals = [(x["step"], x["eval"]["rmse"]) for x in recs if "eval" in x]
    assert [s for s, _ in evals] == [27 * (i + 1) for i in range(len(evals))]     # each epoch's end (2700 / 100)
    best_step, best_rmse = min(evals, key=lambda e: e[1])
    assert final["early_stopped"] and final["steps"] == evals[-1][0] < 30 * 27
    assert all(v > best_rmse for _, v in evals[-2:]) and evals[-3][0] == best_step     # 2 worse ones, then stop
    assert final["best"]["step"] == best_step and final["best"]["rmse"] == pytest.approx(best_rmse, abs=1e-9)
    assert "early stop after step" in r.stderr and "(the best rmse)" in r.stderr
    assert final["exported"] == {"path": str(out), "step": best_step, "best": True}
    best = store.read_best(ck)
    assert best["step"] == best_step and store.verify(best["path"])[0]      # kept although checkpoint.keep = 1
    assert {p.name for p in store.list_checkpoints(ck)} == {best["checkpoint"], f"step-{final['steps']:09d}"}
    got, want = np.load(out), tools.weights(best["path"])
    assert set(got.files) == set(want) and all(np.array_equal(got[k], want[k]) for k in want)
    # the run ends with the best evaluation's model: the final line scores it, the last checkpoint holds it
    assert final["restored_best"] == best_step and f"restored the best evaluation, step {best_step}" in r.stderr
    assert final["rmse"] == pytest.approx(best_rmse, abs=1e-9) and final["rmse"] < evals[-1][1]
    last = store.step_dir(ck, final["steps"])
    assert store.read_manifest(last)["restored_best"] == best_step
    held = tools.weights(last)
    assert set(held) == set(want) and all(np.array_equal(held[k], want[k]) for k in want)
    ls = subprocess.run([sys.executable, "-m", "hpcps", "ckpt", "ls", str(ck)], capture_output=True, text=True)
    assert f"best rmse {best_rmse:.5g}" in ls.stdout
    # the same command again: that run is over
    again, _, _ = _ratings_run(ratings, tmp_path, "checkpoint.keep_best=rmse", "job.early_stop_patience=2")
    assert "stopped early at step" in again.stderr
    assert _final(again.stdout)["start_step"] == _final(again.stdout)["steps"] == final["steps"]
    # the same checkpoint.dir for other data: refused, naming the key, and nothing stored changes
    other = tmp_path / "other.dat"
    other.write_text(ratings.read_text())
    kept = sorted(p.name for p in store.list_checkpoints(ck))
    moved, _, _ = _ratings_run(other, tmp_path, "checkpoint.keep_best=rmse", check=False)
    assert moved.returncode != 0 and "was trained with data.path" in moved.stderr and "checkpoint.resume" in moved.stderr
    assert sorted(p.name for p in store.list_checkpoints(ck)) == kept and store.read_best(ck)["step"] == best_step


def test_a_resumed_run_keeps_the_best_model_of_the_runs_before(ratings, tmp_path):
    """Issue 51.1: the last step's checkpoint was written before that step's evaluation, so its
    manifest said no best; a resumed run judged from there and pruned the earlier runs' best model."""
    sets = ("checkpoint.keep_best=rmse", "job.restore_best=false")
    one, ck, _ = _ratings_run(ratings, tmp_path, *sets, "job.epochs=1")
    first = _final(one.stdout)
    assert first["steps"] == 27
    assert store.read_manifest(store.step_dir(ck, 27))["evaluations"]["best"]["step"] == 27
    # a second epoch that makes the model worse (a learning rate 40x the first)
    two, _, _ = _ratings_run(ratings, tmp_path, *sets, "job.epochs=2", "optimizer.sparse.lr=2")
    second = _final(two.stdout)
    assert second["start_step"] == 27 and second["rmse"] > first["rmse"]
    assert second["best"]["step"] == 27 and store.read_best(ck)["step"] == 27
    # issue 51.14: a line a person reads before the JSON line
    assert "hpcps: done: 27 steps in" in one.stdout and "eval RMSE" in one.stdout
    assert "hpcps: done: steps 27-54 in" in two.stdout and "best evaluation at step 27" in two.stdout
    assert f"checkpoints: {ck} (last step 54)" in two.stdout and two.stdout.splitlines()[-1].startswith('{"final"')
    assert store.verify(store.step_dir(ck, 27))[0]           # kept although checkpoint.keep = 1


def test_eval_every_steps_on_the_progress_record_in_the_report_and_in_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    metrics, tb = tmp_path / "m.jsonl", tmp_path / "tb"
    r = run_mpi(3, ["-m", "hpcps", "train", "--config", TINY, "--set", "job.steps=30", "job.log_every=7",
                    "job.eval_every=10", f"metrics.path={metrics}", "metrics.progress=false",
                    f"metrics.tensorboard={tb}", "metrics.every=0.1", "job.step_delay=0.01"], timeout=240)
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    monitor = [x for x in recs if "monitor" in x]                 # the monitor's host records
    assert monitor and all(x["ps"][0]["busy"] is not None and x["rss_mb"] > 100 for x in monitor)
    assert [x["step"] for x in recs if "eval" in x] == [10, 20]                   # the end's is the final line
    assert sorted(x["step"] for x in recs if "step" in x) == [7, 10, 14, 20, 21, 28, 30]
    final = _final(r.stdout)
    assert final["evaluations"] == 3 and final["best"]["metric"] == "auc" and not final["early_stopped"]
    acc = EventAccumulator(str(tb))                              # the same figures, read back by TensorBoard
    acc.Reload()
    assert {"train/loss", "train/samples_per_s", "time_s/pull", "ps0/rows", "eval/auc", "final/auc"} <= set(acc.Tags()["scalars"])
    steps = [x for x in recs if "step" in x]
    assert [e.step for e in acc.Scalars("train/loss")] == [x["step"] for x in steps]
    np.testing.assert_allclose([e.value for e in acc.Scalars("train/loss")], [x["loss"] for x in steps], rtol=1e-6)
    assert [e.step for e in acc.Scalars("eval/auc")] == [10, 20]
    assert acc.Scalars("final/auc")[0].value == pytest.approx(final["auc"], rel=1e-6)
    host = monitor[0]["host"]
    assert [e.step for e in acc.Scalars("ps0/busy")] == [x["monitor"] for x in monitor]
    assert acc.Scalars(f"host/{host}/mem_used_mb")[-1].value == pytest.approx(monitor[-1]["mem_used_mb"])
    rep = subprocess.run([sys.executable, "-m", "hpcps", "report", str(metrics), "--out", str(tmp_path / "rep")],
                         capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0, rep.stderr
    assert "best auc" in (tmp_path / "rep" / "summary.md").read_text()


def _baseline(*args):
    r = subprocess.run([sys.executable, "-m", "hpcps", "baseline", *map(str, args)], capture_output=True,
                       text=True, timeout=300, cwd=ROOT)
    return r, ([json.loads(line)["baseline"] for line in r.stdout.splitlines() if line.startswith('{"baseline"')]
               or [None])[0]


def test_baseline_ratings_biases_beat_the_global_mean_on_the_same_split(tmp_path):
    # planted biases: user u rates +0.5 above the mean if u is even, item i +1 if i < 10
    rng = np.random.default_rng(2)
    lines = []
    for _ in range(4000):
        u, i = rng.integers(80), rng.integers(40)
        lines.append(f"{u}::{i}::{3 + 0.5 * (u % 2 == 0) + (i < 10) + rng.normal(0, 0.3):.2f}\n")
    path = tmp_path / "r.dat"
    path.write_text("".join(lines))
    r, res = _baseline("--config", ROOT / "examples" / "ratings.toml", "--set", f"data.path={path}")
    assert r.returncode == 0, r.stderr
    assert res["model"].startswith("biases") and res["eval_samples"] == 400 and res["train_samples"] == 3600
    assert res["rmse"] < 0.35 < 0.55 < np.std([float(x.split("::")[2]) for x in lines])   # near the noise (0.3)


def test_baseline_ctr_logistic_regression_and_bad_input(tmp_path):
    r, res = _baseline("--config", TINY, "--set", "job.steps=30")
    assert r.returncode == 0, r.stderr
    assert res["model"] == "hashed logistic regression (L2, C=0.1)" and res["train_samples"] == 30 * 48
    assert 0.6 < res["auc"] <= 1 and 0 < res["logloss"] < 0.7
    r, res = _baseline("--config", TINY, "--c", "0")
    assert r.returncode == 2 and res is None and "--c 0.0: must be > 0" in r.stderr
    r, _ = _baseline("--config", TINY, "--set", "data.format=criteo", "data.path=/nope")
    assert r.returncode == 2 and "data.path = '/nope': no such file" in r.stderr
