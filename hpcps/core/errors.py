"""Exceptions raised by hpcps.

Bad arguments raise the builtin ``ValueError``/``TypeError`` before any
communication. Failures of MPI, HDF5 or NCCL are wrapped once, at the boundary,
as :class:`HpcpsError` (``raise HpcpsError(...) from e``).
"""

__all__ = ["HpcpsError", "FreedError", "RoleError", "StalledError"]


class HpcpsError(RuntimeError):
    """A failure inside hpcps or the MPI/HDF5 layer below it."""


class FreedError(HpcpsError):
    """An object was used after ``free()`` / ``finalize()``."""


class RoleError(HpcpsError):
    """A worker-only call made on a PS rank, or the other way round."""


class StalledError(HpcpsError):
    """A wait saw no progress for longer than the progress timeout (``job.progress_timeout``): a
    rank stopped (SIGSTOP, a hung node, a deadlock) or the ranks fell out of step."""
