"""The PS side of a dynamic table's messages in sync mode: waiting for the workers' pushes of a
step (within ``job.progress_timeout``; a worker that finalizes without its push is an error at
once) and applying their sum in worker order. Mixed into
:class:`hpcps.sparse.dynamic.DynamicEmbeddingTable`. Local (receives from the workers)."""

import time

import numpy as np
from mpi4py import MPI

from ..core import wait as _wait
from ..core.dynshard import sum_rows
from ..core.errors import HpcpsError

__all__ = ["DynamicReceiving"]


class DynamicReceiving:
    """``_apply_step`` and ``_take_until`` of a :class:`DynamicEmbeddingTable` (its ``comm``,
    ``_handle``, ``_staged``, ``_observed``, ``_finished``, ``shard``)."""

    def _apply_step(self, step: int | None = None) -> None:
        """PS, sync mode, before the step's apply: wait for every worker's push of the step, then
        apply their sum in worker order. Local (receives from the workers)."""
        step = self.ctx.control.step if step is None else step
        W = self.ctx.num_workers

        def ready() -> bool:
            have = self._staged.get(step, {})
            gone = sorted(w for w in self._finished if w not in have)
            if gone:
                raise HpcpsError(f"table {self.name!r}: worker {gone[0]} finished (finalize) without its push of "
                                 f"step {step}: in sync mode each worker pushes every step it pulls")
            return len(have) >= W
        self._take_until(ready,
                         lambda: f"table {self.name!r}: PS {self.ctx.ps_rank} waits for every worker's push of "
                                 f"step {step} ({len(self._staged.get(step, {}))} of {W} in); in sync mode each "
                                 f"worker pushes every step it pulls (a step ended without its push?)")
        got = self._staged.pop(step)
        seen = self._observed.pop(step, [])          # the step's uses, after a checkpoint cut at it
        known = None                                 # their rows: the push's found by a binary search
        if len(seen) == 1:
            known = self.shard.look(seen[0][0], step, distinct=seen[0][1])
        elif seen:                                   # one probe for every worker's (uses add up alike)
            known = self.shard.look(np.concatenate([ids for ids, _ in seen]), step)
        if W == 1:                                   # a worker sends its ids sorted and distinct
            uniq, summed = got[0]
        else:
            uniq, summed = sum_rows(np.concatenate([got[w][0] for w in range(W)]),   # in worker order:
                                    np.concatenate([got[w][1] for w in range(W)]))   # the same bits every run
        self.shard.push(self.shard.place(uniq, step, known), summed, step)

    def _take_until(self, done, what=None) -> None:
        """PS: receive and handle the workers' messages until ``done()``; a wait that sees no message
        for ``job.progress_timeout`` raises ``StalledError`` saying ``what``. Local."""
        status, misses, started = MPI.Status(), 0, time.monotonic()
        what = what or (lambda: f"table {self.name!r}: PS {self.ctx.ps_rank} waits for the workers' messages")
        pulls = self.ctx.pull_server                 # the fixed tables' pulls by messages, if any:
        while not done():                            # a worker may wait for one before it pushes here
            if self.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
                self._handle(status)
                misses, started = 0, time.monotonic()
                continue
            if pulls is not None and pulls.serve():
                continue
            misses += 1
            _wait.overdue(started, misses, what)
            _wait.backoff(misses)
