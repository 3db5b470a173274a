"""The evaluations during a run: the best so far, early stopping, the best checkpoint and the
export of the best weights. Worker side; resumed from a checkpoint's manifest."""

import logging
from pathlib import Path

import numpy as np

from ..checkpoint import store, tools
from ..config import AUTO_EPOCHS
from ..config.rules import BEST_METRICS

__all__ = ["Evaluations", "default_metric", "stopped_early", "save_arrays"]

logger = logging.getLogger(__name__)

AUTO_PATIENCE = 2       # job.epochs = "auto" with job.early_stop_patience = 0: stop after 2 evaluations without a better one


def default_metric(task: str) -> str:
    """The metric that decides "best" when ``checkpoint.keep_best`` names none. Local."""
    return "auc" if task == "ctr" else "rmse"


def save_arrays(path: str, arrays: dict) -> None:
    """``arrays`` to the .npz ``path``, its directory made if missing (``job.export``). Local."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **arrays)


def stopped_early(manifest: dict) -> bool:
    """Whether the checkpoint is an early-stopped run's last: resuming from it trains no more. Local."""
    return bool(manifest.get("evaluations", {}).get("stopped_early"))


class Evaluations:
    """What the evaluations of the run said: the best result (``metric``: ``checkpoint.keep_best``
    or the task's default), how many since, whether to stop early (``job.early_stop_patience``
    evaluations without improvement). Worker 0 judges; :meth:`observe` shares its verdict and
    state (every worker's ``state()`` is worker 0's: each host's node-local checkpoint has it).
    ``state()`` goes into each checkpoint's manifest, so a resumed run judges as if never stopped."""

    def __init__(self, cfg, task: str, comm, lead: bool, ckpt=None, manifest: dict | None = None):
        self.metric = cfg.checkpoint.keep_best or default_metric(task)
        self.maximise = BEST_METRICS[self.metric][1]
        self.keep = bool(cfg.checkpoint.keep_best) and ckpt is not None
        self.patience = cfg.job.early_stop_patience or (AUTO_PATIENCE if cfg.job.epochs == AUTO_EPOCHS else 0)
        self.comm, self.lead, self.ckpt = comm, lead, ckpt
        state = (manifest or {}).get("evaluations", {})
        self.best, self.since, self.count = state.get("best"), state.get("since", 0), state.get("count", 0)
        self.stopped_early = bool(state.get("stopped_early"))   # resumed from an early stop: still stopped
        self.last_step = None          # the step of this run's last evaluation

    def _better(self, value: float) -> bool:
        if self.best is None:
            return np.isfinite(value)
        return value > self.best["value"] if self.maximise else value < self.best["value"]

    def observe(self, step: int, results: dict, final: bool = False) -> tuple[bool, bool]:
        """The evaluation after ``step`` steps (``results`` on worker 0, ``{}`` elsewhere):
        ``(improved, stop early)``, the same on every worker; ``final``: the one at the end, which
        stops nothing (and is not counted again when the last evaluation was at this step).
        Collective over the worker communicator."""
        if final and step == self.last_step:
            return False, False
        self.last_step = step
        verdict = None
        if self.lead:
            value = float(results.get(self.metric, np.nan))     # nan: no eval samples, never the best
            improved = self._better(value)
            if improved:
                self.best, self.since = {"step": step, "value": value, "results": results}, 0
            else:
                self.since += 1
            self.count += 1
            stop = bool(self.patience) and self.since >= self.patience and not final
            if stop:
                logger.info("hpcps: early stop after step %d: %d evaluations without a better %s than %.5g "
                               "(step %d)", step, self.since, self.metric, self.best["value"], self.best["step"])
            verdict = (improved, stop, self.best, self.since, self.count)
        improved, stop, self.best, self.since, self.count = self.comm.bcast(verdict, root=0)
        self.stopped_early = self.stopped_early or stop     # every worker keeps the state a manifest holds
        return improved, stop

    def state(self) -> dict:
        """What a checkpoint's manifest keeps (worker 0). Local."""
        return {"metric": self.metric, "best": self.best, "since": self.since, "count": self.count,
                "stopped_early": self.stopped_early}

    def mark(self, step: int) -> None:
        """Worker 0, once the checkpoint at ``step`` is committed: it is the best (``checkpoint.keep_best``). Local."""
        if self.lead and self.keep:
            info = {"metric": self.metric, "value": self.best["value"], "results": self.best["results"]}
            store.mark_best(self.ckpt.root, step, info, self.ckpt.file_mode)

    def summary(self) -> dict:
        """The final line's ``best`` (worker 0): its step and results, or ``{}`` before any evaluation. Local."""
        if self.best is None:
            return {}
        return {"step": self.best["step"], "metric": self.metric, **self.best["results"]}

    def export_best(self, path: str) -> str:
        """Worker 0: the best checkpoint's weights to ``path`` (.npz, as ``job.export``); returns its name. Local."""
        best = store.read_best(self.ckpt.root)
        if best is None:
            raise ValueError(f"job.export_best: no best checkpoint in {self.ckpt.root} (no evaluation finished?)")
        save_arrays(path, tools.weights(best["path"]))
        return best["checkpoint"]
