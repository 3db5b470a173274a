"""Delimited input (``data.format = "csv"`` or ``"criteo"``) from the settings: index the files, work
out the columns, and hand back a streaming or an in-memory data source. Collective over ``comm``
where one is given (every rank of it calls), else local.

``data.reader = "auto"`` streams when the input holds more than ``MEMORY_BYTES`` of text, else it
reads the input into memory: there a global batch is the same rows whatever the number of workers
(a sync-mode result does not depend on it), while a stream cuts the epoch into one share per worker
(see :mod:`hpcps.data.plan`), or, with ``data.stream_split = "batches"``, has every worker read
every line and take its slice of each global batch (independent of the number of workers again,
at the cost of reading the input once per worker).
"""

from ..core.inputs import expand_inputs
from .columns import criteo_layout, resolve_layout
from .stream import PARSE_LINES, Lines, StreamData, read_all
from .tabular import TabularData, epoch_steps
from .textfiles import index_file

__all__ = ["delimited", "header_rule", "index_files", "files_layout", "MEMORY_BYTES"]

MEMORY_BYTES = 256 << 20


def _is_number(x: str) -> bool:
    try:
        float(x)
        return True
    except ValueError:
        return False


def header_rule(d):
    """``is_header(first line)`` for ``data.header``: true, false, or auto (a header where the label
    column's field is not a number; for a label given by name, where a field is that name or no
    field is a number). Local."""
    if d.format == "criteo" or d.header == "false":
        return lambda line: False
    if d.header == "true":
        return lambda line: True
    label = str(d.label)

    def auto(line: str) -> bool:
        fields = [f.strip() for f in line.split(d.delimiter)]
        if not label.isdigit():                  # by name: a line holding it, or holding no number
            return label in fields or not any(_is_number(f) for f in fields)
        return int(label) < len(fields) and not _is_number(fields[int(label)])
    return auto


def _everywhere(comm, work):
    """``work()`` on this rank, its answer gathered from every rank of ``comm`` (a list in rank
    order); a ``ValueError`` on any rank is raised on all. Collective over ``comm``, or local."""
    answer, error = None, None
    try:
        answer = work()
    except ValueError as e:
        error = e
    parts = comm.allgather((answer, error)) if comm is not None else [(answer, error)]
    errors = [e for _, e in parts if e]
    if errors:
        raise errors[0]
    return [a for a, _ in parts]


def index_files(paths: list, rule, comm=None) -> list:
    """Every file's index (:class:`hpcps.data.textfiles.FileIndex`: line counts, header by ``rule``,
    first data line), the files shared out over ``comm``'s ranks. Collective over ``comm`` where
    given, else local."""
    size, rank = (comm.Get_size(), comm.Get_rank()) if comm is not None else (1, 0)
    found = {}
    for part in _everywhere(comm, lambda: {i: index_file(paths[i], rule) for i in range(rank, len(paths), size)}):
        found.update(part)
    return [found[i] for i in range(len(paths))]


def files_layout(d, files: list):
    """The :class:`hpcps.data.columns.Layout` of indexed ``files`` under data settings ``d``: Criteo's,
    or the columns their (equal) headers or first data line give; ``ValueError`` naming a file whose
    header differs or that has no data line. Local."""
    if d.format == "criteo":
        return criteo_layout(d.hash_rows)
    first = files[0]
    for fi in files:
        if fi.header is None and d.header == "true":
            raise ValueError(f"{fi.path}: empty, but data.header = true expects a header line")
        fields = (fi.header or "").split(d.delimiter)
        label = int(d.label) if str(d.label).isdigit() and int(d.label) < len(fields) else None
        if d.header == "true" and (all(_is_number(x) for x in fields if x.strip())
                                   or (label is not None and _is_number(fields[label]))):
            raise ValueError(f"{fi.path}:1: data.header = true, but the first line looks like data, not a header: "
                             f"{fi.header[:120]!r}")
        if (fi.header is None) != (first.header is None) or (fi.header and fi.header != first.header):
            raise ValueError(f"{fi.path}:1: its header differs from {first.path}'s (or one has none): "
                             f"{(fi.header or fi.first or '')[:120]!r}")
    line = first.header if first.header is not None else next((fi.first for fi in files if fi.first), None)
    if line is None:
        raise ValueError(f"{first.path}: no data line")
    fields = [x.strip() for x in line.split(d.delimiter)]
    return resolve_layout(d, fields if first.header is not None else None, len(fields), first.path)


def _lines(d, comm):
    rule = header_rule(d)
    train_paths = [str(p) for p in expand_inputs(d.path, "data.path")]
    eval_paths = [str(p) for p in expand_inputs(d.eval_path, "data.eval_path")] if d.eval_path else []
    files = index_files(train_paths + eval_paths, rule, comm)
    lay = files_layout(d, files)
    nt = len(train_paths)
    train = Lines(files, [(k, 0, files[k].lines) for k in range(nt) if files[k].lines])
    if eval_paths:
        evaluation = Lines(files, [(k, 0, files[k].lines) for k in range(nt, len(files)) if files[k].lines])
        return lay, train, evaluation, files
    keep = train.total - int(round(train.total * d.eval_fraction))
    cut_train, cut_eval, at = [], [], 0
    for f, lo, hi in train.segments:        # the held-out tail, in file order, is the same every epoch
        mid = min(max(keep - at, 0), hi - lo)
        if mid:
            cut_train.append((f, lo, lo + mid))
        if lo + mid < hi:
            cut_eval.append((f, lo + mid, hi))
        at += hi - lo
    return lay, Lines(files, cut_train), Lines(files, cut_eval), files


class _Shape:
    """What a rank that reads nothing (a PS) needs of in-memory data: the tables and the epoch."""

    def __init__(self, lay, steps, stats):
        self.task, self.tables, self.num_dense, self.steps_per_epoch, self.stats = \
            "ctr", lay.tables, len(lay.dense), steps, stats
        self.lay = lay


def delimited(d, seed: int, num_workers: int, worker: int, comm=None, reads: bool = True):
    """The data source of a ``DataConfig`` ``d`` of format csv or criteo for ``worker``. ``reads``:
    whether this rank trains on it (a PS rank passes False and gets only the tables' and the epoch's
    shape). Collective over ``comm`` (all its ranks) where given, else local."""
    lay, train, evaluation, files = _lines(d, comm)
    stats = {"skipped_lines": 0}
    text = sum(fi.nbytes for fi in files)
    stream = d.reader == "stream" or (d.reader == "auto" and text > MEMORY_BYTES)
    if stream:
        return StreamData(lay, train, evaluation, d.batch_size, num_workers, worker, seed, d.shuffle_buffer,
                          d.shuffle_files, d.skip_bad_lines, stats, d.stream_split)
    arrays = None

    def read():                            # a bad line is raised on every rank, not only where it was read
        nonlocal arrays
        if reads:
            arrays = (read_all(train, lay, PARSE_LINES, d.skip_bad_lines, stats),
                      read_all(evaluation, lay, PARSE_LINES, d.skip_bad_lines, stats))
        return arrays[0][2].shape[0] if arrays else -1
    n = max(_everywhere(comm, read))
    if not reads:
        if n < d.batch_size:
            raise ValueError(f"the training data has {n} samples, fewer than data.batch_size = {d.batch_size}")
        return _Shape(lay, epoch_steps(n, d.batch_size), stats)
    data = TabularData("ctr", lay.tables, arrays[0], arrays[1], d.batch_size, num_workers, worker, seed, stats)
    stats["reader"] = "memory"
    data.lay = lay                         # the columns, for a checkpoint's manifest (a model's serving input)
    return data

