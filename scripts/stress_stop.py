"""Stop requests at random moments, with CPU hogs beside the job; count jobs that fall out of step.

    .venv/bin/python scripts/stress_stop.py --runs 50 [--ranks 4] [--hogs 2] [--dir /tmp/hpcps-stress]

Each run starts the tiny synthetic job (sync, a checkpoint every 5 steps), waits a random moment,
then asks it to stop in a random way: SIGUSR1, SIGTERM or SIGINT to a random rank (worker or
PS), to every rank at once (as Slurm signals a job step), or a STOP file; then it restarts the
job, as a requeue would, which must resume and finish. ``--hogs`` busy processes share the CPUs
meanwhile. A run counts as a mismatch when a job does not end with 85 (checkpointed and stopped)
or 0 (it had finished), when MPI reports a message mismatch (ranks in different collectives: a
decision taken from one rank's timing), when the restart does not resume from the checkpoint
the stop left, or when a launch runs past its timeout. Prints the counts and writes JSON; exits
1 on any mismatch. The test suite runs a few runs of it (tests/test_scripts.py).
"""

import argparse
import json
import multiprocessing
import os
import random
import re
import shutil
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from mpirun import launch_mpi, rank_pid, reap  # noqa: E402

from hpcps.checkpoint import store  # noqa: E402

_MISMATCH = re.compile(r"truncat|Message from rank|MPI_ERR|Fatal error in|deadlock", re.I)


def _hog(stop_at: float) -> None:
    x = 0
    while time.time() < stop_at:
        x += 1


def _ask_to_stop(rng: random.Random, tag: str, ranks: int, ck: Path) -> str:
    how = rng.choice(["SIGUSR1", "SIGTERM", "SIGINT", "all", "STOP"])
    if how == "STOP":
        (ck / "STOP").write_text("")
        return "STOP file"
    if how == "all":
        for r in range(ranks):
            pid = rank_pid(tag, r)
            if pid:
                os.kill(pid, signal.SIGUSR1)
        return "SIGUSR1 to every rank"
    rank = rng.randrange(ranks)
    pid = rank_pid(tag, rank)
    if pid:
        os.kill(pid, getattr(signal, how))
    return f"{how} to world rank {rank}"


def _run(a, rng: random.Random, trial: int, ck: Path, base: list) -> dict:
    tag = f"stress-{os.getpid()}-{trial}"
    shutil.rmtree(ck, ignore_errors=True)
    proc = launch_mpi(a.ranks, base, tag=tag)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and not list(ck.glob("step-*")):
        time.sleep(0.05)
    time.sleep(rng.uniform(0.0, 1.5))
    how = _ask_to_stop(rng, tag, a.ranks, ck)
    code, out, err = reap(proc, timeout=a.timeout)
    out_of_step = bool(_MISMATCH.search(err))
    newest = store.newest_verified(ck, report=lambda m: None)
    (ck / "STOP").unlink(missing_ok=True)
    code2, out2, err2 = reap(launch_mpi(a.ranks, base, tag=tag + "-again"), timeout=a.timeout)
    resumed = newest is None or f"resuming from {newest}" in err2 or code == 0
    ok = code in (0, 85) and code2 == 0 and not out_of_step and not _MISMATCH.search(err2) and resumed
    return {"trial": trial, "how": how, "exit": code, "exit_again": code2, "out_of_step": out_of_step,
            "resumed": resumed, "ok": ok, "stderr": "" if ok else (err[-1500:] + "\n---\n" + err2[-1500:])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--hogs", type=int, default=2, help="busy processes beside the job (default 2)")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--timeout", type=float, default=240, help="seconds a launch may take (default 240)")
    ap.add_argument("--dir", default="/tmp/hpcps-stress")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/stress_stop.json")
    a = ap.parse_args()
    ck = Path(a.dir)
    base = ["-m", "hpcps", "train", "--config", ROOT / "tests" / "configs" / "tiny_ctr.toml", "--set",
            "metrics.progress=false", "metrics.path=", f"checkpoint.dir={ck}", "checkpoint.every_steps=5",
            f"job.steps={a.steps}", "job.step_delay=0.005"]
    rng = random.Random(a.seed)
    runs = []
    hogs = [multiprocessing.Process(target=_hog, args=(time.time() + 10 ** 6,), daemon=True) for _ in range(a.hogs)]
    for h in hogs:
        h.start()
    try:
        for trial in range(a.runs):
            runs.append(_run(a, rng, trial, ck, base))
            r = runs[-1]
            print(f"run {trial + 1}/{a.runs}: {r['how']}: exit {r['exit']}, restart exit {r['exit_again']}"
                  f"{'' if r['ok'] else '  MISMATCH'}", flush=True)
    finally:
        for h in hogs:
            h.terminate()
    res = {"runs": len(runs), "mismatches": sum(not r["ok"] for r in runs),
           "out_of_step": sum(r["out_of_step"] for r in runs), "ranks": a.ranks, "hogs": a.hogs, "details": runs}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "details"}))
    return 0 if res["mismatches"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
