"""slurm/train.sbatch against a real slurmctld + slurmd (scripts/slurm_local.sh), not a mock:
a start that fails before MPI is up, tried again; scancel; the restart limit; a STOP file; a
mis-launched job; chained jobs. The time-limit signal, requeue and resume run on two nodes in
tests/test_slurm_hosts.py."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcps.checkpoint import store
from mpirun import ROOT, mpiexec
from slurmjob import SETS, TINY, Slurm, steps_done


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A local Slurm of our own (own directory and ports); stopped, by PID, at the end."""
    sl = Slurm(tmp_path_factory.mktemp("slurm"), 16917).start()
    yield sl
    sl.stop()


def _failing_first_start(tmp_path) -> Path:
    """A python for the job whose first start fails on one rank before MPI is up, as a PMI request
    that Slurm reads in two pieces fails MPI_Init; every later start runs the real python."""
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nmkdir "{tmp_path}/failed-once" 2>/dev/null && exit 3\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def test_scancel_leaves_a_verified_checkpoint_and_does_not_requeue(slurm, tmp_path):
    ck, log, metrics = tmp_path / "ck", tmp_path / "job.log", tmp_path / "m.jsonl"
    env = slurm.job_env(ck, HPCPS_STEP_DELAY=0.3, HPCPS_MAX_RESTARTS=3, HPCPS_PYTHON=_failing_first_start(tmp_path))
    job = slurm.sbatch(env, log, ["--time=10"], ["job.steps=1000", f"metrics.path={metrics}", "job.log_every=1"])
    slurm.wait(job, 180, until=lambda info: steps_done(metrics) >= 3)
    slurm.run(["scancel", job], check=True)
    info = slurm.wait(job, 120)
    text = log.read_text()
    assert info["JobState"] == "CANCELLED" and int(info["Restarts"]) == 0, slurm.diagnose(info, text)
    assert "failed before every rank was up" in text and "retries left: 1" in text, text
    assert "SIGTERM" in text and "cancelled; not requeueing" in text and "Resume by hand" in text
    newest = store.newest_verified(ck)
    assert newest is not None and store.read_manifest(newest)["step"] >= 3


def test_past_the_restart_limit_it_stops_requeueing_and_says_why(slurm, tmp_path):
    # the launcher inside the allocation is the MPI's own mpiexec here (srun in the others)
    ck, log, metrics = tmp_path / "ck", tmp_path / "job.log", tmp_path / "m.jsonl"
    env = slurm.job_env(ck, HPCPS_STEP_DELAY=0.3, HPCPS_MAX_RESTARTS=0, HPCPS_LAUNCH="mpiexec",
                        PATH=f"{Path(mpiexec()).parent}:{os.environ['PATH']}")
    job = slurm.sbatch(env, log, ["--time=10"], ["job.steps=1000", f"metrics.path={metrics}", "job.log_every=1"])
    slurm.wait(job, 180, until=lambda info: steps_done(metrics) >= 3)
    # what Slurm does at the --signal time, now: USR1 to the batch shell only
    slurm.run(["scancel", "--signal=USR1", "--batch", job], check=True)
    info = slurm.wait(job, 120)
    text = log.read_text()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "85:0", slurm.diagnose(info, text)
    assert int(info["Restarts"]) == 0 and "requeueing job" not in text
    assert "not requeueing: restart 0 reached HPCPS_MAX_RESTARTS=0" in text
    newest = store.newest_verified(ck)
    assert newest is not None and store.read_manifest(newest)["step"] >= 3


@pytest.mark.openmpi
def test_a_stop_file_alone_is_judged_a_checkpointed_stop_under_srun(slurm, tmp_path):
    """No signal: a STOP file makes the job checkpoint and stop. The first rank to exit 85 makes
    srun --kill-on-bad-exit end the others with SIGTERM (exit 143 for the step); the script must
    judge by the job's STOPPED record, not report a failed training."""
    ck, log, metrics = tmp_path / "ck", tmp_path / "job.log", tmp_path / "m.jsonl"
    env = slurm.job_env(ck, HPCPS_STEP_DELAY=0.3, HPCPS_MAX_RESTARTS=0)
    job = slurm.sbatch(env, log, ["--time=10"], ["job.steps=1000", f"metrics.path={metrics}", "job.log_every=1"])
    slurm.wait(job, 180, until=lambda info: steps_done(metrics) >= 3)
    (ck / "STOP").write_text("")
    info = slurm.wait(job, 120)
    text = log.read_text()
    assert info["ExitCode"] == "85:0" and "training failed" not in text, slurm.diagnose(info, text)
    assert "not requeueing: restart 0 reached HPCPS_MAX_RESTARTS=0" in text
    assert (ck / "STOPPED").exists() and store.newest_verified(ck) is not None


def test_a_launch_whose_tasks_do_not_join_one_world_fails_loudly(slurm):
    # srun without a PMI plugin: every task is rank 0 of a world of 1
    r = subprocess.run(["srun", "-n", "2", "--mpi=none", sys.executable, "-m", "mpi4py", "-m", "hpcps", "train",
                        "--config", str(TINY)], env=slurm.env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "the launcher started 2 tasks (SLURM_STEP_NUM_TASKS=2)" in r.stderr and "--mpi=pmi2" in r.stderr
    assert '"final"' not in r.stdout


def test_chained_jobs_resume_one_after_another_and_a_finished_one_exits_at_once(slurm, tmp_path):
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    out = tmp_path / "w.npz"
    env = slurm.job_env(ck, HPCPS_STEP_DELAY=0.2, HPCPS_JOB_NAME=f"chain-{os.getpid()}")
    ck.mkdir()                    # as an overloaded-PS alert leaves it (tests/test_monitor.py): every run follows it
    (ck / "LAYOUT").write_text(json.dumps({"job.num_ps": 2, "step": 0, "alert": "PS overloaded: ..."}) + "\n")
    r = subprocess.run([ROOT / "slurm" / "chain.sh", "3", f"--output={tmp_path}/chain-%j.log", "--ntasks-per-node=4",
                        "--time=10", "--", "--set", *SETS, "job.steps=40", f"metrics.path={metrics}",
                        "job.log_every=1", f"job.export={out}"],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    jobs = r.stdout.split()
    assert len(jobs) == 3
    slurm.wait(jobs[0], 180, until=lambda info: steps_done(metrics) >= 3)
    slurm.run(["scancel", "--signal=USR1", "--batch", jobs[0]], check=True)
    infos = [slurm.wait(j, 240) for j in jobs]
    logs = [(tmp_path / f"chain-{j}.log").read_text() for j in jobs]
    assert [i["JobState"] for i in infos] == ["FAILED", "COMPLETED", "COMPLETED"], logs
    assert "the next job of the chain (slurm/chain.sh) resumes" in logs[0]
    assert "resuming from" in logs[1] and "training finished" in logs[1]
    third = [json.loads(l)["final"] for l in logs[2].splitlines() if l.startswith('{"final"')][-1]
    assert third["start_step"] == third["steps"] == 40           # nothing left: it only evaluated
    assert third["num_ps"] == 2 and all("following" in log and "job.num_ps=2" in log for log in logs)
    assert all(int(i["Restarts"]) == 0 for i in infos) and out.exists()


def _ranks_of(ck: Path) -> list:
    """PIDs of the training ranks (python processes, not srun) of the job writing to ``ck``."""
    r = subprocess.run(["pgrep", "-f", f"hpcps train .*checkpoint.dir={ck}"], capture_output=True, text=True)
    return [int(p) for p in r.stdout.split()
            if Path(f"/proc/{p}/exe").exists() and "python" in os.readlink(f"/proc/{p}/exe")]


def test_a_rank_killed_mid_run_is_relaunched_in_the_allocation_from_the_local_level(slurm, tmp_path):
    """HPCPS_RELAUNCHES: a rank killed with SIGKILL fails the job step; the batch script launches it
    again in the same allocation (no requeue), and the relaunch resumes from the node-local level."""
    ck, log, metrics, local = tmp_path / "ck", tmp_path / "job.log", tmp_path / "m.jsonl", tmp_path / "local"
    env = slurm.job_env(ck, HPCPS_STEP_DELAY=0.2, HPCPS_MAX_RESTARTS=0, HPCPS_RELAUNCHES=1,
                        HPCPS_LOCAL_DIR=local, HPCPS_LOCAL_EVERY=2)
    job = slurm.sbatch(env, log, ["--time=10"], ["job.steps=20", f"metrics.path={metrics}", "job.log_every=1"])
    slurm.wait(job, 180, until=lambda info: steps_done(metrics) >= 5)
    victims = _ranks_of(ck)
    assert len(victims) == 4, victims
    os.kill(victims[-1], 9)
    info = slurm.wait(job, 240)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) == 0, slurm.diagnose(info, text)
    assert "relaunching the job step in this allocation (0 relaunch(es) left)" in text
    assert "the node-local level" in text and "training finished" in text
    final = [json.loads(l)["final"] for l in text.splitlines() if l.startswith('{"final"')][-1]
    assert final["restored_from"] == "local" and final["start_step"] >= 2 and final["steps"] == 20


@pytest.mark.openmpi
@pytest.mark.ulfm
def test_with_a_standby_a_killed_rank_is_replaced_live_with_no_relaunch_and_no_requeue(slurm, tmp_path):
    """HPCPS_STANDBY=1 under Open MPI: the script launches mpiexec --with-ft ulfm inside the
    allocation (sbatch --no-kill); a worker killed -9 is replaced by the standby in the same step."""
    ck, log, metrics = tmp_path / "ck", tmp_path / "job.log", tmp_path / "m.jsonl"
    env = slurm.job_env(ck, HPCPS_STEP_DELAY=0.2, HPCPS_MAX_RESTARTS=0, HPCPS_STANDBY=1, HPCPS_MPI="openmpi")
    job = slurm.sbatch(env, log, ["--time=10", "--no-kill"],
                       ["job.steps=30", "checkpoint.every_steps=5", f"metrics.path={metrics}", "job.log_every=1"])
    slurm.wait(job, 180, until=lambda info: store.list_checkpoints(ck) and steps_done(metrics) >= 7)
    ranks = {int(dict(kv.split("=", 1) for kv in Path(f"/proc/{p}/environ").read_text().split("\0")
                      if "=" in kv).get("OMPI_COMM_WORLD_RANK", -1)): p for p in _ranks_of(ck)}
    assert sorted(ranks) == [0, 1, 2, 3], ranks
    os.kill(ranks[1], 9)                        # launch rank 1: a worker (the standby is launch rank 3)
    info = slurm.wait(job, 240)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) == 0, slurm.diagnose(info, text)
    assert "launched mpiexec --with-ft ulfm" in text and "relaunching" not in text
    assert "standby rank 3 takes over" in text and "training finished" in text
    final = [json.loads(l)["final"] for l in text.splitlines() if l.startswith('{"final"')][-1]
    assert [r["lost_ranks"] for r in final["recoveries"]] == [[1]] and final["steps"] == 30, final


def test_tune_as_a_job_array_searches_one_study_from_every_task(slurm, tmp_path):
    import optuna
    study = tmp_path / "study"
    env = dict(slurm.env, HPCPS_CONFIG=str(ROOT / "examples" / "criteo.toml"), HPCPS_PYTHON=sys.executable,
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    r = slurm.run(["sbatch", "--parsable", "--array=0-1", "--ntasks=3", f"--output={tmp_path}/task-%a.log",
                   ROOT / "slurm" / "tune.sbatch", "--set", f"tune.study={study}", "tune.trials=4", "job.max_epochs=2",
                   "data.hash_rows=2000"], env=env)
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip().split(";")[0]
    t0 = time.time()
    while slurm.run(["squeue", "-h", "-j", job], timeout=30).stdout.strip() and time.time() - t0 < 420:
        time.sleep(2)
    logs = [(tmp_path / f"task-{i}.log").read_text() for i in range(2)]
    assert all('{"tune"' in text for text in logs), "\n".join(text[-2000:] for text in logs)
    st = optuna.load_study(study_name="hpcps", storage=optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(study / "journal.log"))))
    finished = [t for t in st.trials if t.state.name in ("COMPLETE", "PRUNED")]
    assert 4 <= len(finished) <= 5                  # the second task may finish one more
    assert len({t.user_attrs["pid"] for t in finished}) == 2      # both tasks ran trials of the one study
    assert all("srun" in (study / f"trial-{t.number:04d}" / "train.log").read_text().splitlines()[0] for t in finished)
    assert (study / "best.toml").exists() and "| complete |" in (study / "trials.md").read_text()
