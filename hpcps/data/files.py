"""Shared machinery of the file readers: line-level sharding, epochs, bad lines."""

import numpy as np

from ..core.inputs import READ_ERRORS, expand_inputs, open_text
from .base import worker_slice

__all__ = ["BadLine", "read_lines", "shard_rows"]


class BadLine(ValueError):
    """A malformed input line: ``path:lineno: what``."""


def read_lines(spec, parse, skip_bad: bool, stats: dict, skip_header=None, key: str = "data.path"):
    """Parse every non-empty line of the files ``spec`` names (a file, a glob or a comma-separated
    list, plain, ``.gz`` or ``.bz2``: ``hpcps.core.inputs``) with ``parse(line) -> record``, file
    after file. ``skip_header(line)``: whether a file's first line is a header to skip.

    Raises ``BadLine`` naming file and line, or (``skip_bad``) skips it and counts it in
    ``stats["skipped_lines"]``; a damaged compressed file is an error naming it and the line
    reached. Local.
    """
    out = []
    stats.setdefault("skipped_lines", 0)
    for path in expand_inputs(spec, key):
        try:
            f = open_text(path)
        except OSError as e:
            raise ValueError(f"cannot read data file {path}: {e.strerror}") from None
        lineno = 0
        try:
            with f:
                for lineno, line in enumerate(f, 1):
                    line = line.rstrip("\r\n")
                    if not line.strip():
                        continue
                    if lineno == 1 and skip_header is not None and skip_header(line):
                        continue
                    try:
                        out.append(parse(line))
                    except (ValueError, IndexError) as e:
                        if not skip_bad:
                            raise BadLine(f"{path}:{lineno}: {e} (set data.skip_bad_lines = true to skip such "
                                          f"lines)") from None
                        stats["skipped_lines"] += 1
        except READ_ERRORS as e:
            raise ValueError(f"{path}: cannot be read past line {lineno} ({type(e).__name__}: {e}): a truncated "
                             f"or damaged compressed file?") from None
    return out


def shard_rows(n: int, batch_size: int, num_workers: int, worker: int) -> np.ndarray:
    """Indices of full global batches' rows that ``worker`` owns, batch-major. Local."""
    nb = n // batch_size
    sl = worker_slice(batch_size, num_workers, worker)
    return (np.arange(nb)[:, None] * batch_size + np.arange(sl.start, sl.stop)[None, :]).reshape(-1)
