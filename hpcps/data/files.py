"""Shared machinery of the file readers: line-level sharding, epochs, bad lines."""

import numpy as np

from .base import worker_slice

__all__ = ["BadLine", "read_lines", "shard_rows"]


class BadLine(ValueError):
    """A malformed input line: ``path:lineno: what``."""


def read_lines(path, parse, skip_bad: bool, stats: dict, skip_header=None):
    """Parse every non-empty line of ``path`` with ``parse(fields_line) -> record``.

    Raises ``BadLine`` naming file and line, or (``skip_bad``) skips it and
    counts it in ``stats["skipped_lines"]``. Local.
    """
    out = []
    stats.setdefault("skipped_lines", 0)
    try:
        f = open(path, encoding="utf-8", errors="replace")
    except OSError as e:
        raise ValueError(f"cannot read data file {path}: {e.strerror}") from None
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
                    raise BadLine(f"{path}:{lineno}: {e} (set data.skip_bad_lines = true to skip such lines)") from None
                stats["skipped_lines"] += 1
    return out


def shard_rows(n: int, batch_size: int, num_workers: int, worker: int) -> np.ndarray:
    """Indices of full global batches' rows that ``worker`` owns, batch-major. Local."""
    nb = n // batch_size
    sl = worker_slice(batch_size, num_workers, worker)
    return (np.arange(nb)[:, None] * batch_size + np.arange(sl.start, sl.stop)[None, :]).reshape(-1)
