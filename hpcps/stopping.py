"""Stop requests: SIGUSR1 or SIGTERM to a rank, or a file ``STOP`` in the checkpoint directory.

The handler only sets a flag (no I/O in a signal handler); the trainer looks at it at each step
boundary, takes a checkpoint and exits with ``EXIT_CHECKPOINTED``. ``hpcps train`` installs the
handler before its slow imports, so a signal that arrives while the job starts (Slurm's
``--signal`` may come early) is kept, not fatal. Local.
"""

import signal
from pathlib import Path

__all__ = ["install", "StopRequest", "EXIT_CHECKPOINTED"]

# Exit code of a job that checkpointed on request and stopped (documented in the README).
EXIT_CHECKPOINTED = 85

_flag = False


def _set(signum, frame):
    global _flag
    _flag = True


def install() -> None:
    """Catch SIGUSR1 and SIGTERM from now on (main thread only; a no-op elsewhere). Local."""
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        try:
            signal.signal(sig, _set)
        except ValueError:             # not the main thread
            pass


class StopRequest:
    """Whether a stop was asked for: a signal since :func:`install`, or ``<ckpt_dir>/STOP``. Local."""

    def __init__(self, ckpt_dir: str):
        install()
        self.stop_file = Path(ckpt_dir) / "STOP" if ckpt_dir else None

    @property
    def flag(self) -> bool:
        return _flag

    def requested(self) -> bool:
        return _flag or bool(self.stop_file and self.stop_file.exists())
