"""slurm/train.sbatch on a multi-node Slurm: two pretend hosts (scripts/cluster.sh), a slurmd on
each and slurmctld on h0 (scripts/slurm_local.sh start --cluster): the time-limit signal, requeue
and resume across hosts, and a restart on fewer nodes. Needs root (CI runs as root)."""

import json
import os
import re
import subprocess
import time

import pytest

from hpcps.checkpoint import store
from mpirun import CLUSTER, run_mpi
from slurmjob import SETS, TINY, Slurm, assert_close, steps_done

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="pretend hosts need root (network namespaces)")
STEPS = 140
TWO_HOSTS = "2 hosts (h0: 2 ranks, 1 PS; h1: 2 ranks, 1 PS)"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """Hosts h0 and h1 with a Slurm node each; the daemons and hosts are gone afterwards."""
    name = f"s{os.getpid() % 1000000}"
    env = dict(os.environ, HPCPS_CLUSTER=name)
    subprocess.run([CLUSTER, "up", "2"], env=env, capture_output=True, timeout=60, check=True)
    sl = Slurm(tmp_path_factory.mktemp("slurm"), 16927, cluster=name)
    try:
        yield sl.start()
    finally:
        sl.stop()
        down = subprocess.run([CLUSTER, "down"], env=env, capture_output=True, text=True, timeout=60)
        subprocess.run([CLUSTER, "down", "--force"], env=env, capture_output=True, timeout=60)
    assert down.returncode == 0, down.stderr     # `down` refuses while anything of the job runs on a host


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The same training in one straight run on this machine (sync mode: placement does not matter)."""
    out = tmp_path_factory.mktemp("straight") / "w.npz"
    run_mpi(4, ["-m", "hpcps", "train", "--config", TINY, "--set", *SETS, f"job.steps={STEPS}", "job.num_ps=2",
                f"job.export={out}"], timeout=180)
    return out


def _finals(text):
    return [json.loads(line)["final"] for line in text.splitlines() if line.startswith('{"final"')]


def _stop_when_running(slurm, job, metrics):
    """What Slurm does at the --signal time, once the job has made 3 steps: USR1 to the batch shell."""
    info = slurm.wait(job, 180, until=lambda info: steps_done(metrics) >= 3)
    for _ in range(5):                          # a busy slurmctld may time out a request: ask again
        assert info.get("JobState") == "RUNNING", slurm.diagnose(info, "")
        r = slurm.run(["scancel", "--signal=USR1", "--batch", job])
        if r.returncode == 0:
            return
        time.sleep(2)
        info = slurm.job(job)
    raise AssertionError(f"scancel --signal=USR1 failed: {r.stderr}\n" + slurm.diagnose(info, ""))


def test_sbatch_on_two_nodes_checkpoints_at_the_time_limit_requeues_and_resumes_equal_to_straight(
        slurm, straight, tmp_path):
    """Slurm's own time-limit warning, not a stand-in: 3 minutes, USR1 90+15 s before the end, so
    due 75 s in and sent 15-75 s in (Slurm looks once a minute and may send it up to 60 s early);
    140 steps at 0.5 s cannot finish by then."""
    ck, log, out = tmp_path / "ck", tmp_path / "job.log", tmp_path / "w.npz"
    env = slurm.job_env(ck, HPCPS_STEP_DELAY=0.5, HPCPS_MAX_RESTARTS=3)
    job = slurm.sbatch(env, log, ["--nodes=2", "--time=3", "--signal=B:USR1@105"],
                       [f"job.steps={STEPS}", f"job.export={out}"], per_node=2)
    requeued = []
    info = slurm.wait(job, 480, on_pending=slurm.release_requeued(job, requeued))
    text = log.read_text()
    assert info["JobState"] == "COMPLETED" and info["NodeList"] == "h[0-1]", slurm.diagnose(info, text)
    assert int(info["Restarts"]) >= 1 and requeued
    assert "SIGUSR1" in text and "requeueing job" in text and "training finished" in text
    assert "failed before every rank was up" not in text      # MPICH's addresses fit srun's PMI reads
    runs = re.findall(r"hpcps-sbatch: job \d+ run (\d+) .* on (\S+), (\d+) tasks, (\d+) PS", text)
    assert [r[0] for r in runs] == [str(i + 1) for i in range(len(runs))] and len(runs) >= 2, text
    assert all(r[1:] == ("h[0-1]", "4", "2") for r in runs)
    assert text.count(f"hpcps: layout: {TWO_HOSTS}") == len(runs)
    resumed = [int(s) for s in re.findall(r"resuming from \S+ \(step (\d+)\)", text)]
    assert len(resumed) == len(runs) - 1 and all(0 < s < STEPS for s in resumed) and resumed == sorted(resumed)
    final = _finals(text)[-1]
    assert final["layout"]["hosts"] == 2 and final["layout"]["ps_per_host"] == [1, 1] and final["steps"] == STEPS
    assert_close(out, straight)
    assert store.verify(store.newest_verified(ck))[0]


def test_a_two_node_job_resumed_by_a_one_node_job_reshards_and_ends_equal_to_straight(slurm, straight, tmp_path):
    ck, out, metrics = tmp_path / "ck", tmp_path / "w.npz", tmp_path / "m.jsonl"
    env = slurm.job_env(ck, HPCPS_STEP_DELAY=0.3, HPCPS_MAX_RESTARTS=0)
    first = slurm.sbatch(env, tmp_path / "first.log", ["--nodes=2", "--time=10"],
                         [f"job.steps={STEPS}", f"metrics.path={metrics}", "job.log_every=1"], per_node=2)
    _stop_when_running(slurm, first, metrics)
    info = slurm.wait(first, 120)
    text = (tmp_path / "first.log").read_text()
    assert info["ExitCode"] == "85:0" and f"layout: {TWO_HOSTS}" in text, slurm.diagnose(info, text)
    stopped_at = store.read_manifest(store.newest_verified(ck))["step"]
    # by hand, as the log says, on one node now: 1 PS and the same 2 workers
    env = slurm.job_env(ck, HPCPS_MAX_RESTARTS=0)             # no step delay now
    second = slurm.sbatch(env, tmp_path / "second.log", ["--nodes=1", "--time=10"],
                          [f"job.steps={STEPS}", f"job.export={out}"], per_node=3)
    info = slurm.wait(second, 180)
    text = (tmp_path / "second.log").read_text()
    assert info["JobState"] == "COMPLETED", slurm.diagnose(info, text)
    assert f"resuming from {ck}/step-{stopped_at:09d} (step {stopped_at})" in text
    assert "hpcps: layout: 1 host (h" in text and _finals(text)[-1]["num_ps"] == 1
    assert_close(out, straight)
