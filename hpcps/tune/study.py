"""``hpcps tune``: an Optuna study over ``[tune.space]`` whose trials are ``hpcps train`` jobs.

The study lives in ``tune.study``'s ``journal.log`` (Optuna's journal file storage: appends under a
file lock, so several processes, e.g. the tasks of a Slurm job array on a shared filesystem, search
one study, and a search started again goes on with it). TPE proposes each trial's values; the
median pruner ends a trial whose n-th evaluation (from the third on) falls below the median of the
earlier trials' n-th. With ``tune.folds`` a trial is cross-validated (:mod:`hpcps.tune.folds`).
A search stops once the study holds ``tune.trials`` finished (complete or pruned)
trials. A trial left RUNNING by a killed search (neither a heartbeat nor its start for :data:`STALE_S`, or its process
gone from this host) is marked failed and its values are tried again first. After each search the
study's trials table, best config and plot are written again (:mod:`hpcps.tune.report`). A new
study's first trial is the config's own values (:func:`own_values`). Local:
one process, which launches each trial as an MPI job of its own.
"""

import functools
import json
import logging
import os
import socket
import time
from pathlib import Path

from ..config import config_keys, load_config
from ..config.rules import BEST_METRICS
from .report import write_outputs
from ..config.space import as_set, parse_space, suggest
from .folds import write_folds
from .trial import Pruned, TrialRun, launcher_argv

__all__ = ["run_tune", "metric_of", "open_study", "own_values"]

logger = logging.getLogger(__name__)

STALE_S = 300.0               # a RUNNING trial silent this long belongs to a search that died
STUDY = "hpcps"


def metric_of(cfg) -> tuple[str, bool]:
    """``(metric, maximise)``: ``tune.metric``, else AUC for CTR data and RMSE for ratings. Local."""
    name = cfg.tune.metric or ("rmse" if cfg.data.format == "ratings" else "auc")
    return name, BEST_METRICS[name][1]


def _optuna():
    try:
        import optuna
    except ImportError:
        raise ValueError("hpcps tune needs Optuna: pip install optuna (or the project's extra: "
                         "pip install -e '.[tune]')") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def open_study(folder: Path, maximise: bool, pruning: bool = True):
    """The study in ``folder/journal.log`` (made if new). Local."""
    optuna = _optuna()
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend
    folder.mkdir(parents=True, exist_ok=True)
    storage = JournalStorage(JournalFileBackend(str(folder / "journal.log")))
    # no trial is judged on its first two evaluations (on a small file the first epochs' AUC says little)
    pruner = optuna.pruners.MedianPruner(n_startup_trials=5, n_warmup_steps=2) if pruning else optuna.pruners.NopPruner()
    return optuna.create_study(study_name=STUDY, storage=storage, load_if_exists=True, pruner=pruner,
                               direction="maximize" if maximise else "minimize")


def _alive_here(trial) -> bool:
    """Whether the search process that runs ``trial`` is alive on this host (False: another host's, unknown)."""
    if trial.user_attrs.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(trial.user_attrs.get("pid", 0)), 0)
        return True
    except (OSError, ValueError):
        return False


def recover_stale(study) -> int:
    """Mark the RUNNING trials of dead searches failed and queue their values again; returns how many."""
    from optuna.trial import TrialState
    now, n = time.time(), 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        here = t.user_attrs.get("host") == socket.gethostname()
        # a trial just taken has no host, pid or heartbeat yet: its start is its last sign of life
        started = t.datetime_start.timestamp() if t.datetime_start else 0.0
        silent = now - max(float(t.user_attrs.get("alive", 0)), started) > STALE_S
        if (here and not _alive_here(t)) or (not here and silent):
            study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            study.enqueue_trial(t.params, user_attrs={"retry_of": t.number}, skip_if_exists=False)
            logger.warning("hpcps: tune: trial %d was left running by a search that ended (pid %s on %s): "
                           "marked failed, its values queued again", t.number, t.user_attrs.get("pid"),
                           t.user_attrs.get("host"))
            n += 1
    return n


def own_values(cfg, dims) -> dict:
    """The config's own value of each key of the space that the space holds (a search starts from
    the config as it is: the tuned config is then no worse on the eval split). Local."""
    out = {}
    for d in dims:
        value = functools.reduce(getattr, d.key.split("."), cfg)
        if d.choices:
            value = json.dumps(value) if isinstance(value, list) else value
            if value in d.choices:
                out[d.key] = value
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and d.low <= value <= d.high:
            out[d.key] = value
    return out


def _run_trial(trial, cfg, config_path, sets: list, folder: Path, metric: str, argv0, folds) -> tuple[float, dict]:
    """``(value, final line)`` of one trial: one ``hpcps train``, or with ``folds`` one per fold
    (the value: the mean over them). The first (or only) run's evaluations are reported to Optuna as
    they come and may prune it (:class:`Pruned`). Local."""
    prune = trial.should_prune if cfg.tune.pruning else None

    def alive():
        trial.set_user_attr("alive", time.time())
    if not folds:
        final = TrialRun(folder, config_path, sets, metric, argv0).run(report=trial.report, prune=prune, alive=alive)
        return float(final[metric]), final
    finals = []
    for i, (train, held) in enumerate(folds):
        run = TrialRun(folder / f"fold-{i}", config_path, [*sets, f"data.path={train}", f"data.eval_path={held}", "tune.folds=0"],
                       metric, argv0)
        finals.append(run.run(report=trial.report if i == 0 else None, prune=prune if i == 0 else None, alive=alive))
    trial.set_user_attr("folds", [round(float(f[metric]), 5) for f in finals])
    return sum(float(f[metric]) for f in finals) / len(finals), finals[0]


def _objective(cfg, config_path, sets, dims, folder: Path, metric: str, argv0, folds=None):
    optuna = _optuna()

    def objective(trial):
        trial.set_user_attr("host", socket.gethostname())
        trial.set_user_attr("pid", os.getpid())
        trial.set_user_attr("alive", time.time())
        values = suggest(trial, dims)
        logger.info("hpcps: tune: trial %d: %s", trial.number, " ".join(as_set(k, v) for k, v in values.items()))
        started = time.monotonic()
        try:
            value, final = _run_trial(trial, cfg, config_path, [*sets, *(as_set(k, v) for k, v in values.items())],
                                      folder / f"trial-{trial.number:04d}", metric, argv0, folds)
        except Pruned as e:
            trial.set_user_attr("seconds", round(time.monotonic() - started, 1))
            logger.info("hpcps: tune: trial %d pruned after step %d", trial.number, e.step)
            raise optuna.TrialPruned() from None
        trial.set_user_attr("seconds", round(time.monotonic() - started, 1))
        trial.set_user_attr("steps", final.get("steps"))
        trial.set_user_attr("best_step", (final.get("best") or {}).get("step"))
        logger.info("hpcps: tune: trial %d: %s %.5f%s (%d steps, %.0f s)", trial.number, metric, value,
                    f" (mean of {len(folds)} folds)" if folds else "", final.get("steps", 0), time.monotonic() - started)
        return value
    return objective


def run_tune(config_path: str | None, sets: list[str], trials: int | None = None) -> dict:
    """Search ``config_path``'s ``[tune.space]`` (``sets``: ``--set`` overrides, for the search
    and every trial) until the study holds ``tune.trials`` (or ``trials``) finished trials; write
    the outputs; return the best trial. Every choice and range end is checked against the config
    before any trial runs. Local."""
    cfg = load_config(config_path, sets)
    dims = parse_space(cfg.tune.space, config_keys())
    if not dims:
        raise ValueError("config: tune.space is empty: name the keys to search, e.g. "
                         "[tune.space] \"optimizer.wide.lr\" = {low = 0.01, high = 1.0, log = true}")
    for d in dims:                                        # every value the search may take loads
        for v in d.values():
            load_config(config_path, [*sets, as_set(d.key, v)])
    metric, maximise = metric_of(cfg)
    budget = trials or cfg.tune.trials
    folder = Path(cfg.tune.study)
    argv0 = launcher_argv(cfg.tune.launcher, cfg.tune.ranks)
    folds = write_folds(cfg, folder) if cfg.tune.folds >= 2 else None
    optuna = _optuna()
    task = int(os.environ.get("SLURM_ARRAY_TASK_ID", "0") or 0)
    study = open_study(folder, maximise, pruning=cfg.tune.pruning)
    recover_stale(study)
    if not study.trials:                                  # the config's own values are tried first
        own = own_values(cfg, dims)
        if own:
            study.enqueue_trial(own, user_attrs={"config": True})
    from optuna.study import MaxTrialsCallback
    from optuna.trial import TrialState
    done = (TrialState.COMPLETE, TrialState.PRUNED)
    have = len(study.get_trials(deepcopy=False, states=done))
    # a search started again, or another task of a job array, samples its own values
    study.sampler = optuna.samplers.TPESampler(seed=cfg.job.seed + 1000 * task + len(study.trials), n_startup_trials=6)
    logger.info("hpcps: tune: study %s: %d of %d trials finished; %s (%s), %d keys", folder / "journal.log", have,
                budget, metric, "max" if maximise else "min", len(dims))
    if have < budget:
        study.optimize(_objective(cfg, config_path, sets, dims, folder, metric, argv0, folds),
                       callbacks=[MaxTrialsCallback(budget, states=done), _FailureGuard()], catch=(RuntimeError,))
    return write_outputs(study, cfg, config_path, sets, folder, metric, dims)


class _FailureGuard:
    """Stop the search after :attr:`LIMIT` trials in a row failed (a config no trial can run)."""

    LIMIT = 3

    def __init__(self):
        self.row = 0

    def __call__(self, study, trial) -> None:
        from optuna.trial import TrialState
        self.row = self.row + 1 if trial.state == TrialState.FAIL else 0
        if self.row >= self.LIMIT:
            logger.error("hpcps: tune: %d trials in a row failed: stopping (each trial's train.log says why)", self.row)
            study.stop()
