"""Whole-file line reading for the ratings reader, and the bad-line error of every file reader."""

from ..core.inputs import READ_ERRORS, expand_inputs, open_text

__all__ = ["BadLine", "read_lines"]


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

