"""The job's monitor: every ``metrics.every`` seconds each rank samples itself and puts a row on
the board (:mod:`hpcps.monitor.board`); the first worker, at the same pace, reads every row, writes
one record per host to the metrics log, shows the worst figures on the progress bar and judges the
alert rules (:mod:`hpcps.monitor.rules`). An alert is one ``hpcps: ALERT ...`` log line and an
``{"alert": ...}`` record; with ``monitor.on_alert = "checkpoint_and_stop"`` the job then takes a
checkpoint and stops (exit 85), so a Slurm chain restarts with the suggested layout."""

import logging
import math
import os
import time

import numpy as np
from mpi4py import MPI

from . import probe
from .board import Board
from .fields import PS, WORKER, at
from .rules import host_records, judge

__all__ = ["Monitor"]

logger = logging.getLogger("hpcps.monitor")
SILENT_ROUNDS = 3           # a rank is silent after this many of the first worker's reads without a new row
SUSTAINED = ("ps_overloaded", "straggler")   # rate rules: raised only when two judgments in a row find them,
#                             so one slow sample window (a checkpoint, a descheduled rank) does not stop a job


class Monitor:
    """One rank's part of the monitor. Made collectively over the world (a gather of host names and
    the board's window); :meth:`tick` (workers, after each step) and the PS's serve-loop hook are
    local and cheap until a sample falls due."""

    def __init__(self, cfg, ctx, ckpt_estimate: float = 0.0):
        self.cfg, self.ctx, self.mon = cfg, ctx, cfg.monitor
        self.every = cfg.metrics.every
        self.root = ctx.worker_world_ranks[0]
        self.lead = ctx.rank == self.root
        names = ctx.world.gather((MPI.Get_processor_name(), ctx.node_of_rank[ctx.rank]), root=self.root)
        self.board = Board(ctx.world, self.root, ctx.num_ps)
        ctx.add_resource(self.board)
        self.cpu = probe.CpuMeter()
        self.next_t = time.monotonic() + self.every
        self._last = None                    # (time, cumulative counters) at the previous sample
        # worker: () -> (steps, seconds waiting on others, of which pulls and pushes, fence wait per PS,
        # bytes pulled and pushed per PS), cumulative
        self.figures = None
        if ctx.is_ps:
            ctx.add_service_hook(self._ps_hook)
        if self.lead:
            self._lead_setup(names, ckpt_estimate)

    def _lead_setup(self, names, ckpt_estimate: float) -> None:
        keys = list(dict.fromkeys(node for _, node in names))
        self.host_of = [keys.index(node) for _, node in names]
        self.host_names = [next(n for n, node in names if node == k) for k in keys]
        n = len(names)
        self.seen_seq, self.quiet_rounds = np.zeros(n), np.zeros(n, int)
        self.changed_at = np.full(n, time.monotonic())
        self.prev_rss = None
        self.active, self.raised = set(), []
        self.pending = set()                 # rate alerts found by the last judgment, not yet raised
        self.ckpt_bytes = float(ckpt_estimate)
        self.sized = set()                   # committed steps whose size was measured
        self.post = {}
        self.log = self.on_alert = self.ckpt = None
        self.started = time.monotonic()

    def attach(self, log, on_alert, ckpt=None) -> None:
        """First worker: where records go (a :class:`hpcps.core.metrics.MetricsLog`), what a raised alert
        calls when ``monitor.on_alert`` asks to stop (``on_alert(alert)``), and the job's
        checkpointer (its committed checkpoints' sizes). Local."""
        self.log, self.on_alert, self.ckpt = log, on_alert, ckpt

    # ------------------------------------------------------------ sampling (every rank)
    def _common(self) -> dict:
        mine, node = self.cpu.take()
        used, limit = probe.memory_limit()
        return {"cpu_proc": mine, "cpu_node": node, "rss": probe.rss(), "mem_used": used, "mem_limit": limit,
                "local_free": probe.disk_free(self.cfg.checkpoint.local_dir)}

    def _ps_hook(self) -> bool:
        now = time.monotonic()
        if now >= self.next_t:
            self.next_t = now + self.every
            ctx = self.ctx
            b = ctx.busy_s
            counts = (sum(b.values()), b.get("apply", 0.0), b.get("checkpoint", 0.0), b.get("serve", 0.0),
                      ctx.rows_applied)
            last_t, last = self._last or (now - self.every, (0.0,) * len(counts))
            wall = max(now - last_t, 1e-9)
            d = [(a - b) / wall for a, b in zip(counts, last)]
            self._last = (now, counts)
            self.board.put(self.board.row(role=PS, busy=min(d[0], 1.0), apply=min(d[1], 1.0),
                                          checkpoint=min(d[2], 1.0), serve=min(d[3], 1.0), rows_s=d[4],
                                          **self._common()))
        return False                         # sampling is not work: the loop's pause stays as it was

    def tick(self, steps_done: int) -> None:
        """Worker, after each step: a sample when one is due; on the first worker also the records
        and the alerts. Local."""
        now = time.monotonic()
        if now < self.next_t:
            return
        self.next_t = now + self.every
        self._worker_sample(now)
        if self.lead:
            self._judge(steps_done)

    def _worker_sample(self, now: float, done: bool = False) -> None:
        counts = self.figures()
        last_t, last = self._last or (now - self.every, tuple(0 * np.asarray(c) for c in counts))
        self._last = (now, counts)
        steps, wall = counts[0] - last[0], now - last_t
        per = 1.0 / max(steps, 1)               # own work: the time not spent waiting on other ranks
        self.board.put(self.board.row(done=done, role=WORKER, steps=steps, step_s=wall * per,
                                      compute_s=max(wall - (counts[1] - last[1]), 0.0) * per,
                                      rpc_s=(counts[2] - last[2]) * per,
                                      wait_ps=(np.asarray(counts[3]) - np.asarray(last[3])) * per,
                                      bytes_ps=(np.asarray(counts[4]) - np.asarray(last[4])) / max(wall, 1e-9),
                                      **self._common()))

    def finish(self) -> None:
        """Worker, after its training loop: its last row says it is done (not silent). Local."""
        self._worker_sample(time.monotonic(), done=True)

    # ------------------------------------------------------------ the first worker
    def _silent(self, rows: np.ndarray, now: float) -> list:
        seq = rows[:, at("seq")]
        new = seq != self.seen_seq
        self.changed_at[new] = now
        self.quiet_rounds = np.where(new, 0, self.quiet_rounds + 1)
        self.seen_seq = seq.copy()
        limit = self.mon.silent * self.every
        return [(r, now - self.changed_at[r]) for r in range(len(seq))
                if self.quiet_rounds[r] >= SILENT_ROUNDS and now - self.changed_at[r] > limit
                and rows[r, at("done")] != 1]

    def _disk(self) -> dict:
        c = self.cfg.checkpoint
        if not c.dir:
            return {}
        for step in (self.ckpt.committed if self.ckpt is not None else []):
            if step not in self.sized:                 # the largest checkpoint written so far
                self.sized.add(step)
                self.ckpt_bytes = max(self.ckpt_bytes, _tree_bytes(os.path.join(c.dir, f"step-{step:09d}")))
        k = self.mon.disk_checkpoints
        ps_most = max(sum(self.host_of[r] == h for r in self.ctx.ps_world_ranks) for h in set(self.host_of))
        local = k * self.ckpt_bytes * 2 * ps_most / self.ctx.num_ps if c.local_dir else 0   # its own and a partner's
        return {"dir": c.dir, "free": probe.disk_free(c.dir), "need": k * self.ckpt_bytes, "local_need": local,
                "rank": self.root}

    def _judge(self, step: int) -> None:
        now = time.monotonic()
        rows = self.board.read()
        rss = rows[:, at("rss")]
        growth = None
        if self.prev_rss is not None:
            growth = (rss - self.prev_rss[1]) / max(now - self.prev_rss[0], 1e-9)
        self.prev_rss = (now, rss)
        hosts = host_records(rows, self.host_of, self.host_names, self.ctx.ps_world_ranks,
                             self.mon.node_memory_mb, growth)
        disk = self._disk()
        for rec in hosts:
            if self.log is not None:
                extra = {"checkpoint_free_mb": round(disk["free"] / 1e6, 1)} if (
                    disk and rec["host"] == self.host_names[self.host_of[self.root]] and math.isfinite(disk["free"])) else {}
                self.log.write({"monitor": step, **rec, **extra})
        alerts = judge(rows, hosts, self.host_of, self.host_names, self.ctx.ps_world_ranks, self.mon, disk,
                       self._silent(rows, now))
        self._post(hosts)
        self._raise(step, alerts)

    def _post(self, hosts: list) -> None:
        mem = [h["mem_used_mb"] / h["mem_limit_mb"] for h in hosts if h["mem_used_mb"] is not None and h["mem_limit_mb"]]
        busy = [p["busy"] for h in hosts for p in h["ps"] if p["busy"] is not None]
        self.post = {**({"mem": f"{max(mem):.0%}"} if mem else {}), **({"ps_busy": f"{max(busy):.0%}"} if busy else {}),
                     **({"alerts": str(len(self.active))} if self.active else {})}

    def _raise(self, step: int, alerts: list) -> None:
        found = {(a["rule"], a["rank"]) for a in alerts}
        pending, self.pending = self.pending, {k for k in found if k[0] in SUSTAINED}
        alerts = [a for a in alerts if a["rule"] not in SUSTAINED or (a["rule"], a["rank"]) in pending]
        now = {(a["rule"], a["rank"]) for a in alerts}
        for a in alerts:
            if (a["rule"], a["rank"]) in self.active:
                continue                               # raised already and not cleared since
            logger.warning("hpcps: ALERT %s", a["message"])
            record = {"alert": a["rule"], "step": step, **{k: v for k, v in a.items() if k != "rule"}}
            self.raised.append(record)
            if self.log is not None:
                self.log.write(record)
            # rebalance: a PS overloaded stops the job for more PS (hpcps.train.failover); other alerts are logged
            rebalance = self.mon.on_alert == "rebalance" and a.get("suggest_num_ps")
            if (self.mon.on_alert == "checkpoint_and_stop" or rebalance) and self.on_alert is not None:
                self.on_alert(a)
        self.active = now
        if self.active:
            self.post["alerts"] = str(len(self.active))


def _tree_bytes(path: str) -> float:
    """Bytes of the files under ``path`` (0 where it is gone). Local."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return float(total)
