"""Several ``hpcps train`` jobs one after another in one MPI launch: the launch, the imports of torch
and MPI's start are paid once (~4 s of a 4-rank launch on 2 cores). Usage: train_many.py RUNS.json, a
list of ``{"tag": ..., "args": [...], "env": {...}}`` (``args`` as for ``hpcps``; ``env`` set for that
run, a null value removing the variable). Before each run rank 0 prints ``{"run": TAG}`` on stdout
and every rank a line ``hpcps-run: TAG`` on stderr; a run that does not exit 0 aborts the launch.
The MPI thread level is the launch's (``HPCPS_MPI_THREADS``, else serialized)."""
import json
import os
import sys

import hpcps

hpcps.prepare_process(os.environ.get("HPCPS_MPI_THREADS", "serialized"))
from mpi4py import MPI  # noqa: E402

from hpcps.cli import main  # noqa: E402

runs = json.loads(open(sys.argv[1]).read())
base = dict(os.environ)
for run in runs:
    os.environ.clear()
    os.environ.update(base)
    for k, v in (run.get("env") or {}).items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(json.dumps({"run": run["tag"]}), flush=True)
    print(f"hpcps-run: {run['tag']}", file=sys.stderr, flush=True)
    rc = main([str(a) for a in run["args"]])
    if rc != 0:
        raise SystemExit(f"run {run['tag']!r} exited {rc}")
