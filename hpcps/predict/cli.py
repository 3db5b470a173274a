"""The ``hpcps predict`` and ``hpcps evaluate`` commands: their arguments, the checks made before any
communication, and the jobs. Called from :mod:`hpcps.cli`."""

import argparse
import json
import sys
from pathlib import Path

__all__ = ["add_parsers", "prepare", "run"]

CHECKPOINT_HELP = ("a checkpoint, a directory (its newest verified one), DIR/best (its best evaluation's: "
                   "checkpoint.keep_best) or best (that of the config's checkpoint.dir)")


def add_parsers(sub) -> None:
    """Add ``predict`` and ``evaluate`` to the ``hpcps`` subparsers. Local."""
    p = sub.add_parser("predict", help="score files with a checkpoint, as an MPI job (one row per input line)",
                       description=(
                           "Score input files with a trained checkpoint. The PS ranks load their shards (any "
                           "number of PS and workers, as a restart); the workers read the input with "
                           "training's readers (files, globs, directories, .gz/.bz2; a label column is "
                           "optional) and write one row per sample in input order: line (the data line in "
                           "the whole input, 0-based), data.id's column where the input has it, label where "
                           "present, probability (CTR) or rating (a ratings model: lines 'user item [rating]'). "
                           "--out NAME.csv or NAME.parquet: one file; another name: a "
                           "directory of parts with index.json. A killed predict run again with the same "
                           "arguments writes only the missing parts. Rank 0 prints {\"predict\": {...}}."),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help=CHECKPOINT_HELP)
    p.add_argument("--data", required=True, help="input: a file, a directory, a glob or a comma-separated list")
    p.add_argument("--out", required=True, help="NAME.csv or NAME.parquet (one file), or a directory of parts")
    p.add_argument("--format", choices=("csv", "parquet"), default="", help="of a directory's parts (default csv)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument("--labels", choices=("auto", "yes", "no"), default="auto",
                   help="whether the lines hold the label column (auto: yes, unless a header lacks its name)")
    p.add_argument("--part-lines", type=int, default=0,
                   help="input lines per part (default 0: about 64 parts, 16384 to 1048576 lines each)")
    _common(p)
    e = sub.add_parser("evaluate", help="AUC, logloss, RMSE, MAE and calibration of checkpoints on labelled files "
                                        "(MPI job)",
                       description=(
                           "Metrics of one or more checkpoints on labelled input files, each loaded as "
                           "`hpcps predict` loads it: AUC, logloss, RMSE, MAE and calibration (mean predicted / "
                           "observed click rate) of a CTR model; RMSE, MAE and calibration (mean predicted / "
                           "mean rating) of a ratings model. A directory means every verified checkpoint in it: a table of "
                           "metrics per step. Without --data, each checkpoint is scored on the lines its training "
                           "held out (data.eval_path, or the last data.eval_fraction of data.path's lines): the "
                           "rows it never trained on. Rank 0 prints one JSON line {\"evaluate\": [...]}, then the "
                           "table."),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("--checkpoint", required=True, nargs="+", help=CHECKPOINT_HELP.replace(
        "a directory (its newest verified one)", "a directory (every verified one)"))
    e.add_argument("--data", default=None,
                   help="labelled input: a file, a directory, a glob or a comma-separated list (default: each "
                        "checkpoint's held-out split, as its training config says)")
    _common(e)


def _common(p) -> None:
    p.add_argument("--config", metavar="FILE.toml", default=None,
                   help="the training config (default: the checkpoint's own); its model must be the checkpoint's")
    p.add_argument("--set", metavar="KEY=VALUE", nargs="+", action="extend", default=[],
                   help="override settings, e.g. --set job.num_ps=2 data.skip_bad_lines=true")


def _checkpoints(args) -> list:
    """``evaluate``'s checkpoints: each spec's, a directory's every verified one. Local."""
    from ..checkpoint import store
    from .inputs import resolve_checkpoint
    out = []
    for spec in args.checkpoint:
        p = Path(spec)
        if p.is_dir() and not (p / store.MANIFEST).exists():
            checked = [(c, store.verify_chain(c)) for c in store.list_checkpoints(p)]
            found = [c for c, (ok, _) in checked if ok]
            if not found:
                raise ValueError(f"--checkpoint {spec}: no verified checkpoint in that directory")
            _warn([f"{c.name} does not verify ({why}): left out" for c, (ok, why) in checked if not ok])
            out += found
        else:
            out.append(resolve_checkpoint(spec, _ckpt_dir(args)))
    return out


def _ckpt_dir(args) -> str:
    from ..config import load_config
    return load_config(args.config, args.set).checkpoint.dir if args.config else ""


def _trained_on(cfg, path) -> bool:
    """Whether ``evaluate --data`` names files checkpoint ``path`` trained on (its metrics then
    include training lines). Local."""
    from ..checkpoint import store
    from ..core.inputs import expand_inputs
    trained = (store.read_manifest(path).get("config") or {}).get("data", {}).get("path")
    try:
        ours = {p.resolve() for p in expand_inputs(trained)} if trained else set()
    except ValueError:                                   # the training files are gone or moved
        return False
    return bool(ours & {p.resolve() for p in expand_inputs(cfg.data.path, "--data")})


def _warn(lines: list) -> None:
    """Rank 0 (the process, where MPI is not started): each of ``lines`` as a warning, before any
    communication. Local."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.COMM_WORLD.Get_rank() == 0:
        for line in lines:
            print(f"hpcps: warning: {line}", file=sys.stderr, flush=True)


def _pinned(paths: list, job):
    """Run ``job()`` with ``paths`` pinned by world rank 0 (:func:`hpcps.checkpoint.lock.pin`): a
    training job's pruning keeps them until the job ends. A checkpoint pruned before the pin took is
    a ``ValueError`` saying so. Collective over ``MPI.COMM_WORLD`` (as ``job``)."""
    from mpi4py import MPI

    from ..checkpoint import store
    from ..checkpoint.lock import pin, unpin
    pins = []
    try:
        if MPI.COMM_WORLD.Get_rank() == 0:
            pins = [pin(p.parent, p.name) for p in paths if store.list_checkpoints(p.parent)]
            gone = [p for p in paths if not (p / store.MANIFEST).exists()]
            if gone:
                raise ValueError(f"{gone[0]}: pruned by a training job while this one started: run it again")
        return job()
    finally:
        for p in set(pins):
            unpin(p)


def prepare(args):
    """Every check made before MPI communication (alike on every rank): ``(job, error)``, where
    ``job()`` runs the command collectively and returns what rank 0 prints. Local."""
    from .inputs import held_out, peek_columns, resolve_checkpoint, scoring_config
    from .output import Output
    try:
        if args.command == "predict":
            if args.part_lines < 0:
                raise ValueError(f"--part-lines {args.part_lines}: must be >= 1 (0: auto)")
            path = resolve_checkpoint(args.checkpoint, _ckpt_dir(args))
            cfg = scoring_config(path, args.config, args.data, args.set)
            peek_columns(cfg, path, args.labels)
            out = Output(args.out, args.format, args.overwrite)
            from ..core.inputs import expand_inputs
            out.check(path, expand_inputs(cfg.data.path, "--data"))
            from .job import predict
            return (lambda: _pinned([path], lambda: {"predict": predict(cfg, path, out, args.labels, args.part_lines)})), None
        paths = _checkpoints(args)
        data = [(args.data, 0.0) if args.data else held_out(p) for p in paths]
        cfgs = [scoring_config(p, args.config, d, args.set) for p, (d, _) in zip(paths, data)]
        for c, p in zip(cfgs, paths):
            peek_columns(c, p, "yes")
        seen = [p.name for c, p in zip(cfgs, paths) if args.data and _trained_on(c, p)]
        _warn([f"--data holds lines that {', '.join(seen)} trained on: the metrics are optimistic (without "
               "--data, evaluate scores each checkpoint's held-out split)"] if seen else [])
        from .evaluate import evaluate_checkpoint
        return (lambda: _pinned(paths, lambda: {"evaluate": [evaluate_checkpoint(c, p, tail=t)
                                                             for c, p, (_, t) in zip(cfgs, paths, data)]})), None
    except (ValueError, OSError) as e:
        return None, e


def run(result: dict) -> None:
    """Rank 0: print the command's JSON line (and ``evaluate``'s table). Local."""
    print(json.dumps(result), flush=True)
    if "evaluate" in result:
        names = [k for k in ("auc", "logloss", "rmse", "mae", "calibration") if k in result["evaluate"][0]]
        print(f"| step | {' | '.join(names)} | samples | checkpoint |\n|{' --- |' * (len(names) + 3)}")
        for r in result["evaluate"]:
            cells = ' | '.join('-' if r[k] is None else f'{r[k]:.5f}' for k in names)
            print(f"| {r['step']} | {cells} | {r['samples']} | {r['checkpoint']} |")
            for k, why in r.get("undefined", {}).items():
                print(f"hpcps: warning: step {r['step']}: {k} is undefined ({why})", file=sys.stderr, flush=True)
