"""What ``hpcps predict`` and ``hpcps evaluate`` read of a ratings file: ``user item [rating
[timestamp]]`` per line (training's separators: ``::``, a tab, a comma or spaces), the raw ids
mapped to rows by the checkpoint's own id lists (``ratings_ids`` in its manifest: training's
sorted ids; an id training did not see gets the table's last row, as in training's evaluation).
Local, pure (no MPI).
"""

import numpy as np

from ..data.ratings import is_header, parse_rating, split_fields

__all__ = ["RatingsInput", "ratings_input", "ratings_header"]


class RatingsInput:
    """A ratings input as :mod:`hpcps.predict.reading` parses it (:meth:`parse`, as
    ``hpcps.data.columns.parse_block``) with what :class:`hpcps.predict.inputs.Shape` asks of a
    layout. ``labelled``: the lines hold the observed rating (a third field)."""

    task = "ratings"

    def __init__(self, ids: dict, labelled: bool):
        self.users = {u: i for i, u in enumerate(ids["users"])}
        self.items = {m: i for i, m in enumerate(ids["items"])}
        self.tables = [("users", len(self.users) + 1), ("items", len(self.items) + 1)]
        self.dense, self.label = [], 0 if labelled else -1
        self.names = ["user", "item"] + (["rating"] if labelled else [])

    def parse(self, block: bytes, n: int, where, skip_bad: bool, stats: dict):
        """``(dense (n, 0), keys (n, 2) rows, ratings (NaN without), slots of the good lines or
        None)``; a bad line is a ``ValueError`` naming it (``where(i)``), or with ``skip_bad``
        dropped and counted in ``stats["skipped_lines"]``."""
        nu, ni = len(self.users), len(self.items)
        keys, labels, slots = np.empty((n, 2), np.int64), np.full(n, np.nan, np.float32), []
        for i, line in enumerate(block.decode("utf-8", "replace").split("\n")[:n]):
            try:
                user, item, rating = _fields(line.rstrip("\r"), self.label >= 0)
            except ValueError as e:
                if not skip_bad:
                    raise ValueError(f"{where(i)}: {e} (data.skip_bad_lines = true skips such lines)") from None
                stats["skipped_lines"] = stats.get("skipped_lines", 0) + 1
                continue
            k = len(slots)
            keys[k] = self.users.get(user, nu), self.items.get(item, ni)
            labels[k] = rating
            slots.append(i)
        m = len(slots)
        return (np.zeros((m, 0), np.float32), keys[:m], labels[:m],
                None if m == n else np.asarray(slots, np.int64))


def _fields(line: str, labelled: bool) -> tuple:
    """``(user, item, rating or NaN)`` of a line: training's :func:`parse_rating` where the lines
    hold the rating, else ``user item`` (and whatever follows). ``ValueError`` naming the problem."""
    if labelled:
        return parse_rating(line)
    f = split_fields(line)
    if len(f) < 2 or len(f) > 4 or not f[0] or not f[1]:
        raise ValueError(f"expected 'user item [rating [timestamp]]', got {len(f)} fields")
    return f[0], f[1], np.nan


def ratings_header(d):
    """``is_header(first line)`` for a ratings input: ``data.header`` true or false, or auto: a
    line whose third field is not a number (``user item`` files: no header unless true). Local."""
    if d.header in ("true", "false"):
        return lambda line: d.header == "true"
    return is_header


def ratings_input(files: list, labelled: str, manifest: dict, path) -> RatingsInput:
    """The input of ``files`` (their index) against checkpoint ``path``'s id lists; ``labelled``:
    ``yes``, ``no`` or ``auto`` (the first data line has a third field). Local."""
    ids = manifest.get("ratings_ids")
    if ids is None:
        raise ValueError(f"{path}: its manifest keeps no ratings ids (written by an older hpcps): it cannot map "
                         "raw user and item ids to rows")
    first = next((f.first for f in files if f.first), "") or ""
    if not 2 <= len(split_fields(first)) <= 4:            # the wrong checkpoint for these files, likely
        raise ValueError(f"{files[0].path}: its first line has {len(split_fields(first))} fields, not 'user item "
                         f"[rating]': {path} is a ratings model (data.format = ratings); score these files with a "
                         "checkpoint trained on them")
    has = len(split_fields(first)) >= 3
    if labelled == "yes" and not has:
        raise ValueError(f"{files[0].path}: its first line has no rating (--labels yes)")
    return RatingsInput(ids, has if labelled == "auto" else labelled == "yes")
