"""What ``hpcps predict`` and ``hpcps evaluate`` read: the checkpoint a spec names, the job's config
(the checkpoint's own, then ``--config`` and ``--set``), the input's columns as training read them
(the label optional) and the input cut into parts of whole lines. Local, pure (no MPI) but for
:func:`index_inputs`.
"""

import dataclasses
from pathlib import Path

from ..checkpoint import store, tools
from ..config import load_config
from ..core.inputs import expand_inputs
from ..data.columns import Layout, criteo_layout
from ..data.sources import files_layout, header_rule, index_files
from ..train.compat import MODEL_KEYS
from .ratings import ratings_header, ratings_input

__all__ = ["SCORING", "resolve_checkpoint", "held_out", "tail_parts", "scoring_config", "index_inputs", "layout_of", "input_layout", "Shape", "check_tables", "peek_columns",
           "part_size", "plan_parts"]


# scoring reads every line and trains nothing: no held-out split, no epochs to judge
SCORING = ("data.eval_path=", "data.eval_fraction=0", "job.epochs=1", "job.early_stop_patience=0")


def resolve_checkpoint(spec: str, ckpt_dir: str = "") -> Path:
    """``--checkpoint``: what ``hpcps ckpt`` takes (a checkpoint, a directory meaning its newest
    verified one, ``DIR/best``: :func:`hpcps.checkpoint.tools.pick`), or ``best`` (that of the
    config's ``checkpoint.dir``); it must verify. ``ValueError`` naming what is missing or broken. Local."""
    if spec == "best" and not ckpt_dir:
        raise ValueError("--checkpoint best: the config has no checkpoint.dir (name DIR/best instead)")
    p = Path(ckpt_dir) / "best" if spec == "best" else Path(spec)
    if p.name == "best" and not p.exists() and p.parent.is_dir():
        raise ValueError(f"--checkpoint {spec}: {p.parent} has no best checkpoint (checkpoint.keep_best)")
    if not p.exists():
        raise ValueError(f"--checkpoint {spec}: no such file or directory")
    try:
        return tools.pick(p)
    except ValueError as e:
        raise ValueError(f"--checkpoint {spec}: {e}") from None


def held_out(path: Path) -> tuple[str, float]:
    """``(files, tail)``: the lines checkpoint ``path``'s training held out for evaluation, as its
    config says: ``data.eval_path`` (every line, tail 0), or the last ``data.eval_fraction`` of
    ``data.path``'s lines in input order. ``ValueError`` when it held out nothing. Local."""
    d = (store.read_manifest(path).get("config") or {}).get("data", {})
    if d.get("eval_path"):
        return d["eval_path"], 0.0
    if d.get("eval_fraction") and d.get("path"):
        return d["path"], float(d["eval_fraction"])
    raise ValueError(f"--checkpoint {path}: its training held out no lines (data.eval_fraction = 0, no "
                     "data.eval_path): name labelled files to score with --data")


def tail_parts(files: list, parts: list, tail: float) -> list:
    """``parts`` cut to the last ``tail`` of the input's lines, as training held them out
    (:func:`hpcps.data.sources.delimited`: the last ``round(total * tail)`` lines in input order). Local."""
    total = sum(f.lines for f in files)
    keep, at, out = total - int(round(total * tail)), 0, []
    for k, lo, hi in parts:
        first = max(lo, lo + keep - at)
        if first < hi:
            out.append((k, first, hi))
        at += hi - lo
    return out


def scoring_config(path: Path, config: str | None, data: str, sets=()):
    """The config a checkpoint is scored with: its own (from its manifest) < ``config`` < ``sets``,
    with ``data.path = data`` and nothing held out. A ``config`` of another model kind, dimension or
    MLPs than the checkpoint's is a ``ValueError`` naming the key. Local."""
    saved = store.read_manifest(path).get("config")
    if not saved:
        raise ValueError(f"{path}: its manifest holds no config (written by an older hpcps?)")
    cfg = load_config(config, ["metrics.tensorboard=", *sets, *SCORING, f"data.path={data}"], base=saved)
    for key in MODEL_KEYS:                                  # the keys a resume must share too
        have, want = getattr(cfg.model, key, None), saved.get("model", {}).get(key)
        if want is not None and have != want:
            raise ValueError(f"--config: model.{key} = {have!r}, but {path} holds a model with {want!r}")
    for key in ("format", "hash_rows", "keys"):           # what makes the rows a value maps to
        have, want = getattr(cfg.data, key), saved.get("data", {}).get(key)
        if want is not None and have != want:
            raise ValueError(f"--config/--set: data.{key} = {have!r}, but {path} was trained with {want!r} (a "
                             f"checkpoint of other data? leave data.{key} as the checkpoint has it)")
    if cfg.data.format not in ("csv", "criteo", "ratings"):
        raise ValueError(f"data.format = {cfg.data.format!r}: hpcps predict reads csv, criteo and ratings files "
                         "(a synthetic-ctr job has no input to score)")
    if cfg.model.dynamic_tables:
        raise ValueError("model.dynamic_tables: hpcps predict does not score dynamic tables yet "
                         "(hpcps ckpt export writes their ids and rows)")
    return cfg


def scoring_header(d, trained: dict | None = None):
    """``is_header(first line)`` of input to score: ``data.header`` as training read it, but with
    ``auto`` and the training input's column names (a checkpoint's ``layout``), a header is a line
    naming one of them (a line of values with no number is no header then). Local."""
    if d.format == "ratings":
        return ratings_header(d)
    names = set((trained or {}).get("names") or [])
    if d.format != "csv" or d.header != "auto" or not names:
        return header_rule(d)
    return lambda line: bool(names & {f.strip() for f in line.split(d.delimiter)})


def index_inputs(d, comm=None, trained: dict | None = None) -> list:
    """Every input file's index (line counts), the files shared out over ``comm``'s ranks; headers
    by :func:`scoring_header`. Collective over ``comm`` where given, else local."""
    paths = [str(p) for p in expand_inputs(d.path, "--data")]
    return index_files(paths, scoring_header(d, trained), comm)


def layout_of(d, files: list, labelled: str, manifest: dict, path) -> tuple:
    """``(layout, id column or None)`` of the input: :func:`input_layout` (csv, criteo) or a
    :class:`hpcps.predict.ratings.RatingsInput` (ratings, by checkpoint ``path``'s ids). Local."""
    if d.format == "ratings":
        return ratings_input(files, labelled, manifest, path), None
    return input_layout(d, files, labelled, manifest.get("layout"))


def peek_columns(cfg, path, labelled: str = "auto") -> None:
    """Before any communication: the first input file's header and first line must give the
    checkpoint's tables (:func:`check_tables`); the job checks every file again. Local."""
    from ..data.textfiles import FileIndex
    first = str(expand_inputs(cfg.data.path, "--data")[0])
    manifest = store.read_manifest(path)
    rule = scoring_header(cfg.data, manifest.get("layout"))
    lines, compressed = _head(first)
    header = lines[0] if lines[0] and rule(lines[0]) else None
    if not (lines[1] if header is not None else lines[0]):
        _some_data_line(cfg.data.path, rule)
    fi = FileIndex(first, compressed, header, 1, 0, first=lines[1] if header is not None else lines[0])
    lay, _ = layout_of(cfg.data, [fi], labelled, manifest, path)
    check_tables(cfg, Shape(lay), manifest, path)


def _head(name) -> tuple[list, bool]:
    """``([first line, second line], compressed)`` of input file ``name`` ("" past its end);
    ``ValueError`` naming a file that cannot be read. Local."""
    from ..core.inputs import open_binary
    try:
        f, compressed = open_binary(str(name))
    except OSError as e:
        raise ValueError(f"cannot read data file {name}: {e.strerror}") from None
    with f:
        return [f.readline().decode("utf-8", "replace").rstrip("\r\n") for _ in range(2)], compressed


def _some_data_line(spec: str, rule) -> None:
    """The first input file has no data line: ``ValueError`` unless another file has one. Local."""
    files = expand_inputs(spec, "--data")
    for name in files[1:]:
        lines, _ = _head(name)
        if lines[0] and not rule(lines[0]) or lines[1]:
            return
    raise ValueError(f"--data {spec}: no data lines to score ({'a header at most' if len(files) == 1 else f'{len(files)} files, each a header at most'})")


def _without(lay: Layout, col: int) -> Layout:
    """``lay`` for lines that lack column ``col`` (the label): later columns move down one."""
    shift = lambda c: c - (c > col)          # noqa: E731
    return dataclasses.replace(lay, ncols=lay.ncols - 1, names=[n for c, n in enumerate(lay.names) if c != col],
                               label=-1, dense=[shift(c) for c in lay.dense],
                               categorical=[shift(c) for c in lay.categorical])


def input_layout(d, files: list, labelled: str = "auto", trained: dict | None = None) -> tuple:
    """``(layout, id column or None)`` of the input as training read it (``d``: the scoring
    config's data). ``labelled``: ``yes``, ``no`` (the lines lack the label column), ``auto``
    (no label where a header lacks its name). A value's hash mixes in its column's place in the
    training input: ``trained`` (a checkpoint's ``layout``) gives it by name; without one (older
    checkpoints) the input is taken to have training's columns, less the label. Local."""
    first = files[0]
    header = first.header.split(d.delimiter) if first.header is not None else None
    if header is None and d.format == "csv" and trained and _by_name(d):
        return _headerless(d, first, labelled, trained)
    missing = header is not None and d.format == "csv" and str(d.label) not in [h.strip() for h in header]
    no_label = labelled == "no" or (labelled == "auto" and missing and not str(d.label).isdigit())
    if labelled == "yes" and missing:
        raise ValueError(f"{first.path}: its header has no label column {d.label!r} (--labels yes)")
    if d.format == "criteo":
        lay = criteo_layout(d.hash_rows)
    elif no_label and header is not None:            # the header without the label: as if it were last
        lay = files_layout(dataclasses.replace(d, header="true"), [_with_column(f, d, str(d.label)) for f in files])
    elif no_label:                                   # numbered columns as in training: one more there
        ncols = len((first.first or "").split(d.delimiter)) + 1
        from ..data.columns import resolve_layout
        lay = resolve_layout(d, None, ncols, first.path)
    else:
        lay = files_layout(d, files)
    if header is not None and trained:
        lay = _in_training_order(lay, trained)
    keys = list(lay.categorical)
    if no_label:
        lay = _without(lay, lay.label)
    lay.key_columns = _key_columns(lay, trained) if trained else keys
    return lay, _id_column(d, lay)


def _by_name(d) -> bool:
    """Whether the config names its label or columns by header names (not 0-based numbers). Local."""
    return any(isinstance(x, str) and x and not x.isdigit() and x != "rest"
               for x in [str(d.label), *d.categorical, *d.dense, *d.drop])


def _headerless(d, first, labelled: str, trained: dict) -> tuple:
    """Lines without a header, for a model trained on a file with one: the training input's columns
    in its order (with or without the label). ``ValueError`` when the lines' fields do not count up
    to that. Local."""
    base = Layout(**trained)
    n = len((first.first or "").split(d.delimiter))
    if n == base.ncols and labelled != "no":
        lay = base
    elif n == base.ncols - 1 and base.label >= 0 and labelled != "yes":
        lay = _without(base, base.label)
    else:
        raise ValueError(f"{first.path}: no header line, and {n} fields a line where training read {base.ncols} "
                         f"({', '.join(base.names[:8])}{', ...' if base.ncols > 8 else ''}): give the lines a header "
                         f"naming their columns, or training's columns in training's order (the label may be left out)")
    lay.key_columns = list(base.categorical)
    return lay, _id_column(d, lay)


def _in_training_order(lay: Layout, trained: dict) -> Layout:
    """A header's columns in another order than training's: the categorical and dense columns
    taken in training's order by name, so the tables are the checkpoint's. Unchanged where the names
    differ (:func:`check_tables` names the difference). Local."""
    tn = trained.get("names") or []
    cat, dense = [tn[c] for c in trained.get("categorical", [])], [tn[c] for c in trained.get("dense", [])]
    have = [lay.names[c] for c in lay.categorical], [lay.names[c] for c in lay.dense]
    if sorted(have[0]) != sorted(cat) or sorted(have[1]) != sorted(dense):
        return lay
    return dataclasses.replace(lay, categorical=[lay.names.index(n) for n in cat],
                               dense=[lay.names.index(n) for n in dense])


def _key_columns(lay: Layout, trained: dict) -> list:
    """Each categorical column's place in the training input (its hash key), by name. Local."""
    names = trained["names"]
    missing = [lay.names[c] for c in lay.categorical if lay.names[c] not in names]
    if missing:
        raise ValueError(f"the input's categorical column {missing[0]!r} was not in the training input "
                         f"(columns: {', '.join(names[:12])})")
    return [names.index(lay.names[c]) for c in lay.categorical]


class Shape:
    """What the tables and the model need of the input: its task, tables and dense features."""

    def __init__(self, lay):
        self.task, self.tables, self.num_dense = getattr(lay, "task", "ctr"), lay.tables, len(lay.dense)
        self.steps_per_epoch = 1


def check_tables(cfg, shape: Shape, manifest: dict, path) -> None:
    """The tables the input's columns give (``hpcps.train.tables.table_specs``) must be the
    checkpoint's (names and rows, fused or not): else a ``ValueError`` naming the first
    difference. Local."""
    from ..train.tables import table_specs
    have = [(name, rows) for name, rows, *_ in table_specs(cfg, shape)]
    want = [(n, r) for t in manifest["tables"] for n, r in (t.get("segments") or [[t["name"], t["num_rows"]]])]
    if have != want:
        raise ValueError(f"the input's columns do not give {path}'s tables: {_diff(have, want)} (the same "
                         f"data.format, data.categorical, data.drop and data.hash_rows as in training?)")


def _with_column(fi, d, name: str):
    """An index of ``fi`` whose header has ``name`` appended (its lines are read with one column less)."""
    return dataclasses.replace(fi, header=f"{fi.header}{d.delimiter}{name}")


def _diff(have: list, want: list) -> str:
    """The first difference of the tables the input gives and the checkpoint's, by name first (a
    table is a column's, or a part's of a model kind: ``C5``, ``wide_C5``). Local."""
    names = [n for n, _ in have]
    gone, extra = [n for n, _ in want if n not in names], [n for n in names if n not in {b for b, _ in want}]
    if gone or extra:
        said = [f"no column for the checkpoint's table{'s' if len(gone) > 1 else ''} {', '.join(gone[:6])}"] if gone else []
        said += [f"tables the checkpoint lacks: {', '.join(extra[:6])}"] if extra else []
        return f"{'; '.join(said)} ({len(have)} tables, the checkpoint has {len(want)})"
    if len(have) != len(want):
        return f"{len(have)} tables, the checkpoint has {len(want)}"
    for (a, ra), (b, rb) in zip(have, want):
        if (a, ra) != (b, rb):
            return f"table {a!r} ({ra} rows) where the checkpoint has {b!r} ({rb} rows)"
    return "?"


def _id_column(d, lay: Layout) -> int | None:
    """The column ``data.id`` names in the input's layout, or None. Local."""
    if d.format != "csv" or str(d.id) == "":
        return None
    if str(d.id).isdigit() and str(d.id) not in lay.names:
        return int(d.id)
    if str(d.id) not in lay.names:
        return None                                 # the input has no id column: none is written
    return lay.names.index(str(d.id))


AUTO_PARTS, MIN_PART, MAX_PART = 64, 16384, 1 << 20


def part_size(files: list, part_lines: int) -> int:
    """``--part-lines``, 0 meaning auto: the input in about ``AUTO_PARTS`` parts (work for every
    worker), each 16,384 to 1,048,576 lines. It depends on the input alone, so a rerun with other
    ranks goes on with the same parts. Local."""
    if part_lines:
        return part_lines
    total = sum(f.lines for f in files)
    return int(min(MAX_PART, max(MIN_PART, -(-total // AUTO_PARTS))))


def plan_parts(files: list, part_lines: int) -> list:
    """``[(file number, lo, hi)]``: each file's data lines cut into parts of at most ``part_lines``
    (0: :func:`part_size`'s), in input order. Local."""
    part_lines = part_size(files, part_lines)
    return [(k, lo, min(lo + part_lines, fi.lines)) for k, fi in enumerate(files)
            for lo in range(0, fi.lines, part_lines)]
