"""Delimited files read as a stream: each worker reads and parses only its share of each epoch, a
shuffle window at a time, so its memory holds a window or two whatever the input's size. Local.

A worker's share (:mod:`hpcps.data.plan`) is read in *windows* of ``data.shuffle_buffer`` lines;
each window is parsed ``PARSE_LINES`` at a time (:func:`hpcps.data.columns.parse_block`) into
arrays of its size, and its samples are taken in a seeded order (seed, epoch, plan, worker,
window). A line dropped as bad or empty leaves its place to a copy of another sample of its block
(counted in ``stats``), so every batch keeps its size and every position follows from the step. Evaluation reads each worker's contiguous part of the eval
lines in file order.
"""

import numpy as np

from .base import Batch, DataSource, worker_slice
from .columns import parse_block
from .plan import Plan, epoch_order, fresh_plan, replan, runs, stream_ranges, window_order, wrap_ranges
from .tabular import epoch_steps
from .textfiles import LineReader

__all__ = ["Lines", "StreamData", "read_all"]

EVAL_BATCH = 4096
PARSE_LINES = 16384           # lines parsed at once (a window is parsed in such blocks)


class Lines:
    """Segments ``(file, lo, hi)`` of indexed files in a given order, one stream position a line."""

    def __init__(self, files: list, segments: list):
        self.files, self.segments = files, segments
        self.starts = np.concatenate([[0], np.cumsum([hi - lo for _, lo, hi in segments], dtype=np.int64)])
        self.total = int(self.starts[-1])

    def reorder(self, order) -> "Lines":
        return Lines(self.files, [self.segments[i] for i in order])

    def where(self, rs: list):
        """``where(i)``: ``"path:line"`` of line ``i`` of the block read for runs ``rs``."""
        cum = np.cumsum([0] + [hi - lo for _, lo, hi in rs])

        def name(i: int) -> str:
            r = int(np.searchsorted(cum, i, side="right")) - 1
            f, lo, _ = rs[r]
            fi = self.files[f]
            return f"{fi.path}:{lo + (i - cum[r]) + 1 + (fi.header is not None)}"
        return name


def _read(reader: LineReader, lines: Lines, ranges: list, lay, skip_bad: bool, stats: dict):
    """Parse stream ranges: ``(dense, keys, labels, slots, n lines)``."""
    rs = [r for a, b in ranges for r in runs(lines.segments, lines.starts, a, b)]
    block = b"".join(reader.read(f, lo, hi) for f, lo, hi in rs)
    n = sum(hi - lo for _, lo, hi in rs)
    return (*parse_block(block, n, lines.where(rs), lay, skip_bad, stats), n)


def read_all(lines: Lines, lay, window: int, skip_bad: bool, stats: dict):
    """Every sample of ``lines`` in order, bad lines dropped: ``(dense, [ids per table], labels)``."""
    reader = LineReader(lines.files)
    parts = []
    for a in range(0, lines.total, window):
        d, k, y, _, _ = _read(reader, lines, [[a, min(a + window, lines.total)]], lay, skip_bad, stats)
        parts.append((d, k, y))
    reader.close()
    if not parts:
        return np.zeros((0, len(lay.dense)), np.float32), [np.zeros(0, np.int64)] * len(lay.categorical), \
            np.zeros(0, np.float32)
    keys = np.concatenate([p[1] for p in parts])
    return (np.concatenate([p[0] for p in parts]), [keys[:, t].copy() for t in range(keys.shape[1])],
            np.concatenate([p[2] for p in parts]))


class StreamData(DataSource):
    """Training batches streamed from ``train`` (:class:`Lines` in file order), evaluation from
    ``evaluation``. ``window``: lines per shuffle window (``data.shuffle_buffer``); ``shuffle_files``:
    the segments' order is drawn anew each epoch. Local; :meth:`resume` and :meth:`state` give
    the plan a checkpoint records (worker 0's answer is every worker's)."""

    def __init__(self, lay, train: Lines, evaluation: Lines, batch_size: int, num_workers: int, worker: int,
                 seed: int, window: int, shuffle_files: bool, skip_bad: bool, stats: dict, split: str = "shares"):
        self.lay, self.train, self.evaluation = lay, train, evaluation
        self.task, self.tables, self.num_dense = "ctr", lay.tables, len(lay.dense)
        self.batch, self.workers, self.worker, self.seed = batch_size, num_workers, worker, seed
        self.window, self.shuffle_files, self.skip_bad, self.stats = window, shuffle_files, skip_bad, stats
        self.split = split                      # shares | batches (every worker reads every line)
        if train.total < batch_size:
            raise ValueError(f"the training data has {train.total} lines, fewer than data.batch_size = {batch_size}")
        self.steps_per_epoch = epoch_steps(train.total, batch_size)   # the last batch filled from the epoch's start
        self._resumed = None
        self._reader = LineReader(train.files)
        self._epoch = (None, None)              # (epoch, its Lines)
        self._win = (None, None)                # (key, (dense, keys, labels))
        stats.update({"train_samples": train.total, "eval_samples": evaluation.total, "reader": "stream"})

    # -- the plan ------------------------------------------------------------------------------
    def plan(self, epoch: int) -> Plan:
        """The shares of ``epoch``: the resumed plan for its epoch, else a fresh one. Local."""
        if self._resumed is not None and self._resumed.epoch == epoch:
            return self._resumed
        return fresh_plan(epoch, self.steps_per_epoch, self.batch, 1 if self.split == "batches" else self.workers)

    def resume(self, state: dict | None, step: int) -> None:
        """Continue from a checkpoint at ``step`` whose manifest recorded ``state``; a plan made for
        another number of workers is re-cut at ``step``. Local, alike on every rank."""
        if state and "lines" in state and int(state["lines"]) != self.train.total:
            raise ValueError(f"the checkpoint at step {step} read {int(state['lines'])} training lines; data.path now "
                             f"holds {self.train.total}: the files changed since, so its place in them is lost (restore "
                             f"the files, or train afresh in another checkpoint.dir)")
        epoch = step // self.steps_per_epoch
        if not state or int(state["epoch"]) != epoch or step % self.steps_per_epoch == 0:
            self._resumed = None
            return
        plan = Plan.from_dict(state)
        if self.split == "batches" and (plan.workers != 1 or plan.step0 != epoch * self.steps_per_epoch):
            raise ValueError("the checkpoint read its epoch in shares (data.stream_split = 'shares'); this run reads "
                             "it in global batches: finish the epoch with 'shares', or start a new run")
        if plan.batch != self.batch:
            raise ValueError(f"the checkpoint read its data with data.batch_size = {plan.batch}; this run has "
                             f"{self.batch}: the position in the epoch cannot be kept (start a new run, or keep it)")
        if plan.workers != self.workers and self.split == "shares":
            plan = replan(plan, step, self.steps_per_epoch, self.workers, self.window, self.seed)
        self._resumed = plan

    def state(self, step: int) -> dict:
        """What a checkpoint at ``step`` records of the reading: the plan of its epoch and the
        training lines it cuts (a restart on changed files is refused). Local."""
        return {**self.plan(step // self.steps_per_epoch).to_dict(), "lines": self.train.total}

    # -- training batches ----------------------------------------------------------------------
    def _lines(self, epoch: int) -> Lines:
        if self._epoch[0] != epoch:
            order = epoch_order(len(self.train.segments), self.seed, epoch, self.shuffle_files)
            self._epoch = (epoch, self.train.reorder(order))
        return self._epoch[1]

    def _window(self, plan: Plan, w: int, j: int):
        """Window ``j`` of this worker's share: ``(dense, keys, labels, order)``, in stream order,
        parsed ``PARSE_LINES`` at a time into arrays of the window's size (so that memory holds
        the window's samples and one block's text and temporaries)."""
        key = (plan.epoch, plan.step0, j)
        if self._win[0] == key:
            return self._win[1]
        self._win = (None, None)                 # free the last window before reading the next
        q0 = j * self.window
        n = min(q0 + self.window, plan.share_len(w)) - q0
        ranges = wrap_ranges(stream_ranges(plan.pieces[w], q0, q0 + n), self.train.total)
        lines = self._lines(plan.epoch)
        dense = np.empty((n, len(self.lay.dense)), np.float32)
        keys = np.empty((n, len(self.lay.categorical)), np.int64)
        labels = np.empty(n, np.float32)
        rng = np.random.default_rng([self.seed, 17, plan.epoch, plan.step0, w, j])
        for a in range(0, n, PARSE_LINES):
            d, k, y, slots, m = _read(self._reader, lines, stream_ranges(ranges, a, min(a + PARSE_LINES, n)),
                                      self.lay, self.skip_bad, self.stats)
            if slots is not None:                # dropped lines: their places take copies of others
                if slots.shape[0] == 0:
                    raise ValueError(f"no usable line among lines {q0 + a}-{q0 + a + m} of share {w} "
                                     f"share of epoch {plan.epoch}: every one was bad or empty")
                take = rng.integers(0, slots.shape[0], m)
                take[slots] = np.arange(slots.shape[0])
                d, k, y = d[take], k[take], y[take]
                self.stats["filled_places"] = self.stats.get("filled_places", 0) + m - slots.shape[0]
            dense[a:a + m], keys[a:a + m], labels[a:a + m] = d, k, y
        self._win = (key, (dense, keys, labels, window_order(self.seed, plan, w, j, n)))
        return self._win[1]

    def train_batch(self, step: int) -> Batch:
        epoch = step // self.steps_per_epoch
        plan = self.plan(epoch)
        if self.split == "batches":               # one share; this worker's slice of each global batch
            w, sl = 0, worker_slice(self.batch, self.workers, self.worker)
            q0, take = (step - plan.step0) * self.batch + sl.start, sl.stop - sl.start
        else:
            w, take = self.worker, plan.take(self.worker)
            q0 = (step - plan.step0) * take
        picks = []
        q = q0
        while q < q0 + take:
            j = q // self.window
            d, k, y, order = self._window(plan, w, j)
            lo = q - j * self.window
            hi = min(q0 + take - j * self.window, y.shape[0])
            idx = order[lo:hi]
            picks.append((d[idx], k[idx], y[idx]))
            q += hi - lo
        d, k, y = picks[0] if len(picks) == 1 else (np.concatenate([p[i] for p in picks]) for i in range(3))
        kt = np.ascontiguousarray(k.T)                    # one copy; each table's ids a row of it
        return Batch(d, list(kt), y)

    # -- evaluation ----------------------------------------------------------------------------
    def eval_batches(self, batch_size: int = EVAL_BATCH):
        m, w, nw = self.evaluation.total, self.worker, self.workers
        a, b = m * w // nw, m * (w + 1) // nw
        reader = LineReader(self.evaluation.files)
        try:
            for s in range(a, b, PARSE_LINES):
                d, k, y, _, _ = _read(reader, self.evaluation, [[s, min(s + PARSE_LINES, b)]], self.lay,
                                      self.skip_bad, {})
                for i in range(0, y.shape[0], batch_size):
                    yield Batch(d[i:i + batch_size], [np.ascontiguousarray(k[i:i + batch_size, t])
                                                      for t in range(k.shape[1])], y[i:i + batch_size])
        finally:
            reader.close()
