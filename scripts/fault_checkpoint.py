"""Kill -9 a training job at random moments while it checkpoints every step; count corrupt loads.

    .venv/bin/python scripts/fault_checkpoint.py --trials 100 [--ranks 3] [--dir /tmp/hpcps-fault]

Each trial starts the tiny synthetic job with a checkpoint at every step, kills every rank at a
random moment (mostly mid-write), checks that every committed checkpoint verifies, and restarts
the job, which must load the newest verified checkpoint. Prints the counts and writes JSON.
The test suite runs 20 trials of the same thing (tests/test_checkpoint_mpi.py).
"""

import argparse
import json
import os
import random
import shutil
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from mpirun import kill_launch, launch_mpi, reap, run_mpi  # noqa: E402

from hpcps.checkpoint import store  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/hpcps-fault")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rows", type=int, default=20_000,
                    help="rows per table (3 tables, dim 4, Adam state; default 20000: ~1 MB per checkpoint, "
                         "large enough that the bulk is written by pwrite)")
    ap.add_argument("--out", default="results/fault_checkpoint.json")
    a = ap.parse_args()
    ck = Path(a.dir)
    shutil.rmtree(ck, ignore_errors=True)
    base = ["-m", "hpcps", "train", "--config", ROOT / "tests" / "configs" / "tiny_ctr.toml", "--set",
            "optimizer.sparse.name=adam", "metrics.progress=false", f"checkpoint.dir={ck}", "checkpoint.keep=2",
            f"data.rows_per_table={a.rows}"]
    rng = random.Random(a.seed)
    res = {"trials": 0, "corrupt_committed": 0, "restarts": 0, "loaded_verified": 0, "restart_failures": 0}
    for trial in range(a.trials):
        proc = launch_mpi(a.ranks, base + ["checkpoint.every_steps=1", "job.steps=1000000"], tag=f"fault-{trial}")
        t0 = time.time()
        while time.time() - t0 < 60 and not list(ck.glob("step-*")):
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 1.0))
        kill_launch(proc)
        reap(proc)
        res["trials"] += 1
        res["corrupt_committed"] += sum(not store.verify(p)[0] for p in store.list_checkpoints(ck))
        r = run_mpi(a.ranks, base + ["job.steps=1"], timeout=180, check=False)
        res["restarts"] += 1
        if r.returncode != 0:
            res["restart_failures"] += 1
        elif "resuming from" in r.stderr:
            res["loaded_verified"] += 1
        print(f"trial {trial + 1}/{a.trials}: {res}", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res))
    return 0 if res["corrupt_committed"] == 0 and res["restart_failures"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
