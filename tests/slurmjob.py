"""Helpers for tests that submit slurm/train.sbatch to a real local Slurm (scripts/slurm_local.sh):
on this machine, or on pretend hosts (scripts/cluster.sh), where every Slurm command runs on host
h0 like on a login node."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from mpirun import CLUSTER, ROOT, clean_shm

TINY = ROOT / "tests" / "configs" / "tiny_ctr.toml"
SETS = ["optimizer.sparse.name=adam", "optimizer.sparse.lr=0.05", "metrics.progress=false"]
SCRIPT = ROOT / "scripts" / "slurm_local.sh"
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


class Slurm:
    """A running local Slurm: ``env`` reaches it; ``run`` runs a Slurm command where it can."""

    def __init__(self, directory: Path, port: int, cluster: str | None = None):
        self.dir, self.cluster = Path(directory), cluster
        self.env = dict(os.environ, HPCPS_SLURM_DIR=str(directory), HPCPS_SLURM_PORT=str(port))
        if cluster:
            self.env["HPCPS_CLUSTER"] = cluster

    def start(self):
        args = [SCRIPT, "start", *(["--cluster"] if self.cluster else [])]
        r = subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        self.env["SLURM_CONF"] = str(self.dir / "slurm.conf")
        self.started = time.time()
        return self

    def stop(self):
        self.run(["scancel", "--user=root"])
        subprocess.run([SCRIPT, "stop"], env=self.env, capture_output=True, timeout=60)
        clean_shm(self.started)

    def run(self, args, env=None, check=False, timeout=60):
        prefix = [str(CLUSTER), "exec", "h0"] if self.cluster else []
        return subprocess.run([*prefix, *map(str, args)], env=env or self.env, cwd=ROOT, capture_output=True,
                              text=True, timeout=timeout, check=check)

    def job_env(self, ck, **extra) -> dict:
        env = dict(self.env, HPCPS_CONFIG=str(TINY), HPCPS_CKPT_DIR=str(ck), HPCPS_PYTHON=sys.executable,
                   OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def sbatch(self, env, log, sbatch_args, train_args, per_node=4) -> str:
        r = self.run(["sbatch", "--parsable", f"--output={log}", f"--ntasks-per-node={per_node}", *sbatch_args,
                      ROOT / "slurm" / "train.sbatch", "--set", *SETS, *train_args], env=env)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip().split(";")[0]

    def job(self, job) -> dict:
        return dict(re.findall(r"(\w+)=(\S*)", self.run(["scontrol", "show", "job", job], timeout=30).stdout))

    def wait(self, job, timeout, on_pending=None, until=None) -> dict:
        """Poll the job until it ends (or ``until(info)``); ``on_pending(info)`` while it waits to start."""
        t0, state = time.time(), "?"
        while time.time() - t0 < timeout:
            info = self.job(job)
            state = info.get("JobState", "")
            if (until and until(info)) or state in ENDED:
                return info
            if state == "PENDING" and on_pending:
                on_pending(info)
            time.sleep(1)
        self.run(["scancel", job], timeout=30)
        raise AssertionError(f"job {job} still {state} after {timeout} s")

    def release_requeued(self, job, requeued: list):
        """An ``on_pending`` for requeued jobs: a requeued job waits ~2 min (BeginTime); start it
        sooner, once per requeue, and give the next run room to finish. Not at once: Slurm's hold
        also keeps the relaunch off the old run's clean-up (its daemons, its revoked credential),
        so wait for the old batch step's slurmstepd to end and start 5 s later."""
        def release(info):
            if info.get("Reason") == "BeginTime" and info.get("Restarts") not in requeued:
                requeued.append(info.get("Restarts"))
                wait_stepd_gone(job)
                self.run(["scontrol", "update", f"JobId={job}", "StartTime=now+5", "TimeLimit=10"], timeout=30)
        return release

    def diagnose(self, info, text) -> str:
        """The job log's tail, what scontrol says about the job, and the daemons' logs' tails."""
        tails = [f"--- {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-25:])
                 for f in sorted((self.dir / "log").glob("*.log"))]
        keys = ("JobState", "Reason", "ExitCode", "Restarts", "BatchFlag", "StartTime", "EndTime", "NodeList")
        return "\n".join([text[-3000:], "--- scontrol: " + str({k: info.get(k) for k in keys}), *tails])


def wait_stepd_gone(job, timeout=60):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if subprocess.run(["pgrep", "-f", rf"slurmstepd: \[{job}\."], capture_output=True).returncode:
            return
        time.sleep(0.5)


def steps_done(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    return sum(1 for line in metrics.read_text().splitlines() if line.startswith('{"time"') and '"step"' in line)


def assert_close(a, b, tol=2e-5):
    a, b = np.load(a), np.load(b)
    assert set(a.files) == set(b.files)
    worst = max(float(np.abs(a[k] - b[k]).max()) for k in a.files)
    assert worst < tol, worst
