"""The multi-rank cases of the last abuse round (issue 41): each ended in a hang, a traceback, lost
data or a silent wrong result before; each now ends in a clear error or the right result."""

import json
import os
import signal
import time

import numpy as np
import pytest

from hpcps.checkpoint import local, store
from mpirun import ROOT, launch_mpi, reap, run_mpi

TINY = ROOT / "tests" / "configs" / "tiny_ctr.toml"


def _train(n, sets, **kw):
    return run_mpi(n, ["-m", "hpcps", "train", "--config", TINY, "--set", "metrics.progress=false", *sets], **kw)


def _final(stdout):
    return [json.loads(x) for x in stdout.splitlines() if x.startswith('{"final"')][-1]["final"]


def _error(r) -> str:
    lines = [x for x in r.stderr.splitlines() if "error" in x.lower() or "Error" in x]
    return "\n".join(lines) or r.stderr[-2000:]


def test_checkpoint_dir_of_an_earlier_run_and_another_dense_optimizer_are_clear_errors(tmp_path):
    """resume = none over an earlier run's checkpoints (they would mix: a restart took the old
    newest step); a restart with another dense optimizer (torch's KeyError before)."""
    ck = tmp_path / "ck"
    first = _final(_train(3, [f"checkpoint.dir={ck}", "checkpoint.every_steps=10", "job.steps=20"]).stdout)
    assert first["checkpoints"] == [10, 20]
    started = json.loads((ck / "STARTED").read_text())        # this job's processes, to signal them alone
    assert len(started["pids"]) == len(started["hosts"]) == 3 and all(isinstance(p, int) for p in started["pids"])
    r = _train(3, [f"checkpoint.dir={ck}", "checkpoint.resume=none", "job.steps=40"], check=False)
    assert r.returncode != 0 and "checkpoint.resume = none, but checkpoint.dir" in _error(r)
    assert "holds 2 checkpoint(s) of an earlier run (newest step-000000020)" in _error(r)
    r = _train(3, [f"checkpoint.dir={ck}", "job.steps=40", "optimizer.dense.name=adam"], check=False)
    assert r.returncode != 0 and "trained with optimizer.dense.name = 'sgd', this run has 'adam'" in _error(r)
    assert "KeyError" not in r.stderr
    assert [p.name for p in store.list_checkpoints(ck)] == ["step-000000010", "step-000000020"]   # untouched


def test_tables_larger_than_the_hosts_memory_are_refused_before_any_allocation():
    """model.dim = 1e8: make_tables' first step compares what the tables take per PS (rows,
    optimizer state, staging) with the host's available memory (numpy's 7 TiB allocation error
    before)."""
    from types import SimpleNamespace
    from hpcps.config import load_config
    from hpcps.data import make_data
    from hpcps.train.tables import check_table_memory
    cfg = load_config(TINY, ["model.dim=100000000", "data.rows_per_table=100000"], environ={})
    data = make_data(cfg.data, 0, 1, 0)
    ctx = SimpleNamespace(node_ranks=[0, 1, 2], ps_world_ranks=[0], num_ps=1)
    with pytest.raises(ValueError, match=r"the tables need [0-9.]+ TiB of memory on this host \(1 PS rank\(s\) x "):
        check_table_memory(cfg, ctx, data, 30)
    check_table_memory(load_config(TINY, [], environ={}), ctx, data, 30)      # the tiny job fits


def test_a_second_job_sharing_the_local_dir_leaves_the_first_ones_parts(tmp_path):
    """Job A (its own checkpoint.dir) writes node-local checkpoints and is killed -9 before any
    filesystem checkpoint; job B, another checkpoint.dir, the same local_dir, runs to its end; A's
    restart resumes from its own node-local step (before: B deleted A's parts, A restarted at 0)."""
    loc = tmp_path / "local"
    a, b = tmp_path / "a", tmp_path / "b"
    sets = [f"checkpoint.local_dir={loc}", "checkpoint.local_every=2", "checkpoint.every_steps=1000",
            "job.steps=400", "metrics.progress=false"]
    proc = launch_mpi(3, ["-m", "hpcps", "train", "--config", TINY, "--set", *sets, f"checkpoint.dir={a}"],
                      env={"HPCPS_STEP_DELAY": "0.05"})
    deadline = time.time() + 90
    while time.time() < deadline and len(local.scan(local.job_root(loc, a), check=False)) < 6:
        time.sleep(0.05)
    assert local.scan(local.job_root(loc, a), check=False), "job A wrote no node-local part"
    os.killpg(proc.pid, signal.SIGKILL)
    reap(proc)
    assert not store.list_checkpoints(a)
    _train(3, sets[:2] + ["job.steps=8", f"checkpoint.dir={b}"])
    f = _final(_train(3, sets[:3] + ["job.steps=12", f"checkpoint.dir={a}"]).stdout)
    assert f["restored_from"] == "local" and f["start_step"] >= 2


def test_a_streamed_restart_on_changed_files_is_refused(tmp_path):
    """The input grew between a checkpoint mid-epoch and the restart: the recorded reading plan no
    longer fits the files (an IndexError or a run that trained nothing before)."""
    rng = np.random.default_rng(0)
    rows = [f"{rng.integers(0, 2)},u{rng.integers(0, 50)},v{rng.integers(0, 9)}" for _ in range(2000)]
    data = tmp_path / "d.csv"
    data.write_text("label,u,v\n" + "\n".join(rows[:1500]) + "\n")
    sets = ["data.format=csv", f"data.path={data}", "data.label=label", "data.reader=stream", "data.batch_size=50",
            "job.steps=0", "job.epochs=1", "data.eval_fraction=0.1", "data.hash_rows=100", "model.kind=wide_deep",
            f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.every_steps=10", "metrics.progress=false"]
    proc = launch_mpi(3, ["-m", "hpcps", "train", "--set", *sets], env={"HPCPS_STEP_DELAY": "0.1"})
    deadline = time.time() + 90
    while time.time() < deadline and not store.list_checkpoints(tmp_path / "ck"):
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    reap(proc)
    data.write_text("label,u,v\n" + "\n".join(rows) + "\n")
    r = run_mpi(3, ["-m", "hpcps", "train", "--set", *sets], check=False)
    assert r.returncode != 0 and "training lines; data.path now holds" in _error(r), r.stderr[-2000:]
    assert "IndexError" not in r.stderr


def test_no_held_out_samples_ends_with_strict_json_and_no_metric(tmp_path):
    """data.eval_fraction = 0 and no eval_path: the final line is strict JSON without an AUC
    (a numpy warning and "auc": NaN before)."""
    rng = np.random.default_rng(1)
    data = tmp_path / "d.csv"
    data.write_text("label,u\n" + "\n".join(f"{rng.integers(0, 2)},u{rng.integers(0, 9)}" for _ in range(300)) + "\n")
    r = _train(2, ["data.format=csv", f"data.path={data}", "data.label=label", "data.eval_fraction=0",
                   "job.steps=5", "data.batch_size=20", "model.kind=lr"])
    line = next(x for x in r.stdout.splitlines() if x.startswith('{"final"'))
    final = json.loads(line, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))["final"]
    assert final["eval_samples"] == 0 and "auc" not in final and "RuntimeWarning" not in r.stderr


def test_a_dynamic_table_step_that_pulls_without_pushing_ends_in_an_error_not_a_hang():
    """Sync mode, a dynamic table: a worker pulls and ends its step without the push (say, after
    catching an over-capacity error), then finalizes: the PS says so at once (it waited forever)."""
    r = run_mpi(2, ["dynamic_no_push.py"], timeout=60, check=False)
    assert r.returncode != 0, r.stdout
    assert "finished (finalize) without its push of step 0" in r.stderr, r.stderr[-2000:]
