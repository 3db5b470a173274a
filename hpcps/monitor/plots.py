"""``hpcps report``'s part of the monitor's records: ``hosts.png`` (each host's CPUs used by the
job's ranks and its memory in use against what it has, over time), ``ps_busy.png`` (each PS's busy
share over time) and the summary's lines (alerts, the worst figures). Local; no MPI."""

__all__ = ["plot_monitor", "monitor_lines"]


def _series(runs, key):
    """``{name: ([time], [record])}`` of the monitor's records, by ``key`` (a host, a PS), on the
    time axis that continues across runs."""
    out = {}
    for r in runs:
        for rec in r["monitor"]:
            t = r["offset"] + rec["time"]
            for name, item in key(rec):
                ts, items = out.setdefault(name, ([], []))
                if ts and r["monitor"][0] is rec:          # a new run: a gap, not a line across
                    ts.append(float("nan"))
                    items.append(None)
                ts.append(t)
                items.append(item)
    return out


def plot_monitor(plt, save, runs) -> None:
    """hosts.png and ps_busy.png where the runs have monitor records (``metrics.every`` > 0)."""
    hosts = _series(runs, lambda rec: [(rec["host"], rec)])
    if not hosts:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for i, (name, (t, recs)) in enumerate(hosts.items()):
        color = f"C{i % 10}"
        axes[0].plot(t, [x["cpus_used"] if x else float("nan") for x in recs], color=color, label=name)
        axes[1].plot(t, [x["mem_used_mb"] if x else float("nan") for x in recs], color=color, label=f"{name} in use")
        limit = [x["mem_limit_mb"] for x in recs if x]
        if limit and limit[-1]:
            axes[1].axhline(limit[-1], color=color, ls="--", lw=0.8, label=f"{name} has")
    for ax, yl in zip(axes, ("CPUs used by the job's ranks", "memory (MB)")):
        ax.set_xlabel("time (s)")
        ax.set_ylabel(yl)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes:
        _mark_runs(ax, runs)
    _mark_alerts(axes[1], runs)
    save(fig, "hosts.png")
    ps = _series(runs, lambda rec: [(f"PS {p['ps']} ({rec['host']})", p) for p in rec["ps"]])
    if ps:
        fig, ax = plt.subplots(figsize=(8, 4))
        for name, (t, items) in sorted(ps.items()):
            ax.plot(t, [100 * (x["busy"] or 0) if x else float("nan") for x in items], label=name)
        ax.set_xlabel("time (s)")
        ax.set_ylabel("busy (% of the time: applying, serving, checkpoints)")
        ax.set_ylim(0, 105)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        _mark_runs(ax, runs)
        _mark_alerts(ax, runs)
        save(fig, "ps_busy.png")


def _mark_runs(ax, runs) -> None:
    """Where each run after the first starts on the time axis that continues across runs: a dashed
    line and its name (no line joins two runs' records)."""
    for r in runs[1:]:
        ax.axvline(r["offset"], color="gray", ls=":", lw=0.8)
        ax.annotate(r["name"], (r["offset"], 1),
                    xycoords=("data", "axes fraction"), fontsize=6, va="top", rotation=90, color="gray")


def _mark_alerts(ax, runs) -> None:
    """A vertical line at each alert (the monitor record of its step, else the run's end)."""
    for r in runs:
        for a in r["alerts"]:
            at = [m["time"] for m in r["monitor"] if m["monitor"] == a.get("step")]
            if at:
                ax.axvline(r["offset"] + at[0], color="red", lw=0.8, alpha=0.6)


def monitor_lines(run) -> list[str]:
    """The summary's lines of one run's monitor records and alerts."""
    mon = run["monitor"]
    if not mon:
        return []
    worst = max(mon, key=lambda x: (x["mem_used_mb"] or 0) / (x["mem_limit_mb"] or 1))
    busy = [(p["busy"], p["ps"]) for x in mon for p in x["ps"] if p["busy"] is not None]
    lines = [f"- monitor: {len({x['host'] for x in mon})} host(s); the most memory in use: host {worst['host']} "
             f"{worst['mem_used_mb']:,.0f} of {worst['mem_limit_mb']:,.0f} MB"
             + (f"; the busiest PS: PS {max(busy)[1]} at {max(busy)[0]:.0%}" if busy else "")]
    for a in run["alerts"]:
        lines.append(f"- ALERT at step {a.get('step')}: {a['message']}")
    if not run["alerts"]:
        lines.append("- no alerts")
    return lines
