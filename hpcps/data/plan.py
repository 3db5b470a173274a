"""Which lines of the input each worker reads in an epoch, as a pure function of the input's line
counts, the seed, the epoch and the restarts. Local, pure (no MPI, no I/O).

The epoch's *stream* is the training segments (runs of data lines of a file) in a seeded order,
one position a line. Its first ``S * B`` positions (``S = N // B`` steps of global batch ``B``) are
cut into one contiguous *share* per worker, worker ``w`` taking ``S * b_w`` positions where ``b_w``
is its slice of the global batch; at each step a worker takes the next ``b_w`` positions of its
share. So the position of every worker at a step follows from the step alone: a checkpoint records
only the plan (:class:`Plan`). A restart with another number of workers re-cuts what no worker has
read yet into new shares (:func:`replan`): no line is read twice or skipped.
"""

from dataclasses import dataclass

import numpy as np

from .base import worker_slice

__all__ = ["Plan", "fresh_plan", "replan", "stream_ranges", "epoch_order", "window_order", "runs"]


@dataclass
class Plan:
    """An epoch's shares from ``step0`` on: ``pieces[w]`` the stream ranges ``[start, end)`` of
    worker ``w``'s share, in reading order."""

    epoch: int
    step0: int
    batch: int
    pieces: list

    @property
    def workers(self) -> int:
        return len(self.pieces)

    def take(self, w: int) -> int:
        """Worker ``w``'s positions per step (its slice of the global batch)."""
        sl = worker_slice(self.batch, self.workers, w)
        return sl.stop - sl.start

    def share_len(self, w: int) -> int:
        return sum(e - s for s, e in self.pieces[w])

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "step0": self.step0, "batch": self.batch, "pieces": self.pieces}

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        return cls(int(d["epoch"]), int(d["step0"]), int(d["batch"]), [[list(map(int, p)) for p in w]
                                                                        for w in d["pieces"]])


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The order of the ``n`` segments in epoch ``epoch``: seeded, or as given."""
    return np.random.default_rng([seed, 11, epoch]).permutation(n) if shuffle else np.arange(n)


def window_order(seed: int, plan: Plan, w: int, j: int, n: int) -> np.ndarray:
    """The order in which worker ``w`` takes the ``n`` lines of window ``j`` of its share."""
    return np.random.default_rng([seed, 13, plan.epoch, plan.step0, w, j]).permutation(n)


def fresh_plan(epoch: int, steps: int, batch: int, workers: int) -> Plan:
    """Epoch ``epoch`` from its start: worker ``w`` takes positions ``[S*lo_w, S*hi_w)``, where
    ``[lo_w, hi_w)`` is its slice of the global batch."""
    pieces = []
    for w in range(workers):
        sl = worker_slice(batch, workers, w)
        pieces.append([[steps * sl.start, steps * sl.stop]])
    return Plan(epoch, epoch * steps, batch, pieces)


def stream_ranges(pieces: list, q0: int, q1: int) -> list:
    """The stream ranges of share positions ``[q0, q1)`` of a share made of ``pieces``."""
    out, at = [], 0
    for s, e in pieces:
        n = e - s
        lo, hi = max(q0 - at, 0), min(q1 - at, n)
        if lo < hi:
            out.append([s + lo, s + hi])
        at += n
        if at >= q1:
            break
    return out


def wrap_ranges(ranges: list, total: int) -> list:
    """Stream ranges with the positions past an epoch's ``total`` lines taken from its start again:
    an epoch of ``ceil(total / batch)`` full batches fills its last one with its first lines, so no
    line is left out (``hpcps.data.stream``). Local, pure."""
    out = []
    for a, b in ranges:
        if b <= total:
            out.append([a, b])
        elif a >= total:
            out.append([a - total, b - total])
        else:
            out += [[a, total], [0, b - total]]
    return out


def _ranges(positions: np.ndarray) -> list:
    """Sorted positions as ``[start, end)`` ranges."""
    if positions.shape[0] == 0:
        return []
    cut = np.flatnonzero(np.diff(positions) != 1) + 1
    starts, ends = positions[np.r_[0, cut]], positions[np.r_[cut - 1, positions.shape[0] - 1]] + 1
    return [[int(a), int(b)] for a, b in zip(starts, ends)]


def unread(plan: Plan, w: int, step: int, window: int, seed: int) -> list:
    """The stream ranges of worker ``w``'s share that it has not read by ``step``: its windows
    still ahead, and of the window it is in, the lines its seeded order has not reached."""
    used, total = (step - plan.step0) * plan.take(w), plan.share_len(w)
    j, k = divmod(used, window)
    out = []
    if k:
        n = min(window, total - j * window)
        left = np.sort(window_order(seed, plan, w, j, n)[k:]) + j * window
        for a, b in _ranges(left):
            out += stream_ranges(plan.pieces[w], a, b)
        used = j * window + n
    return out + stream_ranges(plan.pieces[w], used, total)


def replan(plan: Plan, step: int, steps: int, workers: int, window: int, seed: int) -> Plan:
    """``plan`` at ``step`` (its epoch's), re-cut for ``workers``: what each worker of ``plan`` has
    not read (:func:`unread`), in worker order, split into consecutive new shares of
    ``left * b_v`` positions."""
    rest = []
    for w in range(plan.workers):
        rest += unread(plan, w, step, window, seed)
    left = (plan.epoch + 1) * steps - step
    new = Plan(plan.epoch, step, plan.batch, [])
    at = 0
    for v in range(workers):
        sl = worker_slice(plan.batch, workers, v)
        n = left * (sl.stop - sl.start)
        new.pieces.append(stream_ranges(rest, at, at + n))
        at += n
    return new


def runs(segments: list, starts: np.ndarray, a: int, b: int) -> list:
    """``[(file, lo, hi)]``: the data lines of stream positions ``[a, b)``, where ``segments`` are
    ``(file, lo, hi)`` in stream order and ``starts`` their first positions (with the total last)."""
    out = []
    k = int(np.searchsorted(starts, a, side="right")) - 1
    while a < b:
        f, lo, hi = segments[k]
        off = a - int(starts[k])
        n = min(b - a, hi - lo - off)
        out.append((f, lo + off, lo + off + n))
        a += n
        k += 1
    return out
