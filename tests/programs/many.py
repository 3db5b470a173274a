"""Several test programs one after another in one MPI launch: the launch, the imports of torch and
MPI's start are paid once (tests/mpirun.py's ``run_many``). Usage: many.py RUNS.json OUTDIR, RUNS a
list of ``{"tag": ..., "argv": [PROGRAM, ARGS...]}``. Each rank's stdout of run ``i`` goes to
``OUTDIR/i.RANK``. The module constants of hpcps (upper-case globals) that a program sets (a
short staged-row list, small push mailboxes) are put back after it; its other state (counters,
caches) is the process's, as in a program that makes several tables. An exception aborts the launch (``-m mpi4py``); so
does a program that returns while other ranks still run it (they hang in its collectives until
the launch's timeout). The MPI thread level is the launch's (``HPCPS_MPI_THREADS``, else
serialized)."""
import contextlib
import json
import os
import runpy
import sys
from pathlib import Path

import hpcps

hpcps.prepare_process(os.environ.get("HPCPS_MPI_THREADS", "serialized"))
import hpcps.sparse.mailbox  # noqa: E402,F401  the modules whose globals programs set: loaded before
import hpcps.sparse.staging  # noqa: E402,F401  the first run, so that their values can be put back

from mpi4py import MPI  # noqa: E402


def _hpcps_globals() -> dict:
    return {name: {k: v for k, v in vars(m).items() if k.isupper()}
            for name, m in list(sys.modules.items()) if name.split(".")[0] == "hpcps"}


def _put_back(saved: dict) -> None:
    for name, before in saved.items():
        module = sys.modules[name]
        for key, value in before.items():
            if vars(module).get(key) is not value:
                setattr(module, key, value)


runs = json.loads(Path(sys.argv[1]).read_text())
out_dir, rank = Path(sys.argv[2]), MPI.COMM_WORLD.Get_rank()
for i, run in enumerate(runs):
    program = [str(a) for a in run["argv"]]
    print(f"hpcps-run: {run['tag']}", file=sys.stderr, flush=True)
    saved, argv = _hpcps_globals(), sys.argv
    with open(out_dir / f"{i}.{rank}", "w") as out, contextlib.redirect_stdout(out):
        sys.argv = program
        try:
            runpy.run_path(program[0], run_name="__main__")
        finally:
            sys.argv = argv
            sys.stdout.flush()
    _put_back(saved)
    MPI.COMM_WORLD.Barrier()           # no rank starts the next program while another ends this one
