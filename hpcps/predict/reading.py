"""How ``hpcps predict`` and ``hpcps evaluate`` read their input: a part's lines in blocks of
``PARSE_LINES``, parsed by training's readers (``hpcps.data.columns.parse_block``), in a child
process where the node has a CPU for it. Local, pure (no MPI).

Parsing (pyarrow's reader, the hashing: ~1.4 us a line) costs more than scoring a line, and most
of it holds the GIL, so a thread does not overlap it with scoring; a forked child does (the
training loader's rule, ``pipeline.loader``: ``auto`` where each worker of the node and its child
can have a CPU of their own, the PS ranks mostly sleeping). The child reads and parses up to
``AHEAD`` blocks ahead and sends them back through a pipe; its errors (a bad line, a damaged file)
are raised in the worker, and it dies with the worker (``PR_SET_PDEATHSIG``).
"""

import collections
import ctypes
import multiprocessing
import signal
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from ..data.columns import Layout, parse_block
from ..data.textfiles import LineReader

__all__ = ["PARSE_LINES", "read_part", "read_parts", "warm_up"]

PARSE_LINES = 16384          # lines parsed at once within a part
AHEAD = 4                    # blocks the child may parse ahead of the worker
_PR_SET_PDEATHSIG = 1


def read_part(reader: LineReader, files: list, part: tuple, lay: Layout, id_col, skip_bad: bool, stats: dict):
    """The samples of one part, in order, in blocks of ``PARSE_LINES``: yields ``(dense, keys,
    labels or None, lines, ids or None)``; ``lines``: each sample's data line in its file
    (0-based, the header not counted). Local."""
    k, lo, hi = part
    for a in range(lo, hi, PARSE_LINES):
        yield _block(reader, files, k, a, min(a + PARSE_LINES, hi), lay, id_col, skip_bad, stats)


def _block(reader, files, k, a, b, lay, id_col, skip_bad, stats):
    fi = files[k]
    block = reader.read(k, a, b)
    where = lambda i: f"{fi.path}:{a + i + 1 + (fi.header is not None)}"   # noqa: E731
    parse = getattr(lay, "parse", None)               # a ratings input parses itself
    dense, keys, labels, slots = (parse(block, b - a, where, skip_bad, stats) if parse else
                                  parse_block(block, b - a, where, lay, skip_bad, stats))
    lines = np.arange(a, b, dtype=np.int64) if slots is None else a + slots
    ids = None if id_col is None else _ids(block, lay, id_col, None if slots is None else lines - a)
    return dense, keys, (labels if lay.label >= 0 else None), lines, ids


def warm_up(files: list, lay: Layout) -> None:
    """Parse the input's first data line once, so that the parsers' one-off start (~0.2 s: pyarrow's
    reader, the hashing's tables) is paid at start-up and not in the first part. Local."""
    first = next((f.first for f in files if f.first), None)
    if first is not None and not hasattr(lay, "parse"):
        parse_block(f"{first}\n".encode(), 1, lambda i: "the first line", lay, True, {})


def read_parts(files: list, parts: list, which, lay: Layout, id_col, skip_bad: bool, stats: dict,
               child: bool = False):
    """The samples of parts ``which`` (numbers into ``parts``), in order: yields ``(part number,
    block)`` for each of :func:`read_part`'s blocks and ``(part number, None)`` after a part's last.
    ``child``: parse in a forked child process, ahead of the caller. Local."""
    blocks = [(i, parts[i][0], a, min(a + PARSE_LINES, parts[i][2]))
              for i in which for a in range(parts[i][1], parts[i][2], PARSE_LINES)]
    last = {i: n for n, (i, *_) in enumerate(blocks)}
    if not child or len(blocks) < 2:
        reader = LineReader(files)
        try:
            for n, (i, k, a, b) in enumerate(blocks):
                yield i, _block(reader, files, k, a, b, lay, id_col, skip_bad, stats)
                if last[i] == n:
                    yield i, None
        finally:
            reader.close()
    else:
        yield from _in_child(files, blocks, last, lay, id_col, skip_bad, stats)


def _in_child(files, blocks, last, lay, id_col, skip_bad, stats):
    ctx = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(1, mp_context=ctx, initializer=_child_start, initargs=(files, lay, id_col, skip_bad)) as ex:
        pending = collections.deque()
        try:
            for n in range(len(blocks)):
                while len(pending) < AHEAD and n + len(pending) < len(blocks):
                    pending.append(ex.submit(_child_block, *blocks[n + len(pending)][1:]))
                block, delta = pending.popleft().result()
                for key, v in delta.items():
                    stats[key] = stats.get(key, 0) + v
                i = blocks[n][0]
                yield i, block
                if last[i] == n:
                    yield i, None
        finally:
            for f in pending:
                f.cancel()


_CHILD = {}


def _child_start(files, lay, id_col, skip_bad) -> None:
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)   # die with the worker
    except (OSError, AttributeError):
        pass
    _CHILD.update(reader=LineReader(files), files=files, lay=lay, id_col=id_col, skip_bad=skip_bad)


def _child_block(k, a, b):
    c, stats = _CHILD, {}
    return _block(c["reader"], c["files"], k, a, b, c["lay"], c["id_col"], c["skip_bad"], stats), stats


def _ids(block: bytes, lay: Layout, col: int, keep):
    """Column ``col`` of the block's lines (``keep``: the good lines' numbers, None: all) as a
    pyarrow string array (it crosses from the child as buffers): pyarrow's reader where every line
    parses, else a split per line."""
    import pyarrow as pa
    if keep is None:
        import pyarrow.csv as pacsv
        names = [f"f{c}" for c in range(lay.ncols)]
        try:
            table = pacsv.read_csv(pa.py_buffer(block), read_options=pacsv.ReadOptions(column_names=names, use_threads=False),
                                   parse_options=pacsv.ParseOptions(delimiter=lay.delimiter, quote_char=False),
                                   convert_options=pacsv.ConvertOptions(column_types={names[col]: pa.string()},
                                                                        include_columns=[names[col]],
                                                                        strings_can_be_null=False))
            return table.column(0).combine_chunks()
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            pass
    raw = block.split(b"\n")[:-1]
    rows = range(len(raw)) if keep is None else keep
    return pa.array([raw[i].decode("utf-8", "replace").rstrip("\r").split(lay.delimiter)[col] for i in rows], pa.string())
