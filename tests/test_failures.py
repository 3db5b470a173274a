"""Failures that must end a job, never hang it: an error on some ranks only, an error on a PS
rank, a stop request without a checkpoint directory, a stop asked of a PS rank alone. Every
launch under an outer timeout (tests/mpirun.py kills what is left)."""

import json
import os
import re
import signal
import time

import pytest

from mpirun import ROOT, launch_mpi, rank_pid, reap, run_mpi

TINY = ROOT / "tests" / "configs" / "tiny_ctr.toml"
QUIET = ["metrics.progress=false", "metrics.path="]


def _train_argv(sets):
    return ["-m", "hpcps", "train", "--config", TINY, "--set", *QUIET, *sets]


def _final(stdout):
    return [json.loads(line) for line in stdout.splitlines() if line.startswith('{"final"')][-1]["final"]


@pytest.mark.openmpi
@pytest.mark.parametrize("sets", [
    ["optimizer.sparse.name=sgd", "optimizer.sparse.lr=1e12", "job.steps=30"],      # sparse rows diverge
    ["optimizer.dense.name=sgd", "optimizer.dense.lr=1e6", "job.steps=30"],        # dense layers diverge
])
def test_an_error_on_some_ranks_ends_the_job_with_its_message(sets):
    """NaN gradients are rejected by the push check on the worker that has them: the job must end
    (it hung in a barrier while the PS served), naming the rank and the problem."""
    t0 = time.time()
    r = run_mpi(3, _train_argv(sets), timeout=120, check=False)
    assert r.returncode not in (0, None), r.stdout
    assert "hpcps: error on world rank" in r.stderr, r.stderr[-3000:]
    assert any(w in r.stderr for w in ("finite", "NaN", "inf", "overflows")), r.stderr[-3000:]
    assert time.time() - t0 < 110


@pytest.mark.openmpi
def test_an_error_on_a_ps_rank_alone_is_reported_by_that_rank(tmp_path):
    ck = tmp_path / "ck"
    run_mpi(3, _train_argv([f"checkpoint.dir={ck}", "job.steps=6"]), timeout=120)
    # resuming with another sparse optimizer: only the PS ranks read the shard files
    r = run_mpi(3, _train_argv([f"checkpoint.dir={ck}", "job.steps=12", "optimizer.sparse.name=adam"]),
                timeout=120, check=False)
    assert r.returncode != 0
    assert "hpcps: error on world rank 2" in r.stderr and "lacks optimizer state" in r.stderr, r.stderr[-3000:]


def _start(tag, sets, tmp_path):
    """Launch a slow 3-rank job and return once it has logged a training step."""
    metrics = tmp_path / f"{tag}.jsonl"
    proc = launch_mpi(3, _train_argv(["job.steps=400", "job.step_delay=0.02", "job.log_every=5",
                                      f"metrics.path={metrics}", *sets]), tag=tag)
    deadline = time.time() + 90
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and '"step"' in metrics.read_text():
            return proc
        time.sleep(0.2)
    reap(proc, timeout=5)
    pytest.fail("the job did not start training within 90 s")


def test_sigterm_without_a_checkpoint_dir_stops_and_says_so(tmp_path):
    tag = f"nockpt-{os.getpid()}"
    proc = _start(tag, [], tmp_path)
    for rank in range(3):
        os.kill(rank_pid(tag, rank), signal.SIGTERM)
    code, out, err = reap(proc, timeout=90)
    assert code == 86, err[-2000:]
    f = _final(out)
    assert f["stopped"] and not f["saved"] and f["steps"] < 400
    assert "without a checkpoint" in err


@pytest.mark.openmpi
def test_sigterm_to_the_ps_alone_checkpoints_and_stops(tmp_path):
    tag = f"psonly-{os.getpid()}"
    ck = tmp_path / "ck"
    proc = _start(tag, [f"checkpoint.dir={ck}"], tmp_path)
    os.kill(rank_pid(tag, 2), signal.SIGTERM)       # world rank 2 is the PS (highest rank of the node)
    code, out, err = reap(proc, timeout=90)
    assert code == 85, err[-2000:]
    f = _final(out)
    assert f["stopped"] and f["saved"] and f["checkpoints"][-1] == f["steps"] < 400


def test_a_batch_smaller_than_the_workers_is_refused_at_start():
    r = run_mpi(4, _train_argv(["data.batch_size=2"]), timeout=60, check=False)
    assert r.returncode == 2 and "data.batch_size = 2: smaller than the 3 workers" in r.stderr, r.stderr[-2000:]


def test_resuming_with_another_dense_model_names_the_layers(tmp_path):
    ck = tmp_path / "ck"
    run_mpi(3, _train_argv([f"checkpoint.dir={ck}", "job.steps=4"]), timeout=120)
    r = run_mpi(3, _train_argv([f"checkpoint.dir={ck}", "job.steps=8", "model.bottom_mlp=[16]"]), timeout=120,
                check=False)
    # named by its key and both values before any row loads (hpcps.train.compat.check_same_model)
    assert r.returncode != 0 and "holds a model with model.bottom_mlp = [8], this run has [16]" in r.stderr, r.stderr[-2000:]


def test_a_read_only_checkpoint_dir_is_refused_before_training(tmp_path):
    import subprocess
    ck = tmp_path / "ck"
    ck.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ck)]).returncode != 0:
        pytest.fail("could not mount a read-only tmpfs (the tests run as root)")
    try:
        r = run_mpi(3, _train_argv([f"checkpoint.dir={ck}", "job.steps=200"]), timeout=120, check=False)
        assert r.returncode != 0 and "is not writable" in r.stderr, r.stderr[-2000:]
        assert '{"final"' not in r.stdout                 # it stopped before training, not after
    finally:
        subprocess.run(["umount", "-l", str(ck)], check=False)


_INF_ROWS = """
import numpy as np, hpcps
hpcps.prepare_process()
opt = hpcps.optim.SGD(lr=1e21, schedule=hpcps.optim.LRSchedule(warmup_steps=1))    # stateful: the PS applies
with hpcps.init(num_ps=1, mode="sync") as ctx:
    t = hpcps.EmbeddingTable(ctx, "w", 10, 2, optimizer=opt)
    if ctx.is_ps:
        ctx.serve()
    else:
        ctx.step_begin(0)
        t.push([1, 2], np.full((2, 2), 1e18, np.float32))       # finite gradients; 1e21 x 1e18 is not
        ctx.step_end(0)
        ctx.fence(1)
        raise SystemExit("the PS applied an update that made rows inf and carried on")
"""


def test_an_optimizer_step_that_makes_rows_inf_stops_the_job_naming_table_and_rows():
    r = run_mpi(2, ["-c", _INF_ROWS], timeout=60, check=False)
    assert r.returncode not in (0, None)
    assert "table 'w': the SGD step of training step 0 made 2 row(s) inf or NaN from finite gradients " \
           "(global ids [1, 2])" in r.stderr, r.stderr[-3000:]


_OVERFLOW = """
import numpy as np, hpcps
hpcps.prepare_process()
with hpcps.init(num_ps=1) as ctx:
    t = hpcps.EmbeddingTable(ctx, "w", 10, 2, optimizer=hpcps.optim.SGD(lr=10.0))
    if ctx.is_ps:
        ctx.serve()
    else:
        before = t.pull(np.arange(10))
        try:
            t.push([1, 2], np.full((2, 2), 1e38, np.float32))
            raise SystemExit("an overflowing push was accepted")
        except ValueError as e:
            assert "overflows float32" in str(e), e
        assert (t.pull(np.arange(10)) == before).all()          # nothing was pushed
        print("OK refused", flush=True)
"""


def test_a_plain_sgd_push_that_would_overflow_is_refused_before_it_lands():
    r = run_mpi(2, ["-c", _OVERFLOW], timeout=60)
    assert "OK refused" in r.stdout


_WORKERS_ONLY = """
import sys, time, hpcps
hpcps.prepare_process()
with hpcps.init(num_ps=1, progress_timeout=3) as ctx:
    if sys.argv[1] == "serving" and ctx.is_ps:
        ctx.serve()
    elif ctx.is_ps:
        time.sleep(60)                         # not serving yet, and never creating the table
    else:
        time.sleep(0.5)
        hpcps.EmbeddingTable(ctx, "only-on-workers", 10, 2)
"""


@pytest.mark.parametrize("ps", ["serving", "busy"])
def test_a_table_created_on_the_workers_only_ends_the_job(ps):
    t0 = time.time()
    r = run_mpi(3, ["-c", _WORKERS_ONLY, ps], timeout=60, check=False)
    assert r.returncode not in (0, None) and time.time() - t0 < 50
    want = "called serve() already" if ps == "serving" else "every rank to create it"
    assert "only-on-workers" in r.stderr and want in r.stderr, r.stderr[-2000:]


# where the stopped rank held the others up decides the words: the sync fence, a shard lock, the
# dense all-reduce; each names it (world rank 1 is worker 1, world rank 2 the PS)
@pytest.mark.openmpi
@pytest.mark.parametrize("victim,named", [(2, r"world rank 2\b"),
                                          (1, r"world rank\(s\) \[1\]|world rank 1\b|worker rank\(s\) \[1\]")])
def test_a_stopped_rank_is_noticed_within_the_progress_timeout_and_named(victim, named, tmp_path):
    tag = f"sigstop-{victim}-{os.getpid()}"
    proc = _start(tag, ["job.progress_timeout=4"], tmp_path)
    pid = rank_pid(tag, victim)
    os.kill(pid, signal.SIGSTOP)
    try:
        code, out, err = reap(proc, timeout=60)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert code not in (0, None), (code, out[-2000:], err[-2000:])
    assert "no progress for 4 s (job.progress_timeout)" in err and re.search(named, err), (code, err[-3000:])


@pytest.mark.openmpi
def test_a_second_job_on_the_same_checkpoint_dir_is_refused_naming_the_first(tmp_path):
    tag = f"lock-{os.getpid()}"
    ck = tmp_path / "ck"
    first = _start(tag, [f"checkpoint.dir={ck}", "checkpoint.every_steps=5"], tmp_path)
    try:
        r = run_mpi(3, _train_argv([f"checkpoint.dir={ck}", "job.steps=10"]), timeout=120, check=False)
        assert r.returncode == 2 and "is in use by another job: host" in r.stderr and "process" in r.stderr, \
            r.stderr[-2000:]
        assert '{"final"' not in r.stdout
    finally:
        for rank in range(3):
            pid = rank_pid(tag, rank)
            if pid:
                os.kill(pid, signal.SIGTERM)
        code, out, err = reap(first, timeout=90)
    assert code == 85, err[-2000:]
    assert not (ck / "LOCK").exists()                   # released once the job wrote its last checkpoint
    steps = _final(out)["steps"] + 3                    # a few steps past where the first one stopped
    r = run_mpi(3, _train_argv([f"checkpoint.dir={ck}", f"job.steps={steps}"]), timeout=180)
    assert "resuming from" in r.stderr and _final(r.stdout)["steps"] == steps
