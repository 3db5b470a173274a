"""What a search leaves in ``tune.study``: ``trials.md`` (a table of every trial), ``best.toml``
(the config with the best trial's values: ``hpcps train --config best.toml`` trains it) and
``tune.png`` (each trial's value and the best so far). Local."""

import json
import math
from pathlib import Path

from ..config import AUTO_EPOCHS, load_config

__all__ = ["write_outputs", "toml_text"]


def _value(x) -> str:
    if isinstance(x, bool):
        return "true" if x else "false"
    if isinstance(x, (int, float)):
        return repr(x)
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in x) + "]"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_value(v)}" for k, v in x.items()) + "}"
    return json.dumps(str(x))                     # a TOML basic string


def toml_text(cfg, header: str = "") -> str:
    """Every setting of ``cfg`` but ``[tune]`` as TOML that ``load_config`` reads back to the same
    config. Local."""
    lines = [f"# {line}" for line in header.splitlines()]

    def section(name, d):
        scalars = {k: v for k, v in d.items() if not isinstance(v, dict)}
        if scalars:
            lines.extend(["", f"[{name}]"])
            for k, v in scalars.items():
                if name == "job" and k == "epochs" and v == AUTO_EPOCHS:
                    v = "auto"
                lines.append(f"{k} = {_value(v)}")
        for k, v in d.items():
            if isinstance(v, dict):
                section(f"{name}.{k}", v)

    for name, d in cfg.to_dict().items():
        if name != "tune":
            section(name, d)
    return "\n".join(lines) + "\n"


def _rows(study, metric: str) -> list[str]:
    out = [f"| trial | state | {metric} | steps (best at) | seconds | values |", "| --- | --- | --- | --- | --- | --- |"]
    for t in study.get_trials(deepcopy=False):
        value = "" if t.value is None else f"{t.value:.5f}"
        if t.state.name == "PRUNED" and t.intermediate_values:
            step = max(t.intermediate_values)
            value = f"({t.intermediate_values[step]:.5f} at step {step})"
        steps = t.user_attrs.get("steps")
        at = f"{steps} ({t.user_attrs.get('best_step')})" if steps is not None else ""
        params = " ".join(f"{k}={v}" for k, v in t.params.items())
        name = f"{t.number} (the config's values)" if t.user_attrs.get("config") else str(t.number)
        out.append(f"| {name} | {t.state.name.lower()} | {value} | {at} | {t.user_attrs.get('seconds', '')} | {params} |")
    return out


def _plot(study, path: Path, metric: str, maximise: bool) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    done = [t for t in study.get_trials(deepcopy=False) if t.value is not None]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    if done:
        xs, ys = [t.number for t in done], [t.value for t in done]
        best, run = [], -math.inf if maximise else math.inf
        for y in ys:
            run = max(run, y) if maximise else min(run, y)
            best.append(run)
        ax.plot(xs, ys, "o", label="trial")
        ax.step(xs, best, where="post", label="best so far")
        ax.legend()
    pruned = [t for t in study.get_trials(deepcopy=False) if t.state.name == "PRUNED" and t.intermediate_values]
    if pruned:
        ax.plot([t.number for t in pruned], [t.intermediate_values[max(t.intermediate_values)] for t in pruned], "x",
                color="grey", label="pruned (last evaluation)")
        ax.legend()
    ax.set_xlabel("trial")
    ax.set_ylabel(f"eval {metric}")
    ax.set_title("hpcps tune")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(study, cfg, config_path, sets, folder: Path, metric: str, dims) -> dict:
    """Write the study's outputs into ``folder``; returns ``{"trials", "complete", "pruned", "failed",
    "best": {"trial", metric, "values"}, "best_config", "table", "plot"}``. Local."""
    states = [t.state.name for t in study.get_trials(deepcopy=False)]
    maximise = study.direction.name == "MAXIMIZE"
    table, plot = folder / "trials.md", folder / "tune.png"
    table.write_text("\n".join(_rows(study, metric)) + "\n")
    _plot(study, plot, metric, maximise)
    out = {"study": str(folder / "journal.log"), "trials": len(states), "complete": states.count("COMPLETE"),
           "pruned": states.count("PRUNED"), "failed": states.count("FAIL"), "metric": metric,
           "table": str(table), "plot": str(plot)}
    if out["complete"]:
        best = study.best_trial
        from ..config.space import as_set
        chosen = [as_set(d.key, best.params[d.key]) for d in dims if d.key in best.params]
        tuned = load_config(config_path, [*sets, *chosen])
        path = folder / "best.toml"
        path.write_text(toml_text(tuned, f"hpcps tune: trial {best.number} of {len(states)}, eval {metric} "
                                         f"{best.value:.5f}\nfrom {config_path or 'the defaults'} with "
                                         f"{' '.join([*sets, *chosen])}"))
        out.update(best={"trial": best.number, metric: best.value, "values": best.params}, best_config=str(path))
    return out
