"""Input file specs: ``data.path`` may be a file, a directory, a glob, or a comma-separated list of
them, each plain, gzip (``.gz``) or bzip2 (``.bz2``, by the name or the file's first bytes). Pure: no MPI."""

import bz2
import glob
import gzip
import io
import zlib
from pathlib import Path

__all__ = ["expand_inputs", "open_binary", "open_text", "READ_ERRORS"]

# what a damaged compressed file raises while it is read (a truncated gzip: EOFError)
READ_ERRORS = (EOFError, OSError, zlib.error)


def expand_inputs(spec: str, key: str = "data.path") -> list[Path]:
    """The files ``spec`` names, in order: each comma-separated item a file, a directory (its files
    but hidden ones, sorted) or a glob (sorted matches). ``ValueError`` naming ``key`` and the item
    for a missing file, a glob that matches nothing or a directory without files. Local."""
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
        if p.is_dir():                                   # a directory: its files (not hidden ones)
            found = sorted(q for q in p.iterdir() if q.is_file() and not q.name.startswith("."))
            if not found:
                raise ValueError(f"config: {key} = {spec!r}: the directory {item} holds no file")
            files += found
            continue
        if not p.is_file():
            why = "no such file"
            which = "" if len(items) == 1 else f"{item}: "
            raise ValueError(f"config: {key} = {spec!r}: {which}{why}")
        files.append(p)
    return files


def open_binary(path):
    """``(file object for reading bytes, compressed)`` of ``path``, decompressing gzip and bzip2
    (by the file's first bytes). Local."""
    with open(path, "rb") as f:
        magic = f.read(3)
    if magic[:2] == b"\x1f\x8b":
        return gzip.open(path, "rb"), True
    if magic == b"BZh":
        return bz2.open(path, "rb"), True
    return open(path, "rb"), False


def open_text(path) -> io.TextIOBase:
    """``path`` for reading text (UTF-8, bad bytes replaced), decompressed if it is gzip or bzip2. Local."""
    return io.TextIOWrapper(open_binary(path)[0], encoding="utf-8", errors="replace")
