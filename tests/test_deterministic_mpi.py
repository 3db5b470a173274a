"""Deterministic sync mode under a real mpiexec: reruns and restarts give the same bits."""

import json
import os
import random
import signal
import time

import numpy as np
import pytest

from hpcps.checkpoint import store
from mpirun import ROOT, launch_mpi, rank_pid, reap, run_mpi

TINY = ROOT / "tests" / "configs" / "tiny_ctr.toml"
MAIN = ROOT / "examples" / "ctr.toml"
# the main job, short: 60 steps, a checkpoint every 10. Adagrad's eps 1e-3, not 1e-10: a row's first
# step is lr * g / (|g| + eps), so where a first gradient nearly cancels, the restart on 2 workers
# (other summation groups) would flip its sign and land 2 * lr = 0.3 away (a suite run saw it)
MAIN_SETS = ["job.steps=60", "job.eval_every=0", "checkpoint.every_steps=10", "optimizer.sparse.eps=1e-3"]


def _final(stdout):
    return [json.loads(l) for l in stdout.splitlines() if l.startswith('{"final"')][-1]["final"]


def _train(n, config, sets, env=None, **kw):
    return run_mpi(n, ["-m", "hpcps", "train", "--config", config, "--set", *sets], env=env, timeout=240, **kw)


def _assert_bit_equal(a, b):
    a, b = np.load(a), np.load(b)
    assert set(a.files) == set(b.files) and len(a.files) > 4
    for k in a.files:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _metrics(path):
    """The per-step metrics records without their timings (and run ids)."""
    timing = {"time", "run", "elapsed_s", "samples_per_s", "step_s", "wait_s", "push_s", "pull_s"}
    out = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "step" not in rec:                     # the final record: compared through its metrics
            continue
        out.append({k: v for k, v in rec.items() if k not in timing and not k.endswith(("_s", "_ms", "_seconds"))})
    return out


@pytest.mark.parametrize("case", [
    # one PS over RMA: Adam, 16-bit pulls and pushes, prefetch on the communication thread; the
    # second run's push mailbox so small that every push travels in pieces of 16 rows
    dict(n=4, sets=["job.num_ps=1", "job.transport=rma", "optimizer.sparse.name=adam", "optimizer.sparse.lr=0.05",
                    "pipeline.pull_dtype=bfloat16", "pipeline.push_dtype=bfloat16", "pipeline.prefetch=on",
                    "pipeline.background_push=on", "job.mpi_threads=multiple"],
         second={"HPCPS_MAILBOX_BYTES": str(16 * 3 * (8 + 4 * 2))}),
    # two PS on this node (shared memory), plain SGD (applied by the PS in this mode), a table per
    # feature, the batch loader
    dict(n=5, sets=["job.num_ps=2", "optimizer.sparse.name=sgd", "optimizer.sparse.lr=0.3",
                    "model.fuse_tables=false", "pipeline.loader=on"], second={}),
], ids=["rma-adam-16bit-prefetch-pieces", "shm-2ps-sgd-unfused-loader"])
def test_two_runs_are_bit_equal(tmp_path, case):
    finals = []
    for run, env in (("a", {}), ("b", case["second"])):
        sets = case["sets"] + ["job.steps=25", f"job.export={tmp_path / run}.npz", "job.eval_every=10",
                               f"metrics.path={tmp_path / run}.jsonl", "job.log_every=5"]
        finals.append(_final(_train(case["n"], TINY, sets, env=env).stdout))
    _assert_bit_equal(tmp_path / "a.npz", tmp_path / "b.npz")
    assert finals[0]["auc"] == finals[1]["auc"] and finals[0]["logloss"] == finals[1]["logloss"]
    assert _metrics(tmp_path / "a.jsonl") == _metrics(tmp_path / "b.jsonl") != []


@pytest.fixture(scope="module")
def main_straight(tmp_path_factory):
    """The main job's uninterrupted run, to compare the killed and restarted ones with."""
    d = tmp_path_factory.mktemp("main")
    _train(4, MAIN, MAIN_SETS + [f"checkpoint.dir={d / 'ck'}", f"job.export={d / 'w.npz'}"])
    return d / "w.npz"


@pytest.mark.openmpi
@pytest.mark.parametrize("victim", ["ps", "worker"])
def test_kill_9_any_rank_then_restart_is_bit_equal_to_an_uninterrupted_run(tmp_path, main_straight, victim):
    rng = random.Random(os.getpid())
    rank = 3 if victim == "ps" else rng.randrange(3)          # rank 3 is the PS of 4 ranks
    tag = f"det-kill-{victim}-{os.getpid()}"
    ck = tmp_path / "ck"
    argv = ["-m", "hpcps", "train", "--config", MAIN, "--set", *MAIN_SETS, f"checkpoint.dir={ck}",
            f"job.export={tmp_path / 'w.npz'}"]
    proc = launch_mpi(4, argv, env={"HPCPS_STEP_DELAY": "0.05"}, tag=tag)
    deadline = time.time() + 90
    while time.time() < deadline and not store.list_checkpoints(ck):
        time.sleep(0.05)
    time.sleep(rng.uniform(0.0, 1.5))                         # a random step after the first checkpoint
    pid = rank_pid(tag, rank)
    assert pid, "rank not found"
    os.kill(pid, signal.SIGKILL)
    code, _, _ = reap(proc)
    assert code != 0 and not (tmp_path / "w.npz").exists()    # it died before the end
    f = _final(_train(4, MAIN, argv[6:]).stdout)              # the same command again
    assert 10 <= f["start_step"] < 60
    _assert_bit_equal(tmp_path / "w.npz", main_straight)


def test_restart_on_more_ps_is_bit_equal_and_on_other_workers_close(tmp_path, main_straight):
    # the same 3 workers on 2 PS: each row's gradients are still summed in worker order, so the same
    # bits. 2 workers: the global batch's gradient is summed in other groups: close, not equal
    ck = tmp_path / "ck"
    _train(4, MAIN, MAIN_SETS + [f"checkpoint.dir={ck}", "job.steps=30"])
    for n, ps, out in ((5, 2, "p2"), (3, 1, "w2")):
        copy = tmp_path / f"ck-{out}"
        os.system(f"cp -a {ck} {copy}")
        f = _final(_train(n, MAIN, MAIN_SETS + [f"checkpoint.dir={copy}", f"job.num_ps={ps}",
                                                f"job.export={tmp_path / out}.npz"]).stdout)
        assert f["start_step"] == 30 and f["num_ps"] == ps and f["num_workers"] == n - ps
    _assert_bit_equal(tmp_path / "p2.npz", main_straight)
    a, b = np.load(tmp_path / "w2.npz"), np.load(main_straight)
    worst = max(float(np.abs(a[k] - b[k]).max()) for k in a.files)
    assert 0 < worst < 0.05, worst


def _live(n, argv, ck, victims, tag, rng):
    """Launch ``n`` ranks under ULFM, SIGKILL each victim (launch rank) in turn, a random moment after
    the first checkpoint in ``ck`` and then after the job went on; ``(exit code, final summary, stderr,
    the final line in words)``."""
    proc = launch_mpi(n, argv, env={"HPCPS_STEP_DELAY": "0.05"}, tag=tag, ft=True)
    deadline = time.time() + 90
    while time.time() < deadline and not store.list_checkpoints(ck):
        time.sleep(0.05)
    for victim in victims:
        time.sleep(rng.uniform(0.2, 1.2))
        pid = rank_pid(tag, victim)
        assert pid, f"rank {victim} not found"
        os.kill(pid, signal.SIGKILL)
        time.sleep(1.0)                                        # the survivors shrink and go on
    code, out, err = reap(proc, timeout=120)
    finals = [json.loads(l)["final"] for l in out.splitlines() if l.startswith('{"final"')]
    done = [l for l in out.splitlines() if l.startswith("hpcps: done:")]
    return code, finals[-1] if finals else None, err, done[-1] if done else ""


@pytest.mark.openmpi
@pytest.mark.ulfm
def test_live_failover_a_ps_then_a_worker_killed_ends_bit_equal_without_a_restart(tmp_path, main_straight):
    # 6 ranks: 2 standbys (launch ranks 4, 5), a job of 1 PS (rank 3) and 3 workers. The PS is killed
    # -9, standby 4 becomes the PS (the highest rank of the job's world); then a worker, and standby 5
    # takes its place: the same PS and worker counts from the last checkpoint, so the same bits
    rng = random.Random(os.getpid())
    worker = rng.randrange(3)
    argv = ["-m", "hpcps", "train", "--config", MAIN, "--set", *MAIN_SETS, "job.standby=2",
            f"job.export={tmp_path / 'w.npz'}", f"checkpoint.dir={tmp_path / 'ck'}", "job.log_every=5"]
    code, f, err, done = _live(6, argv, tmp_path / "ck", [3, worker], f"live-{os.getpid()}", rng)
    assert code == 0 and f is not None, err[-3000:]
    got = [(r["lost_ranks"], r["standbys_taking_over"]) for r in f["recoveries"]]
    assert got == [([3], [4]), ([worker], [5])], f["recoveries"]
    for r in f["recoveries"]:
        assert 10 <= r["from_step"] < 60 and 0 < r["seconds_to_next_step"] < 30, r
        # every step after the checkpoint done again, by each of the 3 workers (less a lost one's)
        assert r["updates_lost"] == 0 and r["pushes_redone"] >= 2 * r["steps_redone"] - 2, r
    assert done.count("went on live from step") == 2 and "0 updates lost" in done, done
    assert f["num_ps"] == 1 and f["num_workers"] == 3 and "live failover (ULFM), 0 standby" in f["layout"]["failover"]
    assert err.count("going on from the last checkpoint without a restart") == 2
    _assert_bit_equal(tmp_path / "w.npz", main_straight)


@pytest.mark.openmpi
@pytest.mark.ulfm
def test_live_failover_with_no_standby_goes_on_with_the_surviving_workers(tmp_path, main_straight):
    rng = random.Random(os.getpid() + 1)
    worker = rng.randrange(3)
    argv = ["-m", "hpcps", "train", "--config", MAIN, "--set", *MAIN_SETS,
            f"job.export={tmp_path / 'w.npz'}", f"checkpoint.dir={tmp_path / 'ck'}", "job.log_every=5"]
    code, f, err, _ = _live(4, argv, tmp_path / "ck", [worker], f"live0-{os.getpid()}", rng)
    assert code == 0 and f is not None, err[-3000:]
    assert [r["lost_ranks"] for r in f["recoveries"]] == [[worker]] and f["recoveries"][0]["standbys_taking_over"] == []
    assert f["num_ps"] == 1 and f["num_workers"] == 2 and "too few standbys left" in err
    a, b = np.load(tmp_path / "w.npz"), np.load(main_straight)      # other summation groups: close
    assert max(float(np.abs(a[k] - b[k]).max()) for k in a.files) < 0.05


def test_more_standbys_than_the_ranks_allow_are_refused_before_training(tmp_path):
    r = _train(3, TINY, ["job.standby=2", f"checkpoint.dir={tmp_path / 'ck'}"], check=False)
    assert r.returncode == 2 and "job.standby = 2 leaves 1 of the 3 ranks to train" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "ck").exists()
