"""Ratings files: ``user item rating [timestamp]`` per line, separated by ``::``,
a tab, a comma or spaces (MovieLens styles). A header line is skipped. Raw
user and item ids are remapped to dense rows in sorted order of the training
file; ids seen only in the eval file map to one extra "unknown" row per table."""

import numpy as np

from .files import read_lines

__all__ = ["parse_rating", "load_ratings", "is_header", "split_fields"]


def split_fields(line: str) -> list:
    """A ratings line's fields (by ``::``, a tab, a comma, else spaces). Local."""
    for sep in ("::", "\t", ","):
        if sep in line:
            return [x.strip() for x in line.split(sep)]
    return line.split()


def parse_rating(line: str):
    """One line -> (user, item, rating). Raises ValueError. Local."""
    f = split_fields(line)
    if len(f) not in (3, 4):
        raise ValueError(f"expected 'user item rating [timestamp]', got {len(f)} fields")
    if not f[0] or not f[1]:
        raise ValueError("empty user or item id")
    try:
        rating = float(f[2])
    except ValueError:
        raise ValueError(f"rating is not a number: {f[2]!r}") from None
    if not np.isfinite(rating) or abs(rating) > 1e6:
        # 1e39 is finite as a float64 and inf in the float32 the model trains in
        raise ValueError(f"rating {f[2]!r} is not a finite number of at most 1e6 in magnitude")
    return f[0], f[1], rating


def is_header(line: str) -> bool:
    """Whether ``line`` is a header: its third field is not a number. Local."""
    f = split_fields(line)
    if len(f) < 3:
        return False
    try:
        float(f[2])
        return False
    except ValueError:
        return True


def load_ratings(path, eval_path, eval_fraction, skip_bad, stats):
    """((train arrays), (eval arrays), num_users, num_items, mean rating, {"users": sorted raw user
    ids, "items": ...}: row ``i`` of a table is its ``i``-th id, and the row after the last is every
    id the training data lacks). Local."""
    train = read_lines(path, parse_rating, skip_bad, stats, skip_header=is_header)
    if eval_path:
        evaluation = read_lines(eval_path, parse_rating, skip_bad, stats, skip_header=is_header,
                                key="data.eval_path")
    else:
        cut = len(train) - int(round(len(train) * eval_fraction))
        train, evaluation = train[:cut], train[cut:]
    if not train:
        raise ValueError(f"no ratings in {path}")
    users = {u: i for i, u in enumerate(sorted({r[0] for r in train}))}
    items = {m: i for i, m in enumerate(sorted({r[1] for r in train}))}
    nu, ni = len(users), len(items)

    def arrays(recs):
        u = np.array([users.get(r[0], nu) for r in recs], np.int64)
        i = np.array([items.get(r[1], ni) for r in recs], np.int64)
        y = np.array([r[2] for r in recs], np.float32)
        return np.zeros((len(recs), 0), np.float32), [u, i], y

    tr, ev = arrays(train), arrays(evaluation)
    stats["eval_unknown_ids"] = int((ev[1][0] == nu).sum() + (ev[1][1] == ni).sum())
    return tr, ev, nu + 1, ni + 1, float(tr[2].mean()), {"users": list(users), "items": list(items)}
