"""hpcps report: plots and summary from metrics files (restarted runs appended) and bench results."""

import json
import subprocess
import sys

import pytest

from hpcps.tools.report import load_metrics, write_report
from mpirun import ROOT


def _step(step, t, stale=0):
    return {"time": t, "step": step, "loss": 1.0 / step, "samples_per_s": 1000.0 + step, "staleness": stale,
            "rows_per_ps": [10 * step, 12 * step], "bytes_per_ps": [640 * step, 768 * step],
            "staleness_counts": {str(stale): 10},
            "time_breakdown_s": {"data": 0.01, "idle": 0.02, "pull": 0.01, "forward_backward": 0.05, "push": 0.02,
                                 "dense_allreduce": 0.01}}


def _metrics(path):
    recs = [_step(10, 1.0), _step(20, 2.0, 1), {"time": 2.1, "checkpoint": 20, "stall_s": 0.05},
            _step(30, 3.0)]                                    # killed: no final line
    recs += [_step(30, 1.0), _step(40, 2.0, 2), {"time": 2.5, "final": {
        "auc": 0.8, "planted_auc": 0.85, "logloss": 0.4, "steps": 40, "start_step": 20, "num_ps": 2,
        "num_workers": 3, "mode": "ssp:2", "samples_per_s": 1234.0, "max_staleness": 2, "checkpoints": [40],
        "checkpoint_timings": [{"step": 40, "kind": "full", "bytes": 100, "stall_s": 0.04, "write_s": 0.3}],
        "checkpoint_stall_s": 0.04,
        "memory": {"ps_peak_rss_mb": [300.0, 301.0], "ps_table_mb": [1.0, 1.0], "worker_peak_rss_mb": [400.0]}}}]
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")


def test_runs_of_a_resumed_job_are_split_and_continue_in_time(tmp_path):
    _metrics(tmp_path / "m.jsonl")
    runs = load_metrics(tmp_path / "m.jsonl")
    assert [[s["step"] for s in r["steps"]] for r in runs] == [[10, 20, 30], [30, 40]]
    assert runs[0]["final"] is None and runs[1]["final"]["steps"] == 40
    assert runs[1]["offset"] == 3.0 and len(runs[0]["checkpoints"]) == 1


def test_runs_are_split_by_their_start_records_named_dated_and_said_killed_or_idle(tmp_path):
    """Issue 51.16: runs of one file told apart by their start records (a run's steps need not go
    back); a killed run said so; a run with nothing to train kept (the numbering skipped it); each
    run's start time and command in the summary; checkpoints one line a run."""
    start = lambda k: {"start": {"run": f"r{k}", "utc": f"2026-12-0{k}T00:00:00Z",      # noqa: E731
                                 "command": f"hpcps train --set job.steps={40 * k}", "slurm_job": None}}
    final = {"auc": 0.7, "logloss": 0.5, "steps": 40, "start_step": 40, "mode": "sync", "max_staleness": 0}
    recs = [start(1), _step(10, 1.0), {"time": 1.1, "checkpoint": 10, "stall_s": 0.05}, _step(20, 2.0),
            start(2), _step(30, 1.0), {"time": 1.1, "checkpoint": 30, "stall_s": 0.05}, _step(40, 2.0),   # killed
            start(3), {"time": 0.5, "final": final}]                                                       # idle
    (tmp_path / "m.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    runs = load_metrics(tmp_path / "m.jsonl")
    assert [[s["step"] for s in r["steps"]] for r in runs] == [[10, 20], [30, 40], []]
    assert [r["name"] for r in runs] == ["m run 1", "m run 2", "m run 3"] and [r["killed"] for r in runs] == [True, True, False]
    write_report(tmp_path / "m.jsonl", tmp_path / "rep")
    summary = (tmp_path / "rep" / "summary.md").read_text()
    assert "- started 2026-12-02T00:00:00Z (run r2): `hpcps train --set job.steps=80`" in summary
    assert "## m run 2\n\n- started" in summary and "no final line: killed, or still running (last record at step 40)" in summary
    assert "## m run 3" in summary and "nothing to train: it started at step 40 of 40" in summary


def test_a_sync_run_has_no_staleness_plot_and_the_breakdown_leaves_the_start_out(tmp_path):
    """Sync mode sees staleness 0 at every step (one bar at 0 said nothing); the first record of a
    run (the start: 440 ms a step) set the breakdown's scale for all the others."""
    recs = [_step(10 * k, float(k)) for k in range(1, 5)]
    recs[0]["time_breakdown_s"]["forward_backward"] = 4.4
    recs.append({"time": 5.0, "final": {"auc": 0.7, "logloss": 0.5, "steps": 40, "start_step": 0, "mode": "sync",
                                        "max_staleness": 0}})
    (tmp_path / "m.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    names = {f.name for f in write_report(tmp_path / "m.jsonl", tmp_path / "rep")}
    assert "staleness.png" not in names and "time_breakdown.png" in names
    assert "max staleness: 0 (0 at every step: no staleness plot)" in (tmp_path / "rep" / "summary.md").read_text()


def test_report_writes_plots_and_a_summary_with_bench_ratios(tmp_path):
    res = tmp_path / "results"
    res.mkdir()
    _metrics(res / "m.jsonl")
    (res / "bench_e2e.json").write_text(json.dumps({"hpcps_vs_torch_rpc": 0.98, "targets": {"hpcps_vs_torch_rpc": 2.0}}))
    (res / "bench_sparse.json").write_text(json.dumps({"ratios": {"pull_vs_local_gather": 0.86},
                                                       "targets": {"pull_vs_local_gather": 0.8}}))
    (res / "bench_dtype.json").write_text(json.dumps({"results": {"pull_bf16": {"auc_minus_float32": -0.00012,
                                                                                 "bytes_vs_float32": 0.75}}}))
    files = write_report(res, tmp_path / "report")
    names = {f.name for f in files}
    assert names == {"loss.png", "throughput.png", "time_breakdown.png", "staleness.png", "load_balance.png",
                     "checkpoints.png", "summary.md"}
    for f in files:
        if f.suffix == ".png":
            assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f.stat().st_size > 5000
    md = (tmp_path / "report" / "summary.md").read_text()
    assert "## m run 1" in md and "## m run 2" in md and "auc: 0.8000" in md
    assert "hpcps_vs_torch_rpc: 0.98 (target 2.0)" in md and "load balance: max/mean rows per PS = 1.09" in md
    assert "peak RSS: PS [300.0, 301.0] MB" in md and "![loss](loss.png)" in md
    assert "pull_vs_local_gather: 0.86 (target 0.8)" in md
    assert "pull_bf16 auc_minus_float32: -0.0001" in md and "pull_bf16 bytes_vs_float32: 0.75" in md


def test_report_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="no such file or directory"):
        write_report(tmp_path / "nope", tmp_path / "r")
    with pytest.raises(ValueError, match="holds no"):
        write_report(tmp_path, tmp_path / "r")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not a JSON line"):
        write_report(bad, tmp_path / "r")
    r = subprocess.run([sys.executable, "-m", "hpcps", "report", str(bad), "--out", str(tmp_path / "r")],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and "bad.jsonl:2" in r.stderr


def test_progress_in_a_batch_log_is_a_plain_line_every_5_percent():
    """Not a terminal (a batch job's log): plain lines, the first at 5% (a short run showed 0% and
    then the end), none redrawn with carriage returns."""
    import io
    from hpcps.train.telemetry import LineProgress
    out = io.StringIO()
    bar = LineProgress(100, 0, out=out)
    for k in range(100):
        bar.update(1)
        if k == 50:
            bar.set_postfix({"loss": "0.5"})
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 20 and "\r" not in out.getvalue()
    assert lines[0].startswith("train: step 5/100 (5%)") and lines[-1].startswith("train: step 100/100 (100%)")
    assert lines[-1].endswith(", loss 0.5")


def test_epochs_auto_counts_each_epoch_not_max_epochs_times_its_steps(monkeypatch):
    """Issue 51.15: with job.epochs = "auto" the bar's denominator was max_epochs x steps (a run that
    stopped at "15%"); now each epoch counts to its steps, named "epoch k (of at most M)"."""
    import io
    import sys
    from hpcps.train import telemetry
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)           # not a terminal: plain lines
    bar = telemetry.EpochBar(steps_per_epoch=40, max_epochs=50, initial=0)
    for k in range(100):
        bar.update(1)
        if k == 39:
            bar.set_postfix({"eval_auc": "0.7112"})
    bar.close()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("epoch 1 (of at most 50): step 2/40 (5%)")
    assert any(x.startswith("epoch 1 (of at most 50): step 40/40 (100%)") for x in lines)
    assert lines[-1].startswith("epoch 3 (of at most 50): step 20/40 (50%)") and lines[-1].endswith("eval_auc 0.7112")
    resumed = telemetry.EpochBar(steps_per_epoch=40, max_epochs=50, initial=90)
    assert resumed.epoch == 2 and resumed.bar.n == 10
