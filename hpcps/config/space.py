"""``[tune.space]``: which config keys ``hpcps tune`` varies and over what. Local, pure (imports
no Optuna: the config's validation uses it).

    [tune.space]
    "optimizer.wide.lr" = {low = 0.01, high = 1.0, log = true}    # a float, on a log scale
    "job.early_stop_patience" = {low = 1, high = 4}              # integers when both ends are
    "model.kind" = ["lr", "wide_deep"]                           # one of these choices
    "model.top_mlp" = [[32], [64, 32]]                           # a choice may be a list

A key is any ``hpcps train`` key outside ``[tune]``; each trial runs ``hpcps train`` with the
config and ``--set key=value`` for every key of the space.
"""

import json
import math
from dataclasses import dataclass

__all__ = ["Dim", "parse_space", "as_set", "suggest"]

RANGE_FIELDS = {"low", "high", "log", "step"}


@dataclass(frozen=True)
class Dim:
    """One key of the space: ``choices`` (a list), or a range ``low``..``high`` (``integer`` when
    both ends are integers; ``log`` scale; ``step`` between values, 0: any)."""
    key: str
    choices: tuple = ()
    low: float = 0.0
    high: float = 0.0
    log: bool = False
    step: float = 0.0
    integer: bool = False

    def values(self) -> list:
        """Values that bound the space (each choice; a range's ends), to check against the config."""
        return list(self.choices) if self.choices else [self.low, self.high]


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def parse_space(space: dict, keys) -> list[Dim]:
    """``[tune.space]`` as :class:`Dim` s, in the table's order; ``ValueError`` naming the first
    bad entry (an unknown key, a key of ``[tune]``, an empty choice list, a range whose ends are
    not numbers or not in order, a log range that reaches 0). Local."""
    dims = []
    for key, spec in space.items():
        where = f"config: tune.space {key!r}"
        if key not in keys or key.startswith("tune."):
            raise ValueError(f"{where}: not a key hpcps train takes (a key such as 'optimizer.wide.lr')")
        if isinstance(spec, list):
            if not spec:
                raise ValueError(f"{where}: an empty list of choices")
            dims.append(Dim(key, choices=tuple(json.dumps(c) if isinstance(c, list) else c for c in spec)))
            continue
        if not isinstance(spec, dict) or not {"low", "high"} <= set(spec) or set(spec) - RANGE_FIELDS:
            raise ValueError(f"{where}: expected a list of choices or {{low = ..., high = ..., log = true|false}}, "
                             f"got {spec!r}")
        low, high, log, step = spec["low"], spec["high"], spec.get("log", False), spec.get("step", 0)
        if not (_number(low) and _number(high) and low < high):
            raise ValueError(f"{where}: low and high must be numbers with low < high, got {low!r}, {high!r}")
        if not isinstance(log, bool) or (log and low <= 0):
            raise ValueError(f"{where}: log must be true or false, and a log range needs low > 0")
        if not (_number(step) and step >= 0) or (log and step):
            raise ValueError(f"{where}: step must be a number >= 0 (and none on a log scale)")
        integer = all(isinstance(x, int) for x in (low, high)) and float(step).is_integer()
        dims.append(Dim(key, low=low, high=high, log=log, step=step, integer=integer))
    return dims


def as_set(key: str, value) -> str:
    """The ``--set`` text of ``key = value`` (a list choice is kept as JSON text). Local."""
    if isinstance(value, str) and value.startswith("["):
        value = ",".join(str(x) for x in json.loads(value))
    elif isinstance(value, bool):
        value = str(value).lower()
    return f"{key}={value}"


def suggest(trial, dims: list[Dim]) -> dict:
    """Each dimension's value for an Optuna ``trial`` (TPE samples them): ``{key: value}``. Local."""
    out = {}
    for d in dims:
        if d.choices:
            out[d.key] = trial.suggest_categorical(d.key, list(d.choices))
        elif d.integer:
            out[d.key] = trial.suggest_int(d.key, int(d.low), int(d.high), step=int(d.step or 1), log=d.log)
        else:
            out[d.key] = trial.suggest_float(d.key, d.low, d.high, step=d.step or None, log=d.log)
    return out
