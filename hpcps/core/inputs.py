"""Input file specs: ``data.path`` may be a file, a glob, or a comma-separated list of them, each
plain, gzip (``.gz``) or bzip2 (``.bz2``, by the name or the file's first bytes). Pure: no MPI."""

import bz2
import glob
import gzip
import io
import zlib
from pathlib import Path

__all__ = ["expand_inputs", "open_text", "READ_ERRORS"]

# what a damaged compressed file raises while it is read (a truncated gzip: EOFError)
READ_ERRORS = (EOFError, OSError, zlib.error)


def expand_inputs(spec: str, key: str = "data.path") -> list[Path]:
    """The files ``spec`` names, in order: each comma-separated item a file or a glob (sorted
    matches). ``ValueError`` naming ``key`` and the item for a missing file, a glob that matches
    nothing or a directory. Local."""
    items = [s.strip() for s in str(spec).split(",")]
    if not any(items):
        raise ValueError(f"config: {key} = {spec!r}: no file named")
    files = []
    for item in items:
        if not item:
            raise ValueError(f"config: {key} = {spec!r}: an empty item in the list")
        if glob.has_magic(item):
            found = sorted(Path(p) for p in glob.glob(item))
            if not found:
                raise ValueError(f"config: {key} = {spec!r}: the glob {item!r} matches no file")
            files += [p for p in found if p.is_file()]
            continue
        p = Path(item)
        if not p.is_file():
            why = "is a directory (give a glob such as dir/*.gz)" if p.is_dir() else "no such file"
            which = "" if len(items) == 1 else f"{item}: "
            raise ValueError(f"config: {key} = {spec!r}: {which}{why}")
        files.append(p)
    return files


def open_text(path) -> io.TextIOBase:
    """``path`` for reading text (UTF-8, bad bytes replaced), decompressed if it is gzip or bzip2. Local."""
    with open(path, "rb") as f:
        magic = f.read(3)
    if magic[:2] == b"\x1f\x8b":
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    if magic == b"BZh":
        return bz2.open(path, "rt", encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")
