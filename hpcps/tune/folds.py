"""``tune.folds``: trials judged by cross-validation. ``data.path``'s lines are shuffled
(``job.seed``) and dealt into K folds, once per study (``tune.study/folds/``, written whole before
it is used: the searches sharing a study find the same files); a trial trains K times, on all but
one fold, evaluated on that fold, and its value is the mean over the K. On a few thousand rows one
eval split's AUC moves by a few hundredths between samples: a search judged by it picks noise."""

import os
import random
from pathlib import Path

from ..data.sources import header_rule

__all__ = ["write_folds"]


def _write(path: Path, lines: list) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text("".join(lines))
    os.replace(tmp, path)                  # whole or absent, for every search sharing the study


def write_folds(cfg, folder: Path) -> list:
    """``[(train file, held-out file)]`` of each fold of ``cfg.data.path`` (``tune.folds`` of
    them, a CSV header on each) in ``folder/folds``; files already there from the same file, count
    and seed are reused. ``ValueError`` naming the key where the data cannot be cut. Local."""
    k, d = cfg.tune.folds, cfg.data
    path = Path(d.path)
    if not path.is_file():
        raise ValueError(f"config: tune.folds = {k}: data.path = {d.path!r} must be one file (its lines are "
                         f"dealt into the folds)")
    out = folder / "folds"
    files = [(out / f"train-{i}", out / f"held-{i}") for i in range(k)]
    stamp = f"{path.resolve()} {path.stat().st_size} {path.stat().st_mtime_ns} folds={k} seed={cfg.job.seed}\n"
    source = out / "source"
    if source.exists() and source.read_text() == stamp and all(a.exists() and b.exists() for a, b in files):
        return files
    lines = [x if x.endswith("\n") else x + "\n" for x in path.read_text().splitlines(keepends=True) if x.strip()]
    header = lines[:1] if lines and header_rule(d)(lines[0].rstrip("\r\n")) else []
    rows = lines[len(header):]
    if len(rows) < 2 * k:
        raise ValueError(f"config: tune.folds = {k}: data.path = {d.path!r} has {len(rows)} lines: too few for {k} folds")
    random.Random(cfg.job.seed).shuffle(rows)
    parts = [rows[i::k] for i in range(k)]
    out.mkdir(parents=True, exist_ok=True)
    for i, (train, held) in enumerate(files):
        _write(train, header + [x for j, part in enumerate(parts) if j != i for x in part])
        _write(held, header + parts[i])
    _write(source, [stamp])
    return files
