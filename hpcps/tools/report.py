"""``hpcps report``: PNG plots and a markdown summary from a training's metrics and the benchmarks.

Input: a metrics JSONL file (``metrics.path`` of ``hpcps train``), or a results directory,
whose ``*.jsonl`` metrics files and ``bench_*.json`` benchmark results are all read. Output,
in ``--out``: ``loss.png`` (loss and eval AUC against step and against time),
``throughput.png``, ``time_breakdown.png``, ``staleness.png``, ``load_balance.png`` (rows and
bytes per PS rank), ``checkpoints.png`` (stall and write time per checkpoint, when the job took
any), ``hosts.png`` and ``ps_busy.png`` (each host's CPU and memory and each PS's busy share over
time, from the monitor's records: ``metrics.every``) and ``summary.md`` (the final figures, the
alerts and the benchmark ratios). Headless (matplotlib's
Agg backend). Local; no MPI.
"""

import json
from pathlib import Path

from ..monitor.plots import monitor_lines, plot_monitor

__all__ = ["load_metrics", "write_report"]

PHASES = ("data", "idle", "pull", "forward_backward", "push", "dense_allreduce")


def load_metrics(path) -> list[dict]:
    """The runs of one metrics file, in order (a resumed job appends its run to the same file):
    ``[{"steps": [...], "checkpoints": [...], "final": {...} | None, "path", "offset"}]``, where
    ``offset`` is the run's start on a time axis that continues across runs; ``monitor`` and
    ``alerts`` hold the monitor's host records and alerts."""
    runs, cur = [], _new_run()
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{n}: not UTF-8 text (a metrics file is JSON lines; byte {e.start}: "
                                 f"{e.reason})") from None
            if not line:
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not a JSON line ({e})") from None
            if "start" in rec:                     # a run's first record: the one before it ended
                if cur["steps"] or cur["checkpoints"] or cur["monitor"]:
                    runs.append(cur)
                cur = {**_new_run(), "start": rec["start"]}
            elif "final" in rec:
                cur["final"] = rec["final"]
                runs.append(cur)
                cur = _new_run()
            elif "monitor" in rec:
                cur["monitor"].append(rec)
            elif "alert" in rec:
                cur["alerts"].append(rec)
            elif "checkpoint" in rec:
                cur["checkpoints"].append(rec)
            elif "step" in rec:
                if cur["steps"] and rec["step"] <= cur["steps"][-1]["step"]:   # a run that never finished
                    runs.append(cur)
                    cur = _new_run()
                cur["steps"].append(rec)
    if cur["steps"] or cur["checkpoints"]:
        runs.append(cur)
    offset = 0.0
    for i, r in enumerate(runs):
        r["path"], r["offset"] = str(path), offset
        r["name"] = Path(path).stem + (f" run {i + 1}" if len(runs) > 1 else "")
        r["killed"] = r["final"] is None                # no final line: killed (or still running)
        times = [s["time"] for s in r["steps"]] + [c["time"] for c in r["checkpoints"]]
        offset += max(times, default=0.0)
    return runs


def _new_run() -> dict:
    return {"steps": [], "checkpoints": [], "final": None, "monitor": [], "alerts": [], "start": None}


def _sources(src: Path):
    if src.is_file():
        return [src], []
    if not src.is_dir():
        raise ValueError(f"no such file or directory: {src}")
    metrics = sorted(p for p in src.glob("*.jsonl"))
    benches = sorted(p for p in src.glob("bench_*.json"))
    if not metrics and not benches:
        raise ValueError(f"{src} holds no *.jsonl metrics and no bench_*.json results")
    return metrics, benches


def write_report(src, out) -> list[Path]:
    """Write the plots and ``summary.md`` for ``src`` into ``out``; returns the files written. Local."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    src, out = Path(src), Path(out)
    metric_files, bench_files = _sources(src)
    every = [r for p in metric_files for r in load_metrics(p)]      # the summary's: a run with nothing to train too
    runs = [r for r in every if r["steps"]]                           # the plots'
    if metric_files and not runs:
        raise ValueError(f"no step records in {', '.join(map(str, metric_files))} (set job.log_every)")
    out.mkdir(parents=True, exist_ok=True)
    written = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        written.append(out / name)

    def label(r):
        return r["name"]

    if runs:
        fig, axes = plt.subplots(2, 2, figsize=(10, 7))
        metric = "eval AUC"
        for i, r in enumerate(runs):
            st, color = r["steps"], f"C{i % 10}"
            x, loss = [s["step"] for s in st], [s["loss"] for s in st]
            t = [r["offset"] + s["time"] for s in st]
            axes[0][0].plot(x, loss, color=color, label=f"{label(r)} train")
            axes[0][1].plot(t, loss, color=color, label=label(r))
            ev = [(s["step"], r["offset"] + s["time"], s["eval"]) for s in st if s.get("eval")]
            if r["final"] and ("auc" in r["final"] or "rmse" in r["final"]):
                ev.append((r["final"]["steps"], t[-1], r["final"]))
            if not ev:
                continue
            # eval against train on the loss axes: logloss (CTR) or squared RMSE (ratings, the train MSE's unit)
            ctr = "auc" in ev[0][2]
            metric = "eval AUC" if ctr else "eval RMSE"
            eval_loss = [e[2]["logloss"] if ctr else e[2]["rmse"] ** 2 for e in ev]
            axes[0][0].plot([e[0] for e in ev], eval_loss, "o--", color=color, label=f"{label(r)} eval")
            value = [e[2]["auc" if ctr else "rmse"] for e in ev]
            axes[1][0].plot([e[0] for e in ev], value, "o-", color=color, label=label(r))
            axes[1][1].plot([e[1] for e in ev], value, "o-", color=color, label=label(r))
            best = (r["final"] or {}).get("best")
            if best and best.get("step") is not None:
                key = "auc" if ctr else "rmse"
                axes[1][0].plot([best["step"]], [best[key]], "*", color=color, markersize=14)
        for ax, (xl, yl) in zip(axes.flat, [("step", "loss (train; eval dashed)"), ("time (s)", "train loss"),
                                            ("step", f"{metric} (best: star)"), ("time (s)", metric)]):
            ax.set_xlabel(xl)
            ax.set_ylabel(yl)
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        save(fig, "loss.png")

        fig, ax = plt.subplots(figsize=(8, 4))
        for r in runs:
            ax.plot([s["step"] for s in r["steps"]], [s["samples_per_s"] for s in r["steps"]], label=label(r))
        _axes(ax, "step", "samples/s (global)")
        save(fig, "throughput.png")

        _plot_breakdown(plt, save, runs[-1], label)
        _plot_balance(plt, save, runs, label)
        plot_monitor(plt, save, runs)

    (out / "summary.md").write_text(_summary(every, bench_files, written))
    written.append(out / "summary.md")
    return written


def _plot_breakdown(plt, save, r, label) -> None:
    """time_breakdown.png: worker 0's ms per step by phase, per metrics record of run ``r``."""
    fig, ax = plt.subplots(figsize=(8, 4))
    recs = [s for s in r["steps"] if set(PHASES) <= set(s.get("time_breakdown_s", {}))]
    first = None
    if len(recs) >= 3:                  # the first record holds the start (first touches, warm-up): its own scale
        first, recs = recs[0], recs[1:]
    if recs:
        x = list(range(len(recs)))
        bottom = [0.0] * len(recs)
        for ph in PHASES:
            per_step = []
            last = first["step"] if first is not None else r["final"]["start_step"] if r["final"] else \
                recs[0]["step"] - (recs[1]["step"] - recs[0]["step"] if len(recs) > 1 else recs[0]["step"])
            for s in recs:
                n = s["step"] - last
                last = s["step"]
                per_step.append(1e3 * s["time_breakdown_s"][ph] / max(n, 1))
            ax.bar(x, per_step, bottom=bottom, label=ph.replace("_", " "))
            bottom = [b + v for b, v in zip(bottom, per_step)]
        every = max(1, len(recs) // 15)                  # at most ~15 labels
        ax.set_xticks(x[::every], [str(s["step"]) for s in recs][::every], rotation=45, fontsize=7)
        ax.set_xlabel("up to step")
        ax.set_ylabel("ms per step, worker 0")
        ax.legend(fontsize=8, ncol=3)
    ax.set_title(label(r) + (f" (from step {first['step']}: the first record, the start, left out)" if first else ""))
    save(fig, "time_breakdown.png")


def _plot_balance(plt, save, runs, label) -> None:
    """staleness.png, load_balance.png and checkpoints.png of ``runs`` (the last run's staleness and load)."""
    r = runs[-1]
    fig, ax = plt.subplots(figsize=(6, 4))
    counts = {}
    for s in r["steps"]:
        for k, v in s.get("staleness_counts", {}).items():
            counts[int(k)] = counts.get(int(k), 0) + v
    if set(counts) - {0}:                 # sync mode sees 0 at every step: nothing to plot (the summary says so)
        ks = sorted(counts)
        ax.bar(ks, [counts[k] for k in ks])
        ax.set_xlabel("staleness (steps) seen by worker 0 at step begin")
        ax.set_ylabel("steps")
        ax.set_title(label(r) + (" (the last run)" if len(runs) > 1 else ""))
        save(fig, "staleness.png")
    else:
        plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    last = r["steps"][-1]
    rows = last.get("rows_per_ps", [])
    nbytes = last.get("bytes_per_ps", [])
    axes[0].bar(range(len(rows)), rows)
    axes[0].set_ylabel("rows pulled by worker 0")
    axes[1].bar(range(len(nbytes)), [b / 1e6 for b in nbytes])
    axes[1].set_ylabel("MB pulled by worker 0")
    for ax in axes:
        ax.set_xlabel("PS rank")
        ax.set_xticks(range(len(rows)))
    fig.suptitle(f"{label(r)}: up to step {last['step']}" + (" (the last run)" if len(runs) > 1 else ""), fontsize=9)
    save(fig, "load_balance.png")

    if any(run["checkpoints"] or (run["final"] or {}).get("checkpoint_timings") for run in runs):
        fig, ax = plt.subplots(figsize=(7, 4))
        for i, run in enumerate(runs):            # one line a run: their steps may go back (another run)
            ck, color = run["checkpoints"], f"C{i % 10}"
            timings = (run["final"] or {}).get("checkpoint_timings", [])
            if ck:
                ax.plot([c["checkpoint"] for c in ck], [1e3 * c["stall_s"] for c in ck], "o-", color=color,
                        label=f"{label(run)}: stall (training paused)")
            if timings:
                ax.plot([t["step"] for t in timings], [1e3 * t["write_s"] for t in timings], "s--", color=color,
                        label=f"{label(run)}: request to commit (background)")
        _axes(ax, "checkpoint at step", "ms")
        save(fig, "checkpoints.png")


def _axes(ax, xlabel: str, ylabel: str) -> None:
    """Labels, a zero-based y axis, a light grid and a legend."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _summary(runs, bench_files, plots) -> str:
    lines = ["# hpcps report", ""]
    for r in runs:
        f, last = r["final"] or {}, (r["steps"] or [{}])[-1]
        lines += [f"## {r['name']}", ""]
        if r.get("start"):
            lines.append(f"- started {r['start']['utc']} (run {r['start']['run']}): `{r['start']['command']}`")
        if r["killed"]:
            lines.append(f"- no final line: killed, or still running (last record at step {last.get('step', '-')})")
        elif not r["steps"]:
            lines.append(f"- nothing to train: it started at step {f.get('start_step')} of {f.get('steps')}")
        if f:
            lines.append(f"- steps {f.get('start_step', 0)} -> {f.get('steps')}, {f.get('num_ps')} PS, "
                         f"{f.get('num_workers')} workers, mode {f.get('mode')}")
            for k in ("auc", "planted_auc", "logloss", "rmse", "mae"):
                if k in f:
                    lines.append(f"- {k}: {f[k]:.4f}")
            best = f.get("best") or {}
            if best:
                lines.append(f"- best {best['metric']}: {best[best['metric']]:.4f} at step {best['step']} "
                             f"({f.get('evaluations', 0)} evaluations" + (", stopped early)" if f.get("early_stopped")
                                                                           else ")"))
            lines.append(f"- samples/s over the whole loop: {f.get('samples_per_s', 0):,.0f}")
            lines.append(f"- max staleness: {f.get('max_staleness', 0)}" + (
                " (0 at every step: no staleness plot)" if not f.get("max_staleness") else ""))
            if f.get("checkpoints"):
                lines.append(f"- checkpoints: {len(f['checkpoints'])}, worst stall "
                             f"{1e3 * f.get('checkpoint_stall_s', 0):.0f} ms")
            mem = f.get("memory")
            if mem:
                lines.append(f"- peak RSS: PS {mem['ps_peak_rss_mb']} MB (tables {mem['ps_table_mb']} MB), "
                             f"workers {mem['worker_peak_rss_mb']} MB")
        tb = {}
        for s in r["steps"]:
            for k, v in s.get("time_breakdown_s", {}).items():
                tb[k] = tb.get(k, 0.0) + v
        total = sum(tb.values())
        if total:
            lines.append("- worker 0's time: " + ", ".join(f"{k.replace('_', ' ')} {100 * v / total:.0f}%"
                                                           for k, v in tb.items()))
        rows = last.get("rows_per_ps", [])
        if len(rows) > 1 and sum(rows):
            lines.append(f"- load balance: max/mean rows per PS = {max(rows) / (sum(rows) / len(rows)):.2f}")
        lines += monitor_lines(r)
        lines.append("")
    for b in bench_files:
        data = json.loads(b.read_text())
        lines += [f"## {b.name}", ""]
        targets = data.get("targets", {})
        # ratios at the top level, under "ratios", and per run under "results" (e.g. per pull_dtype)
        flat = [(k, v) for k, v in data.items()] + list(data.get("ratios", {}).items())
        flat += [(f"{run} {k}", v) for run, res in data.get("results", {}).items() if isinstance(res, dict)
                 for k, v in res.items() if "_minus_" in k or "_vs_" in k]
        for k, v in flat:
            if isinstance(v, (int, float)) and not isinstance(v, bool) and ("_vs_" in k or "ratio" in k
                                                                            or "_minus_" in k):
                t = targets.get(k)
                lines.append(f"- {k}: {v:.{4 if '_minus_' in k else 2}f}" + (f" (target {t})" if t is not None else ""))
        for pt in data.get("points", []):            # grids and scaling runs: one line per point
            shown = [f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in pt.items()
                     if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "iters"]
            lines.append("- " + ", ".join(shown))
        lines.append("")
    if plots:
        lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    return "\n".join(lines)
