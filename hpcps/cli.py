"""The ``hpcps`` command. ``hpcps demo`` runs under mpiexec; see ``hpcps --help``."""

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from ._version import __version__
from .core.errors import HpcpsError

__all__ = ["main"]

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
BENCHES = ("e2e", "sparse_grid", "scaling", "checkpoint", "dtype", "hosts", "data", "deterministic", "mpis",
           "quality", "predict", "monitor", "scale", "host_loss", "plan", "peers", "failover")   # bench_sparse.py runs under mpiexec itself


def _setup_logging(level: str, mpi: bool = True) -> None:
    """hpcps's own messages from ``level`` (default info: the routine ones, such as the layout and
    what a restart resumed from, as INFO; what needs a look as WARNING); other libraries' from
    WARNING. ``mpi``: the lines name the rank (a command without MPI starts none). Local."""
    tag = ""
    if mpi:
        from mpi4py import MPI
        tag = f"[rank {MPI.COMM_WORLD.Get_rank()}] "
    logging.basicConfig(level=logging.WARNING, format=f"{tag}%(asctime)s %(name)s %(levelname)s: %(message)s")
    logging.getLogger("hpcps").setLevel(level.upper())


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpcps", description=(
        "Parameter server for sparse embedding tables over one-sided MPI RMA. "
        "Run under an MPI launcher, e.g. `mpiexec -n 4 python -m mpi4py -m hpcps train --config examples/ctr.toml` "
        "(-m mpi4py: an uncaught exception on one rank ends the whole job)."))
    p.add_argument("--version", action="version", version=f"hpcps {__version__}")
    p.add_argument("--log-level", default="info",
                   help="hpcps's logging level: info (default: routine messages too), warning, error, debug")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="pull and push random rows against the PS ranks and verify every update",
                       description=("Workers pull and push random embedding rows against the PS ranks "
                                    "for --steps steps, then check that no update was lost. Rank 0 prints "
                                    "one JSON line {\"demo\": {...}}; exit code 1 if the check fails."))
    d.add_argument("--rows", type=int, default=1_000_000, help="table rows (default 1000000)")
    d.add_argument("--dim", type=int, default=64, help="embedding dimension (default 64)")
    d.add_argument("--batch", type=int, default=4096, help="ids per pull/push (default 4096)")
    d.add_argument("--steps", type=int, default=200, help="pull+push rounds per worker (default 200)")
    d.add_argument("--num-ps", type=int, default=None, help="PS ranks (default $HPCPS_NUM_PS or 1)")
    d.add_argument("--transport", choices=("auto", "rma"), default=None,
                   help="auto: shared memory on the same node, RMA across nodes; rma: RMA everywhere "
                        "(default $HPCPS_TRANSPORT or auto)")
    d.add_argument("--zipf", type=float, default=1.2,
                   help="Zipf exponent of the ids (> 1), or 0 for uniform ids (default 1.2)")
    d.add_argument("--seed", type=int, default=0)
    t = sub.add_parser("train", help="train a model (synthetic CTR, Criteo, CSV or ratings) on the PS ranks and workers",
                       description=("Train the model a TOML config describes. Settings merge as file < "
                                    "HPCPS_* environment < --set. Rank 0 prints one JSON line "
                                    "{\"final\": {...}} with the eval metrics and throughput."),
                       epilog=_keys_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("--config", metavar="FILE.toml", help="config file (default: built-in defaults)")
    t.add_argument("--set", metavar="KEY=VALUE", nargs="+", action="extend", default=[],
                   help="override settings, dotted section.key, e.g. --set job.mode=async data.batch_size=512 "
                        "(may repeat)")
    bl = sub.add_parser("baseline", help="train the simple baseline on the same data and split (no MPI)",
                        description=("Train the simple baseline of a config's data on the same split as "
                                     "`hpcps train`: hashed logistic regression for CTR, user and item biases for "
                                     "ratings. Prints one JSON line {\"baseline\": {...}} with its eval metrics."))
    bl.add_argument("--config", metavar="FILE.toml", help="config file (default: built-in defaults)")
    bl.add_argument("--set", metavar="KEY=VALUE", nargs="+", action="extend", default=[],
                    help="override settings, as for train")
    bl.add_argument("--c", type=float, default=0.1, help="CTR: inverse L2 strength, as scikit-learn's C (default 0.1)")
    rp = sub.add_parser("report", help="PNG plots and a markdown summary from metrics and benchmark results",
                        description=("SRC: a metrics JSONL file (metrics.path of `hpcps train`) or a results "
                                     "directory (its *.jsonl metrics and bench_*.json results). Writes loss.png, "
                                     "throughput.png, time_breakdown.png, staleness.png, load_balance.png, "
                                     "checkpoints.png, hosts.png and ps_busy.png (the monitor's records) and "
                                     "summary.md (with the alerts). No MPI launch needed."))
    rp.add_argument("src", help="metrics file or results directory")
    rp.add_argument("--out", default="report", help="output directory (default report/)")
    b = sub.add_parser("bench", help="run one of the benchmarks (scripts/bench_NAME.py); it launches mpiexec itself",
                       description=("Runs scripts/bench_NAME.py of this checkout with this python and the "
                                    "arguments after NAME (`hpcps bench e2e --help` shows them). Each measures "
                                    "its baselines in the same run, prints ratios and writes JSON under "
                                    "results/. No MPI launch needed (bench_sparse.py, which sparse_grid "
                                    "launches per point, is the one to start under mpiexec yourself)."))
    b.add_argument("name", choices=BENCHES, help="which benchmark")
    b.add_argument("args", nargs=argparse.REMAINDER, help="passed to the script")
    from .predict.cli import add_parsers
    add_parsers(sub)
    from .plan.cli import add_parser as add_plan
    add_plan(sub)
    from .tune.cli import add_parser as add_tune
    add_tune(sub)
    k = sub.add_parser("ckpt", help="list, verify, inspect and export checkpoints (no MPI launch needed)")
    ks = k.add_subparsers(dest="ckpt_command", required=True)
    kl = ks.add_parser("ls", help="checkpoints in a directory, newest last, with their state; then this host's "
                                  "node-local level (checkpoint.local_dir)")
    kl.add_argument("dir")
    kl.add_argument("--local-dir", default=None,
                    help="this host's node-local checkpoint directory (default: checkpoint.local_dir of the "
                         "newest checkpoint's config)")
    v = ks.add_parser("verify", help="check sizes and SHA-256 of one checkpoint or of every one in a directory")
    v.add_argument("path")
    v.add_argument("--deep", action="store_true",
                   help="also read every array: non-finite values or |values| over --max-abs fail (a checksum "
                        "cannot tell a file forged with its own checksum)")
    v.add_argument("--max-abs", type=float, default=1e6, help="largest |value| --deep accepts (default 1e6)")
    ks.add_parser("inspect", help="step, ranks, tables, shapes and sizes of a checkpoint").add_argument("path")
    e = ks.add_parser("export", help="one file with every table in global-id order (a dynamic table: its ids "
                                     "and rows, by id) and the dense tensors; or a model to serve",
                      description="PATH: one checkpoint, a checkpoint directory meaning its newest verified one, or DIR/best.")
    e.add_argument("path")
    e.add_argument("--out", required=True, help="output file (--format serving: a new directory)")
    e.add_argument("--overwrite", action="store_true", help="replace an existing output file (never a directory)")
    e.add_argument("--format", choices=("h5", "torch", "torchscript", "serving"), default="h5",
                   help="h5: tables/<name>/weights (and a dynamic table's tables/<name>/ids) and dense/<name> "
                        "(h5py reads it alone); "
                        "torch: a plain state_dict for torch.load; torchscript: the model as one TorchScript "
                        "module that torch alone runs on raw columns, model(dense, categorical) -> "
                        "probabilities (csv and criteo jobs; hpcps.predict.torchscript); serving: for tables too "
                        "large for one process, a directory of dense.pt (TorchScript: model.ids(categorical), "
                        "model(dense, rows)) and tables.h5 (each table's sorted ids and rows), served with torch, "
                        "numpy and h5py as examples/serve.py does (default h5)")
    return p


def _keys_help() -> str:
    """Every config key with its default, a line per section (``hpcps train --help``)."""
    import textwrap
    from .config import Config, config_keys
    lines, cfg = {}, Config()
    for key in config_keys():
        section, _, name = key.rpartition(".")
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        lines.setdefault(section, []).append(f"{name}={value!r}")
    out = ["config keys (section.key=default; environment HPCPS_SECTION_KEY; see README, Configuration):"]
    for section, items in lines.items():
        out.append(textwrap.fill(" ".join(items), width=100, initial_indent=f"  {section}: ",
                                 subsequent_indent=" " * (len(section) + 4)))
    return "\n".join(out)


def _config(args):
    """``(config, error)``: ``hpcps train``'s config (file < environment < --set), or the defaults
    with the environment for other commands (for ``job.mpi_threads`` and ``job.malloc_tune``); on
    a bad setting the defaults and the ``ValueError``, reported once MPI runs. Local."""
    from .config import Config, load_config
    try:
        if args.command == "train":
            return load_config(args.config, args.set), None
        return load_config(None, ()), None
    except ValueError as e:
        return Config(), e if args.command == "train" else None


def _abort(e: Exception) -> None:
    """Report an error raised on this rank while the job runs (other ranks may wait for this one in
    MPI: they would never notice), naming the rank, and end the whole job: ``MPI_Abort``, exit 2."""
    import time

    from mpi4py import MPI

    from .runtime.topology import ABORT_GRACE_S
    world = MPI.COMM_WORLD
    sys.stderr.write(f"hpcps: error on world rank {world.Get_rank()} of {world.Get_size()}: {e}\n"
                     f"hpcps: ending the whole job\n")
    sys.stderr.flush()
    time.sleep(ABORT_GRACE_S)            # the launcher forwards the message before the abort kills us
    world.Abort(2)
    os._exit(2)                          # MPI_Abort ends the process; never carry on past it


def _run_collective(fn, *args):
    """``fn(*args)`` (collective over the world); ``(result, None)``, or ``(None, error)`` for a
    ``ValueError`` raised alike on every rank before any context existed. An error raised while a
    context is open (on this rank alone, perhaps) ends the whole job (:func:`_abort`)."""
    from .runtime.context import open_contexts
    try:
        return fn(*args), None
    except (ValueError, OSError, HpcpsError) as e:
        if open_contexts() or not isinstance(e, ValueError):
            _abort(e)
        return None, e


def _error(e: Exception) -> int:
    """Report an error raised alike on every rank (before any communication): one line, exit 2."""
    from mpi4py import MPI
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(f"hpcps: error: {e}", file=sys.stderr, flush=True)
    MPI.COMM_WORLD.Barrier()             # the message is out before any rank exits (or aborts)
    return 2


def _check_export_out(args) -> None:
    """``ckpt export --out``: a file format's output may replace an existing file only with
    ``--overwrite``, never a directory (``serving`` checks its directory itself). Local."""
    out = Path(args.out)
    if args.format == "serving":
        return
    if out.is_dir():
        raise ValueError(f"--out {out}: a directory; --format {args.format} writes one file")
    if out.exists() and not args.overwrite:
        raise ValueError(f"--out {out}: exists (use --overwrite to replace it)")
    if not out.parent.is_dir():
        raise ValueError(f"--out {out}: the directory {out.parent} does not exist")


def _ckpt(args) -> int:
    """``hpcps ckpt ...``: local, no MPI."""
    from .checkpoint import tools
    if args.ckpt_command == "ls":
        return tools.ls(args.dir, args.local_dir)
    if args.ckpt_command == "verify":
        return tools.verify_cmd(args.path, args.deep, args.max_abs)
    if args.ckpt_command == "inspect":
        return tools.inspect(args.path)
    _check_export_out(args)
    if args.format == "torchscript":
        from .predict.torchscript import export_torchscript
        path = export_torchscript(tools.pick(args.path), args.out)
        print(f"wrote {path}: torch.jit.load(it)(dense, categorical) gives probabilities")
        return 0
    if args.format == "serving":
        from .predict.serving_export import export_serving
        path = export_serving(tools.pick(args.path), args.out)
        print(f"wrote {path}/dense.pt, tables.h5 and serving.json: examples/serve.py serves them")
        return 0
    return tools.export(args.path, args.out, args.format)


def _bench(args) -> int:
    script = SCRIPTS / f"bench_{args.name}.py"
    if not script.is_file():
        raise ValueError(f"{script} not found: `hpcps bench` runs the benchmark scripts of a source "
                         "checkout (install it with `pip install -e .` or use scripts/run setup)")
    import subprocess
    return subprocess.run([sys.executable, str(script), *args.args]).returncode


def _report(args) -> int:
    from .tools.report import write_report
    for path in write_report(args.src, args.out):
        print(path)
    return 0


def _baseline(args) -> int:
    from .tools.baseline import run_baseline
    from .config import load_config
    _setup_logging(args.log_level, mpi=False)            # its progress
    if not args.c > 0:
        raise ValueError(f"--c {args.c}: must be > 0")
    print(json.dumps({"baseline": run_baseline(load_config(args.config, args.set), args.c)}))
    return 0


def _plan_or_tune(args) -> int:
    from .config import load_config
    from .plan.cli import run as run_plan
    from .tune.cli import run as run_tune
    _setup_logging(args.log_level, mpi=False)
    return run_plan(args, load_config(args.config, args.set)) if args.command == "plan" else run_tune(args)


LOCAL = {"ckpt": _ckpt, "bench": _bench, "report": _report, "baseline": _baseline, "plan": _plan_or_tune,
         "tune": _plan_or_tune}        # the commands that run in one process, without MPI


def _demo(args, cfg) -> int:
    from mpi4py import MPI
    from .tools.demo import run_demo
    for name in ("rows", "dim", "batch", "steps"):
        if getattr(args, name) < 1:
            _parser().error(f"--{name} must be >= 1")
    if args.zipf != 0 and not args.zipf > 1:
        _parser().error(f"--zipf must be > 1, or 0 for uniform ids, got {args.zipf}")
    summary, e = _run_collective(run_demo, args.rows, args.dim, args.batch, args.steps, args.num_ps,
                                 args.transport, args.seed, args.zipf)
    if e is not None:
        return _error(e)
    ok = MPI.COMM_WORLD.allreduce(summary is None or summary["verified"], op=MPI.LAND)
    if summary is not None:
        print(json.dumps({"demo": summary}), flush=True)
    return 0 if ok else 1


def _score(args, cfg) -> int:
    from mpi4py import MPI
    from .predict import cli as predict_cli
    job, bad = predict_cli.prepare(args)
    if bad is not None:
        return _error(bad)
    result, e = _run_collective(job)
    if e is not None:
        return _error(e)
    if MPI.COMM_WORLD.Get_rank() == 0:
        predict_cli.run(result)
    return 0


def _train(args, cfg) -> int:
    from .runtime.stopping import EXIT_CHECKPOINTED, EXIT_STOPPED
    from .train import train
    final, e = _run_collective(train, cfg)
    if e is not None:
        return _error(e)
    from .train.failover import prints_summary
    if prints_summary():
        from .train.summary import human_summary
        # both on stdout, the JSON line last: one stream keeps their order (stderr, forwarded apart by the
        # launcher, could land inside the JSON line where a log joins the two)
        print(human_summary(final, cfg) + "\n" + json.dumps({"final": final}), flush=True)
    if final.get("stopped"):
        return EXIT_CHECKPOINTED if final.get("saved") else EXIT_STOPPED
    return 0


COLLECTIVE = {"demo": _demo, "predict": _score, "evaluate": _score, "train": _train}   # under mpiexec


def main(argv=None) -> int:
    """``hpcps``'s entry point: the local commands in this process; the others collective over
    ``MPI.COMM_WORLD`` (an error alike on every rank is one line, exit 2)."""
    args = _parser().parse_args(argv)
    if args.command in LOCAL:
        try:
            return LOCAL[args.command](args)
        except (ValueError, OSError) as e:
            print(f"hpcps: error: {e}", file=sys.stderr)
            return 2
    if args.command == "train":
        from .runtime import stopping
        stopping.install()              # before the slow imports: an early Slurm signal is kept
    cfg, bad = _config(args)
    from .core.process import prepare_process
    prepare_process(cfg.job.mpi_threads, cfg.job.malloc_tune)      # before MPI starts; may restart `train`
    _setup_logging(args.log_level)
    if bad is not None:
        return _error(bad)
    return COLLECTIVE[args.command](args, cfg) if args.command in COLLECTIVE else 2

if __name__ == "__main__":
    sys.exit(main())
