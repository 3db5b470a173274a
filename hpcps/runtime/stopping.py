"""Stop requests: SIGUSR1, SIGTERM or SIGINT to a rank, or a file ``STOP`` in the checkpoint directory.

The handler only sets a flag (no I/O in a signal handler); the trainer looks at it at each step
boundary, takes a checkpoint and exits with ``EXIT_CHECKPOINTED``. ``hpcps train`` installs the
handler before its slow imports, so a signal that arrives while the job starts (Slurm's
``--signal`` may come early) is kept, not fatal. Local.
"""

import signal
from pathlib import Path

__all__ = ["install", "StopRequest", "EXIT_CHECKPOINTED", "EXIT_STOPPED"]

# Exit codes of a job that stopped on request (documented in the README): after a checkpoint, or
# without one (no checkpoint.dir: nothing was saved).
EXIT_CHECKPOINTED = 85
EXIT_STOPPED = 86

_flag = False


def _set(signum, frame):
    global _flag
    _flag = True


def install() -> None:
    """Catch SIGUSR1, SIGTERM and SIGINT (Ctrl-C, which MPI launchers forward as SIGINT or SIGTERM)
    from now on (main thread only; a no-op elsewhere). Local."""
    for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
        try:
            signal.signal(sig, _set)
        except ValueError:             # not the main thread
            pass


class StopRequest:
    """Whether a stop was asked for: a signal since :func:`install`, ``<ckpt_dir>/STOP``, or
    ``<ckpt_dir>/REBALANCE`` (a stop whose checkpoint a job with standbys goes on from with one PS
    more: ``hpcps.train.failover``). Local."""

    def __init__(self, ckpt_dir: str):
        install()
        self.stop_file = Path(ckpt_dir) / "STOP" if ckpt_dir else None
        self.rebalance_file = Path(ckpt_dir) / "REBALANCE" if ckpt_dir else None

    @property
    def flag(self) -> bool:
        return _flag

    def rebalance(self) -> bool:
        """Whether the REBALANCE file asks for one PS more. Local."""
        return bool(self.rebalance_file and self.rebalance_file.exists())

    def requested(self) -> bool:
        return _flag or bool(self.stop_file and self.stop_file.exists()) or self.rebalance()
