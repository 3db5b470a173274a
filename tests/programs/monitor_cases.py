"""``hpcps train`` with one thing made abnormal, for the monitor's alerts. Usage:
monitor_cases.py CASE ARGS... (``hpcps train``'s arguments). CASE:

- ``slow_ps``: every apply of the PS takes 30 ms longer (an overloaded PS);
- ``slow_rows``: every apply takes ``$HPCPS_TEST_ROW_DELAY`` s (default 20 us) longer per row it
  updates (a PS short of CPU: a second PS halves its work);
- ``growing``: worker 0 holds 8 MB more after each step, up to 1.2 GB (a leak);
- ``plain``: nothing changed.

``$HPCPS_TEST_DISK_FREE`` (bytes): the free space the monitor sees in every directory (where the
test cannot mount a small tmpfs). Exits with ``hpcps train``'s code."""
import os
import sys
import time

import numpy as np

import hpcps

hpcps.prepare_process("serialized")
from hpcps.cli import main  # noqa: E402
from hpcps.monitor import probe  # noqa: E402
from hpcps.sparse import control  # noqa: E402
from hpcps.train import worker  # noqa: E402

case, argv = sys.argv[1], sys.argv[2:]
if case == "slow_ps":
    apply = control.apply_staged

    def slow_apply(*args, **kw):
        time.sleep(0.03)
        return apply(*args, **kw)
    control.apply_staged = slow_apply
elif case == "slow_rows":
    apply, per_row = control.apply_staged, float(os.environ.get("HPCPS_TEST_ROW_DELAY", "2e-5"))

    def slow_rows(*args, **kw):
        rows = apply(*args, **kw)
        time.sleep(rows * per_row)
        return rows
    control.apply_staged = slow_rows
elif case == "growing":
    step, held = worker.Worker.step, []

    def growing_step(self, i):
        step(self, i)
        if self.ctx.worker_rank == 0 and len(held) < 150:
            held.append(np.ones(1 << 20))               # 8 MB, its pages touched
    worker.Worker.step = growing_step
elif case != "plain":
    raise SystemExit(f"unknown case {case!r}")
if os.environ.get("HPCPS_TEST_DISK_FREE"):
    free = float(os.environ["HPCPS_TEST_DISK_FREE"])
    probe.disk_free = lambda path: free if path else float("nan")
sys.exit(main(["train", *argv]))
