"""slurm/train.sbatch against a real slurmctld + slurmd (scripts/slurm_local.sh), not a mock:
checkpoint on the time-limit signal, requeue, resume, finish equal to a straight run; scancel;
the restart limit; a mis-launched job."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hpcps.checkpoint import store
from mpirun import ROOT, clean_shm, run_mpi

TINY = ROOT / "tests" / "configs" / "tiny_ctr.toml"
SETS = ["optimizer.sparse.name=adam", "optimizer.sparse.lr=0.05", "metrics.progress=false"]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A local Slurm of our own (own directory and ports); stopped, by PID, at the end."""
    d = tmp_path_factory.mktemp("slurm")
    env = dict(os.environ, HPCPS_SLURM_DIR=str(d), HPCPS_SLURM_PORT="16917")
    script = ROOT / "scripts" / "slurm_local.sh"
    r = subprocess.run([script, "start"], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    env["SLURM_CONF"] = str(d / "slurm.conf")
    started = time.time()
    yield env
    subprocess.run(["scancel", "--user=root"], env=env, capture_output=True, timeout=30)
    subprocess.run([script, "stop"], env=env, capture_output=True, timeout=60)
    clean_shm(started)


def _job_env(slurm, ck, **extra):
    env = dict(slurm, HPCPS_CONFIG=str(TINY), HPCPS_CKPT_DIR=str(ck), HPCPS_PYTHON=sys.executable,
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _sbatch(env, log, sbatch_args, train_args):
    r = subprocess.run(["sbatch", "--parsable", f"--output={log}", "--ntasks-per-node=4", *sbatch_args,
                        str(ROOT / "slurm" / "train.sbatch"), "--set", *SETS, *train_args],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def _job(env, job) -> dict:
    out = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True,
                         timeout=30).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def _wait(env, job, timeout, on_pending=None, until=None):
    """Poll the job until it ends (or ``until(info)``); ``on_pending(info)`` while it waits to start."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        info = _job(env, job)
        state = info.get("JobState", "")
        if until and until(info):
            return info
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return info
        if state == "PENDING" and on_pending:
            on_pending(info)
        time.sleep(1)
    subprocess.run(["scancel", job], env=env, timeout=30)
    raise AssertionError(f"job {job} still {state} after {timeout} s")


def _wait_stepd_gone(job, timeout=60):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if subprocess.run(["pgrep", "-f", rf"slurmstepd: \[{job}\."], capture_output=True).returncode:
            return
        time.sleep(0.5)


def _diagnose(slurm, info, text) -> str:
    """The job log's tail, what scontrol says about the job, and the daemons' logs' tails."""
    logs = Path(slurm["HPCPS_SLURM_DIR"]) / "log"
    tails = [f"--- {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-25:])
             for f in sorted(logs.glob("*.log"))]
    keys = ("JobState", "Reason", "ExitCode", "Restarts", "BatchFlag", "StartTime", "EndTime")
    return "\n".join([text[-3000:], "--- scontrol: " + str({k: info.get(k) for k in keys}), *tails])


def _steps_done(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    return sum(1 for line in metrics.read_text().splitlines() if line.startswith('{"time"') and '"step"' in line)


def _close(a, b, tol=2e-5):
    a, b = np.load(a), np.load(b)
    assert set(a.files) == set(b.files)
    worst = max(float(np.abs(a[k] - b[k]).max()) for k in a.files)
    assert worst < tol, worst


def test_time_limit_signal_checkpoints_requeues_and_resumes_equal_to_straight(slurm, tmp_path):
    steps = 140
    straight = tmp_path / "straight.npz"
    run_mpi(4, ["-m", "hpcps", "train", "--config", TINY, "--set", *SETS, f"job.steps={steps}",
                f"job.export={straight}"], timeout=180)
    ck, log, out = tmp_path / "ck", tmp_path / "job.log", tmp_path / "w.npz"
    # 3 minutes, USR1 90+15 s before the end: due 75 s in, sent 15-75 s in (Slurm checks once a
    # minute and may send it up to 60 s early). 140 steps at 0.5 s cannot finish by then.
    env = _job_env(slurm, ck, HPCPS_STEP_DELAY=0.5, HPCPS_MAX_RESTARTS=3)
    job = _sbatch(env, log, ["--time=3", "--signal=B:USR1@105"], [f"job.steps={steps}", f"job.export={out}"])
    requeued = []

    def release(info):
        # A requeued job waits ~2 min (BeginTime): start it sooner, once per requeue, and give the
        # next run room to finish. Not at once: Slurm's hold also keeps the relaunch off the old
        # run's clean-up (its daemons, its revoked credential), so wait for the old batch step's
        # slurmstepd to end and start 5 s later.
        if info.get("Reason") == "BeginTime" and info.get("Restarts") not in requeued:
            requeued.append(info.get("Restarts"))
            _wait_stepd_gone(job)
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now+5", "TimeLimit=10"],
                           env=env, timeout=30)
    info = _wait(env, job, 480, on_pending=release)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED", _diagnose(slurm, info, text)
    assert int(info["Restarts"]) >= 1 and requeued
    assert "SIGUSR1" in text and "requeueing job" in text and "training finished" in text
    runs = re.findall(r"hpcps-sbatch: job \d+ run (\d+) \(restart (\d+)", text)
    assert [r[0] for r in runs] == [str(i + 1) for i in range(len(runs))] and len(runs) >= 2
    resumed = [int(s) for s in re.findall(r"resuming from \S+ \(step (\d+)\)", text)]
    assert len(resumed) == len(runs) - 1 and all(0 < s < steps for s in resumed)
    assert resumed == sorted(resumed)
    _close(out, straight)
    assert store.verify(store.newest_verified(ck))[0]


def test_scancel_leaves_a_verified_checkpoint_and_does_not_requeue(slurm, tmp_path):
    ck, log, metrics = tmp_path / "ck", tmp_path / "job.log", tmp_path / "m.jsonl"
    env = _job_env(slurm, ck, HPCPS_STEP_DELAY=0.3, HPCPS_MAX_RESTARTS=3)
    job = _sbatch(env, log, ["--time=10"], ["job.steps=1000", f"metrics.path={metrics}", "job.log_every=1"])
    _wait(env, job, 180, until=lambda info: _steps_done(metrics) >= 3)
    subprocess.run(["scancel", job], env=env, check=True, timeout=30)
    info = _wait(env, job, 120)
    text = log.read_text()
    assert info["JobState"] == "CANCELLED" and int(info["Restarts"]) == 0, _diagnose(slurm, info, text)
    assert "SIGTERM" in text and "cancelled; not requeueing" in text and "Resume by hand" in text
    newest = store.newest_verified(ck)
    assert newest is not None and store.read_manifest(newest)["step"] >= 3


def test_past_the_restart_limit_it_stops_requeueing_and_says_why(slurm, tmp_path):
    # the launcher inside the allocation is the MPI's own mpiexec here (srun in the others)
    ck, log, metrics = tmp_path / "ck", tmp_path / "job.log", tmp_path / "m.jsonl"
    env = _job_env(slurm, ck, HPCPS_STEP_DELAY=0.3, HPCPS_MAX_RESTARTS=0, HPCPS_LAUNCH="mpiexec",
                   PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    job = _sbatch(env, log, ["--time=10"], ["job.steps=1000", f"metrics.path={metrics}", "job.log_every=1"])
    _wait(env, job, 180, until=lambda info: _steps_done(metrics) >= 3)
    # what Slurm does at the --signal time, now: USR1 to the batch shell only
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=env, check=True, timeout=30)
    info = _wait(env, job, 120)
    text = log.read_text()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "85:0", _diagnose(slurm, info, text)
    assert int(info["Restarts"]) == 0 and "requeueing job" not in text
    assert "not requeueing: restart 0 reached HPCPS_MAX_RESTARTS=0" in text
    newest = store.newest_verified(ck)
    assert newest is not None and store.read_manifest(newest)["step"] >= 3


def test_a_stop_file_alone_is_judged_a_checkpointed_stop_under_srun(slurm, tmp_path):
    """No signal: a STOP file makes the job checkpoint and stop. The first rank to exit 85 makes
    srun --kill-on-bad-exit end the others with SIGTERM (exit 143 for the step); the script must
    judge by the job's STOPPED record, not report a failed training."""
    ck, log, metrics = tmp_path / "ck", tmp_path / "job.log", tmp_path / "m.jsonl"
    env = _job_env(slurm, ck, HPCPS_STEP_DELAY=0.3, HPCPS_MAX_RESTARTS=0)
    job = _sbatch(env, log, ["--time=10"], ["job.steps=1000", f"metrics.path={metrics}", "job.log_every=1"])
    _wait(env, job, 180, until=lambda info: _steps_done(metrics) >= 3)
    (ck / "STOP").write_text("")
    info = _wait(env, job, 120)
    text = log.read_text()
    assert info["ExitCode"] == "85:0" and "training failed" not in text, _diagnose(slurm, info, text)
    assert "not requeueing: restart 0 reached HPCPS_MAX_RESTARTS=0" in text
    assert (ck / "STOPPED").exists() and store.newest_verified(ck) is not None


def test_a_launch_whose_tasks_do_not_join_one_world_fails_loudly(slurm):
    # srun without a PMI plugin: every task is rank 0 of a world of 1
    r = subprocess.run(["srun", "-n", "2", "--mpi=none", sys.executable, "-m", "mpi4py", "-m", "hpcps", "train",
                        "--config", str(TINY)], env=slurm, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "the launcher started 2 tasks (SLURM_STEP_NUM_TASKS=2)" in r.stderr and "--mpi=pmi2" in r.stderr
    assert '"final"' not in r.stdout


def test_chained_jobs_resume_one_after_another_and_a_finished_one_exits_at_once(slurm, tmp_path):
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    out = tmp_path / "w.npz"
    env = _job_env(slurm, ck, HPCPS_STEP_DELAY=0.2, HPCPS_JOB_NAME=f"chain-{os.getpid()}")
    r = subprocess.run([ROOT / "slurm" / "chain.sh", "3", f"--output={tmp_path}/chain-%j.log", "--ntasks-per-node=4",
                        "--time=10", "--", "--set", *SETS, "job.steps=40", f"metrics.path={metrics}",
                        "job.log_every=1", f"job.export={out}"],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    jobs = r.stdout.split()
    assert len(jobs) == 3
    _wait(env, jobs[0], 180, until=lambda info: _steps_done(metrics) >= 3)
    subprocess.run(["scancel", "--signal=USR1", "--batch", jobs[0]], env=env, check=True, timeout=30)
    infos = [_wait(env, j, 240) for j in jobs]
    logs = [(tmp_path / f"chain-{j}.log").read_text() for j in jobs]
    assert [i["JobState"] for i in infos] == ["FAILED", "COMPLETED", "COMPLETED"], logs
    assert "the next job of the chain (slurm/chain.sh) resumes" in logs[0]
    assert "resuming from" in logs[1] and "training finished" in logs[1]
    third = [__import__("json").loads(l)["final"] for l in logs[2].splitlines() if l.startswith('{"final"')][-1]
    assert third["start_step"] == third["steps"] == 40           # nothing left: it only evaluated
    assert all(int(i["Restarts"]) == 0 for i in infos) and out.exists()
