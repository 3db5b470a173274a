"""From the board's rows to one record per host, and the alert rules. Pure functions of the rows
and the ``[monitor]`` settings; the first worker calls them (:class:`hpcps.monitor.Monitor`). Local."""

import math

import numpy as np

from .fields import PS, WORKER, at, per_ps

__all__ = ["host_records", "judge", "suggest_num_ps", "RULES", "TARGET_PS_BUSY"]

RULES = ("memory", "disk", "ps_overloaded", "straggler", "silent")
SHARES = ("busy", "apply", "checkpoint", "serve")     # a PS's shares of its time
TARGET_PS_BUSY = 0.7        # a suggested layout puts each PS at about this share of busy time
TARGET_WAIT = 2 / 3         # ... and the workers' wait on a PS at this share of monitor.ps_wait
_MB = 1e6


def _col(rows, name):
    return rows[:, at(name)]


def _max(x) -> float:
    """The largest finite value of ``x``, NaN when there is none (numpy's nanmax warns). Local, pure."""
    x = np.asarray(x, float)
    ok = np.isfinite(x)
    return float(x[ok].max()) if ok.any() else float("nan")


def _min(x) -> float:
    x = np.asarray(x, float)
    ok = np.isfinite(x)
    return float(x[ok].min()) if ok.any() else float("nan")


def _mb(x: float) -> float:
    return round(float(x) / _MB, 1) if math.isfinite(x) else None


def _num(x: float, nd: int = 3):
    return round(float(x), nd) if math.isfinite(x) else None


def host_records(rows: np.ndarray, host_of: list, host_names: list, ps_ranks: list, node_memory_mb: float = 0,
                 growth=None) -> list[dict]:
    """One record per host of the latest rows (of its ranks that have reported): CPUs used by the job's
    ranks and the node's busy share, resident memory (the sum, the largest rank), the node's memory
    in use and its limit (``node_memory_mb`` > 0: the sum of the ranks' resident memory against it),
    ``checkpoint.local_dir``'s free space, each PS's busy share (and of it applying, writing
    checkpoints, serving messages), rows applied per second and MB per second the workers pulled
    from and pushed to it, and the workers' worst step, own-work and wait figures. ``growth``: bytes per second
    each rank's resident memory grew. Local, pure."""
    seen = _col(rows, "seq") > 0
    served = _served(rows, len(ps_ranks))
    ps_index = {r: p for p, r in enumerate(ps_ranks)}
    by_host = [[] for _ in host_names]
    for r, h in enumerate(host_of):
        by_host[h].append(r)
    out = []
    for h, name in enumerate(host_names):
        every = by_host[h]
        ranks = [r for r in every if seen[r]]
        if not ranks:
            continue
        sub = rows[ranks]
        rss = _col(sub, "rss")
        big = ranks[int(np.nanargmax(rss))] if np.isfinite(rss).any() else ranks[0]
        if node_memory_mb > 0:
            used, limit = float(np.nansum(rss)), node_memory_mb * _MB
        else:
            used, limit = _max(_col(sub, "mem_used")), _max(_col(sub, "mem_limit"))
        rec = {"host": name, "ranks": len(every), "reported": len(ranks), "cpus_used": _num(float(np.nansum(_col(sub, "cpu_proc"))), 2),
               "cpu_node": _num(_max(_col(sub, "cpu_node"))), "rss_mb": _mb(float(np.nansum(rss))),
               "rss_max_mb": _mb(float(rows[big, at("rss")])), "rss_max_rank": big,
               "mem_used_mb": _mb(used), "mem_limit_mb": _mb(limit),
               "local_free_mb": _mb(_min(_col(sub, "local_free")))}
        if growth is not None:
            rec["rss_max_growth_mb_min"] = _num(60 * growth[big] / _MB, 1)
        rec["ps"] = [{"ps": ps_index[r], "rank": r, **{k: _num(rows[r, at(k)]) for k in SHARES},
                      "rows_s": _num(rows[r, at("rows_s")], 0), "mb_s": _num(served[ps_index[r]] / _MB, 2)}
                     for r in ranks if rows[r, at("role")] == PS]
        wk = [r for r in ranks if rows[r, at("role")] == WORKER and rows[r, at("steps")] > 0]
        if wk:
            w = rows[wk]
            slow = wk[int(np.nanargmax(_col(w, "compute_s")))]
            rec["workers"] = {"step_ms": _num(1e3 * _max(_col(w, "step_s")), 2),
                              "compute_ms": _num(1e3 * float(rows[slow, at("compute_s")]), 2),
                              "slowest_rank": slow,
                              "wait": _num(_max(_wait_share(w, len(ps_ranks)).sum(axis=1)))}
        out.append(rec)
    return out


def _served(rows: np.ndarray, num_ps: int) -> np.ndarray:
    """Bytes per second every worker pulled from and pushed to each PS, summed. Local, pure."""
    wk = (rows[:, at("role")] == WORKER) & (rows[:, at("seq")] > 0)
    return np.nan_to_num(rows[wk][:, per_ps("bytes_ps", num_ps)]).sum(axis=0)


def _wait_share(w: np.ndarray, num_ps: int) -> np.ndarray:
    """Each worker's share of its step spent waiting on each PS: its fence wait on that PS, plus
    its pull and push wait spread over the PS. ``[workers, num_ps]``. Local, pure."""
    step = np.maximum(_col(w, "step_s"), 1e-12)[:, None]
    fence = np.nan_to_num(w[:, per_ps("wait_ps", num_ps)])
    rpc = np.nan_to_num(_col(w, "rpc_s"))[:, None] / max(num_ps, 1)
    return (fence + rpc) / step


def suggest_num_ps(busy: list, num_ps: int, wait: float = 0.0, target_wait: float = 0.2) -> int:
    """How many PS would carry the measured load: at about :data:`TARGET_PS_BUSY` busy each (the
    PS's busy shares add up to the work; more PS split it), and with the workers' wait on the most
    waited-on PS (``wait``, a share of their step) cut to ``target_wait`` (the wait is that PS's
    work, which more PS split); at least one more than now. Local, pure."""
    by_busy = math.ceil(sum(b for b in busy if math.isfinite(b)) / TARGET_PS_BUSY)
    by_wait = math.ceil(num_ps * wait / target_wait) if wait > 0 else 0
    return max(num_ps + 1, by_busy, by_wait)


def judge(rows: np.ndarray, hosts: list[dict], host_of: list, host_names: list, ps_ranks: list, mon,
          disk: dict, silent: list) -> list[dict]:
    """The alerts the latest figures raise: ``[{"rule", "rank", "host", "figure", "limit",
    "message"}]``. ``mon``: the ``[monitor]`` settings; ``disk``: ``{"dir", "free", "need",
    "local_need"}`` (bytes); ``silent``: ``[(rank, seconds)]`` of ranks that stopped reporting.
    Local, pure."""
    alerts = []

    def add(rule, rank, figure, limit, message):
        alerts.append({"rule": rule, "rank": int(rank), "host": host_names[host_of[rank]],
                       "figure": figure, "limit": limit, "message": message})

    for rec in hosts:
        used, limit = rec["mem_used_mb"], rec["mem_limit_mb"]
        if used is not None and limit and used > mon.memory * limit:
            grow = rec.get("rss_max_growth_mb_min")
            add("memory", rec["rss_max_rank"], round(used / limit, 3), mon.memory,
                f"memory: host {rec['host']} uses {used:,.0f} of {limit:,.0f} MB ({used / limit:.0%}, over "
                f"{mon.memory:.0%}); rank {rec['rss_max_rank']} holds the most: {rec['rss_max_mb']:,.0f} MB"
                + (f", {grow:+,.0f} MB/min" if grow is not None else ""))
        need_local = disk.get("local_need", 0)
        if rec["local_free_mb"] is not None and need_local and rec["local_free_mb"] * _MB < need_local:
            add("disk", rec["rss_max_rank"], rec["local_free_mb"], round(need_local / _MB, 1),
                f"disk: checkpoint.local_dir on host {rec['host']} has {rec['local_free_mb']:,.1f} MB free, under "
                f"{mon.disk_checkpoints:g} node-local checkpoints ({need_local / _MB:,.1f} MB): the next ones may fail")
    free, need = disk.get("free", math.nan), disk.get("need", 0)
    if need and math.isfinite(free) and free < need:
        add("disk", disk["rank"], _mb(free), _mb(need),
            f"disk: checkpoint.dir ({disk['dir']}) has {free / _MB:,.1f} MB free, under {mon.disk_checkpoints:g} "
            f"checkpoints ({need / _MB:,.1f} MB): free space or move checkpoint.dir before a checkpoint fails")
    alerts += _ps_alerts(rows, host_of, host_names, ps_ranks, mon)
    alerts += _straggler(hosts, host_of, host_names, mon)
    for rank, quiet in silent:
        alerts.append({"rule": "silent", "rank": int(rank), "host": host_names[host_of[rank]], "figure": round(quiet, 1),
                       "limit": mon.silent, "message": f"silent: rank {rank} on host {host_names[host_of[rank]]} has "
                       f"not reported for {quiet:.0f} s (stuck, or busy outside the step loop)"})
    return alerts


def _ps_alerts(rows, host_of, host_names, ps_ranks, mon) -> list[dict]:
    """A PS the workers lose over ``monitor.ps_wait`` of their step to, busy for at least
    ``monitor.ps_busy`` of that wait (so the wait is its work, not a slow link or another
    worker). A sync PS idles while its workers compute, so its busy share alone never shows it
    holding them back; a PS busy all the time but not in their way raises nothing. Local, pure."""
    P = len(ps_ranks)
    busy = [float(rows[r, at("busy")]) for r in ps_ranks]
    wk = [r for r in range(rows.shape[0]) if rows[r, at("role")] == WORKER
          and rows[r, at("seq")] > 0 and rows[r, at("steps")] > 0]
    if not wk:
        return []
    wait = _wait_share(rows[wk], P).mean(axis=0)
    out = []
    for p, r in enumerate(ps_ranks):
        if math.isfinite(busy[p]) and wait[p] > mon.ps_wait and busy[p] >= mon.ps_busy * wait[p]:
            n = suggest_num_ps(busy, P, float(np.max(wait)), TARGET_WAIT * mon.ps_wait)
            out.append({"rule": "ps_overloaded", "rank": r, "host": host_names[host_of[r]], "figure": round(float(wait[p]), 3),
                        "limit": mon.ps_wait, "busy": round(busy[p], 3), "suggest_num_ps": n,
                        "message": f"PS overloaded: the workers wait on PS {p} (rank {r}, host {host_names[host_of[r]]}) "
                        f"{wait[p]:.0%} of their step, and it is busy {busy[p]:.0%} of the time: the layout needs more "
                        f"PS, about {n} to cut that wait to {TARGET_WAIT * mon.ps_wait:.0%} (and their busy shares "
                        f"add to {sum(b for b in busy if math.isfinite(b)):.2f}); restart with --set job.num_ps={n} "
                        f"(and {n - P} more ranks to keep the workers)"})
    return out


def _straggler(hosts, host_of, host_names, mon) -> list[dict]:
    """A host whose workers' own work per step is over ``monitor.straggler`` times the median
    host's (two hosts with workers at least). Local, pure."""
    timed = [h for h in hosts if h.get("workers") and h["workers"]["compute_ms"] is not None]
    if len(timed) < 2:
        return []
    med = float(np.median([h["workers"]["compute_ms"] for h in timed]))
    out = []
    for h in timed:
        ms = h["workers"]["compute_ms"]
        if med > 0 and ms > mon.straggler * med:
            r = h["workers"]["slowest_rank"]
            out.append({"rule": "straggler", "rank": r, "host": h["host"], "figure": round(ms / med, 2),
                        "limit": mon.straggler,
                        "message": f"straggler: host {h['host']} takes {ms:.1f} ms a step of its own work (rank {r}), "
                        f"{ms / med:.1f}x the median host's {med:.1f} ms: every sync step waits for it"})
    return out
