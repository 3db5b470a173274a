"""Text input files by data line: one counting pass per file, then any run of lines read back with
bounded memory. Local, pure (no MPI).

:func:`index_file` reads a file once (plain, gzip or bzip2, by its first bytes), counts its data
lines (a header line excluded) and, for a plain file, marks a line start every ``MARK_BYTES`` so
that a later read seeks near the line it wants; a compressed file is decompressed from its start.
:class:`LineReader` returns data lines ``[lo, hi)`` of a file as one bytes block, each line ending in
a newline, and keeps its place so that consecutive runs continue without seeking.
"""

import bisect
import os
from dataclasses import dataclass, field

import numpy as np

from ..core.inputs import READ_ERRORS as _DAMAGED
from ..core.inputs import open_binary

__all__ = ["FileIndex", "index_file", "LineReader", "READ_BYTES"]

READ_BYTES = 1 << 20           # read size (each refill holds about three of them at its peak)
MARK_BYTES = 16 << 20          # a seek mark every this many bytes of a plain file


@dataclass
class FileIndex:
    """What the counting pass learnt of one file."""

    path: str
    compressed: bool
    header: str | None         # its first line, where that is a header
    lines: int                 # data lines
    nbytes: int                # bytes of text (decompressed)
    first: str | None = None   # its first data line (a sample of its fields)
    marks: list = field(default_factory=list)   # [(byte offset, data line)] of a plain file


def _damaged(path, lineno, e):
    return ValueError(f"{path}: cannot be read past line {lineno} ({type(e).__name__}: {e}): a truncated or "
                      f"damaged compressed file?")


def index_file(path, is_header) -> FileIndex:
    """Count the data lines of ``path``; ``is_header(first line as text)``: whether the first line
    is a header. A damaged compressed file is a ``ValueError`` naming it and the line reached. Local."""
    path = str(path)
    try:
        f, compressed = open_binary(path)
    except OSError as e:
        raise ValueError(f"cannot read data file {path}: {e.strerror}") from None
    lines, nbytes, header, marks, last, sample = 0, 0, None, [], b"\n", None
    with f:
        try:
            first = f.readline()
            nbytes += len(first)
            if first and is_header(first.decode("utf-8", "replace").rstrip("\r\n")):
                header = first.decode("utf-8", "replace").rstrip("\r\n")
            elif first:
                lines, last, sample = 1, first[-1:], first
            next_mark = MARK_BYTES
            while True:
                chunk = f.read(READ_BYTES)
                if not chunk:
                    break
                if sample is None:
                    sample = chunk.split(b"\n", 1)[0]
                if not compressed and nbytes >= next_mark:
                    cut = chunk.find(b"\n")
                    if cut >= 0:       # the data line that starts after the chunk's first newline
                        marks.append((nbytes + cut + 1, lines + (last == b"\n")))
                        next_mark = nbytes + MARK_BYTES
                newlines = chunk.count(b"\n")
                # a line is counted where it starts: after a newline, or at the very start
                lines += newlines + (last == b"\n") - (chunk[-1:] == b"\n")
                nbytes += len(chunk)
                last = chunk[-1:]
        except _DAMAGED as e:
            raise _damaged(path, lines, e) from None
    if sample is not None:
        sample = sample.decode("utf-8", "replace").rstrip("\r\n")
    return FileIndex(path, compressed, header, lines, nbytes, first=sample, marks=marks)


class LineReader:
    """Data lines of indexed files, read in runs. Local: one per reading process (a forked loader
    child reopens what it reads: :meth:`close` before forking is not needed, the child's first read
    after a fork reopens)."""

    def __init__(self, files: list):
        self.files = files
        self._at = None            # (file number, file object, next data line, buffered bytes, pid)

    def close(self) -> None:
        if self._at is not None:
            self._at[1].close()
            self._at = None

    def _open(self, k: int, lo: int):
        fi = self.files[k]
        self.close()
        f, _ = open_binary(fi.path)
        line = 0
        if fi.header is not None:
            f.readline()
        i = bisect.bisect_right([m[1] for m in fi.marks], lo) - 1
        if i >= 0:
            f.seek(fi.marks[i][0])
            line = fi.marks[i][1]
        # file number, file, next data line, buffer, newline offsets in it, next byte, next newline, pid
        self._at = [k, f, line, b"", np.zeros(0, np.int64), 0, 0, os.getpid()]

    def read(self, k: int, lo: int, hi: int) -> bytes:
        """Data lines ``[lo, hi)`` of file ``k``, each ending in a newline. Local."""
        at = self._at
        if at is None or at[0] != k or at[2] > lo or at[7] != os.getpid():
            self._open(k, lo)
        at = self._at
        try:
            if at[2] < lo:
                self._take(lo - at[2], keep=False)
            return self._take(hi - lo, keep=True) if hi > lo else b""
        except _DAMAGED as e:
            raise _damaged(self.files[k].path, at[2], e) from None

    def _take(self, n: int, keep: bool) -> bytes:
        at = self._at
        out = []
        while n > 0:
            buf, ends, pos, e = at[3], at[4], at[5], at[6]
            have = ends.shape[0] - e
            if have == 0:                            # refill: the unread tail and the next chunk
                more = at[1].read(READ_BYTES)
                if not more:
                    if pos == len(buf):
                        fi = self.files[at[0]]
                        raise ValueError(f"{fi.path}: ends at data line {at[2]}, but the counting pass found "
                                         f"{fi.lines} (did the file change?)")
                    more = b"\n"                    # the file's last line has no newline
                buf = buf[pos:] + more
                at[3], at[4], at[5], at[6] = buf, np.flatnonzero(np.frombuffer(buf, np.uint8) == 10), 0, 0
                continue
            took = min(n, have)
            cut = int(ends[e + took - 1]) + 1
            if keep:
                out.append(buf[pos:cut])
            at[5], at[6] = cut, e + took
            at[2] += took
            n -= took
        return b"".join(out)
