"""``hpcps tune``: a hyperparameter search over ``[tune.space]`` with Optuna, each trial an
``hpcps train`` MPI job (:mod:`hpcps.tune.study`)."""

from .report import toml_text, write_outputs
from ..config.space import Dim, as_set, parse_space, suggest
from .study import metric_of, open_study, run_tune
from .trial import TrialRun, launcher_argv

__all__ = ["run_tune", "open_study", "metric_of", "parse_space", "as_set", "suggest", "Dim", "TrialRun",
           "launcher_argv", "toml_text", "write_outputs"]
