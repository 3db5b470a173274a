"""``hpcps tune``: its arguments and its run. Local; it launches each trial's MPI job itself."""

import json

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    """The ``tune`` subcommand's arguments. Local."""
    p = sub.add_parser("tune", help="a hyperparameter search over the config's [tune.space] (Optuna; each trial an "
                                    "hpcps train job; no MPI launch needed)",
                       description=("Searches the keys of the config's [tune.space] (a list of choices, or "
                                    "{low, high, log}) with Optuna's TPE, each trial an `hpcps train` MPI job "
                                    "(tune.ranks ranks, launched with tune.launcher) pruned on its evaluations as "
                                    "they arrive, until the study holds tune.trials finished trials. The study "
                                    "is tune.study/journal.log: run the same command again (after a kill, or from "
                                    "several Slurm jobs at once: slurm/tune.sbatch) and it goes on. Writes "
                                    "trials.md, best.toml (hpcps train --config best.toml trains the best) and "
                                    "tune.png there, and prints one JSON line {\"tune\": {...}}. Needs optuna "
                                    "(pip install -e '.[tune]')."))
    p.add_argument("--config", metavar="FILE.toml", help="config file with a [tune.space] table")
    p.add_argument("--set", metavar="KEY=VALUE", nargs="+", action="extend", default=[],
                   help="as for train; applies to the search and every trial")
    p.add_argument("--trials", type=int, default=0, help="finished trials to stop at (default tune.trials)")


def run(args) -> int:
    """Run the search of ``args``; print its summary. Local."""
    from .study import run_tune
    if args.trials < 0:
        raise ValueError(f"--trials {args.trials}: must be >= 1 (0: tune.trials)")
    print(json.dumps({"tune": run_tune(args.config, args.set, args.trials or None)}))
    return 0
