"""What a worker measures while it trains: per-phase time, staleness, pipeline counters, memory,
the metrics records every ``job.log_every`` steps and the final summary's pipeline part."""

import sys
import time

from mpi4py import MPI

__all__ = ["Telemetry", "LineProgress", "EpochBar", "progress_bar", "pipeline_summary", "peak_rss", "thread_level_name", "PHASES"]

# per-step time of worker 0 by phase (seconds since the last record): idle = waiting in step_begin
# for the mode's fence; pull / push = this thread waiting for its pulls / pushes (with the pipeline
# on, most of that work runs on the communication thread meanwhile)
PHASES = ("data", "idle", "pull", "forward_backward", "push", "dense_allreduce")
_THREAD_LEVELS = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                  MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}


def thread_level_name() -> str:
    """The MPI thread level this process got, by name. Local."""
    return _THREAD_LEVELS.get(MPI.Query_thread(), str(MPI.Query_thread()))


def waits(embs) -> tuple[float, float]:
    """Seconds this thread has waited for pulls and for pushes, summed over ``embs``. Local."""
    return sum(e.pull_wait_s for e in embs), sum(e.push_wait_s for e in embs)


def pipeline_rates(embs, totals: dict) -> dict:
    """Cache hit rate and the share of prefetched rows pulled again, since the last call (this
    worker's view); adds the counts to ``totals``. Local."""
    out = {}
    counts = [e.cache.take_counts() for e in embs if e.cache is not None]
    pre, again = sum(e.prefetched_rows for e in embs), sum(e.refreshed_rows for e in embs)
    for e in embs:
        e.prefetched_rows = e.refreshed_rows = 0
    for key, v in (("lookups", sum(c[0] for c in counts)), ("hits", sum(c[1] for c in counts)),
                   ("prefetched", pre), ("refreshed", again)):
        totals[key] = totals.get(key, 0) + v
    if counts:
        out["cache_hit_rate"] = sum(c[1] for c in counts) / max(sum(c[0] for c in counts), 1)
    if pre:
        out["prefetch_refreshed"] = again / pre
    return out


def pipeline_summary(pl, pipe, comm_thread, embs, totals, loader) -> dict:
    """The final summary's ``pipeline`` part. Local."""
    pipeline_rates(embs, totals)                      # counts since the last record
    out = {"prefetch": pipe["prefetch"], "background_push": comm_thread.enabled, "cache_rows": pl.cache_rows,
           "pull_dtype": pl.pull_dtype, "push_dtype": pl.push_dtype, "loader": loader is not None}
    if loader is not None:
        out["loader_wait_s"] = round(loader.wait_s, 6)
    if pl.cache_rows:
        out["cache_hit_rate"] = totals["hits"] / max(totals["lookups"], 1)
        out["cache_staleness"] = pl.cache_staleness
    if totals.get("prefetched"):
        out["prefetch_refreshed"] = totals["refreshed"] / totals["prefetched"]
    # pushes to another node too large for this worker's mailbox slot there (sent the locked way)
    out["push_mailbox_full"] = sum(e.table.traffic.inbox_full for e in embs)
    return out


class LineProgress:
    """The progress bar of a batch job's log (stderr not a terminal): one plain line every 5% of the
    steps or every ``every_s`` seconds, whichever comes first, and at the end (a redrawn bar in a
    file is one long line of carriage returns, and a run shorter than its redraw interval showed
    0% and then the end). The interface of tqdm's bar that the worker uses. Local."""

    def __init__(self, total: int, initial: int, every_s: float = 600.0, out=None, desc: str = "train"):
        self.total, self.n, self.every_s, self.desc = total, initial, every_s, desc
        self.out = out if out is not None else sys.stderr
        self.step_every = max(1, (total - initial) // 20)
        self.t0 = self.last_t = time.monotonic()
        self.last_n, self.first, self.post = initial, initial, {}

    def reset(self, total: int) -> None:
        """A new count to ``total`` (the next epoch of ``job.epochs = "auto"``). Local."""
        self.close()
        post = self.post
        self.__init__(total, 0, self.every_s, self.out, self.desc)
        self.post = post                     # as tqdm's reset keeps its postfix

    def set_description(self, desc: str, refresh: bool = False) -> None:
        self.desc = desc

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n - self.last_n >= self.step_every or time.monotonic() - self.last_t >= self.every_s:
            self._line()

    def set_postfix(self, post: dict, refresh: bool = False) -> None:
        self.post = dict(post)

    def _line(self) -> None:
        now = time.monotonic()
        rate = (self.n - self.first) / max(now - self.t0, 1e-9)
        extra = "".join(f", {k} {v}" for k, v in self.post.items())
        print(f"{self.desc}: step {self.n}/{self.total} ({100 * self.n / max(self.total, 1):.0f}%), {rate:.1f} steps/s{extra}",
              file=self.out, flush=True)
        self.last_n, self.last_t = self.n, now

    def close(self) -> None:
        if self.n != self.last_n:
            self._line()


def progress_bar(total: int, initial: int, desc: str = "train"):
    """A tqdm bar on a terminal, else :class:`LineProgress` (a batch job's log). Local."""
    if not sys.stderr.isatty():
        return LineProgress(total, initial, desc=desc)
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True, mininterval=0.1)


class EpochBar:
    """The progress of ``job.epochs = "auto"``, whose length the evaluations decide: one count per
    epoch (``epoch 3 (of at most 50)``), restarted at each epoch's end, over the bar of
    :func:`progress_bar`. Local."""

    def __init__(self, steps_per_epoch: int, max_epochs: int, initial: int):
        self.spe, self.max_epochs = steps_per_epoch, max_epochs
        self.epoch = initial // steps_per_epoch
        self.bar = progress_bar(steps_per_epoch, initial % steps_per_epoch, self._desc())
        self.disp = getattr(self.bar, "disp", None)          # a tqdm bar (the worker's test for one)

    def _desc(self) -> str:
        return f"epoch {self.epoch + 1} (of at most {self.max_epochs})"

    def update(self, n: int = 1) -> None:
        self.bar.update(n)
        if self.bar.n >= self.spe:
            self.epoch += 1
            self.bar.reset(total=self.spe)
            self.bar.set_description(self._desc(), refresh=False)

    def set_postfix(self, post: dict, refresh: bool = False) -> None:
        self.bar.set_postfix(post, refresh=refresh)

    def close(self) -> None:
        self.bar.close()


def peak_rss() -> int:
    """This process's peak resident set in bytes (Linux ru_maxrss is in KiB). Local."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Telemetry:
    """A worker's counters between two metrics records. Local."""

    def __init__(self, tables, embs, num_ps: int, batch_size: int, start: int):
        self.tables, self.embs, self.num_ps, self.batch_size = tables, embs, num_ps, batch_size
        self.timing = dict.fromkeys(PHASES, 0.0)
        self.spent = dict.fromkeys(PHASES, 0.0)     # the same over the whole run (the monitor's figures)
        self.stale_counts = {}
        self.totals = {}                    # pipeline counts over the whole run
        self.last_step, self.last_t = start, time.perf_counter()
        self.loss_acc, self.n_acc = 0.0, 0
        self._mark_tables()

    def _mark_tables(self) -> None:
        self._table_s = [(t.traffic.pull_seconds, t.traffic.push_seconds) for t in self.tables]

    def add(self, times: dict, stale: int, loss: float, samples: int) -> None:
        """One step's phase times, staleness seen, summed loss and samples. Local."""
        for k, v in times.items():
            self.timing[k] += v
            self.spent[k] += v
        self.stale_counts[stale] = self.stale_counts.get(stale, 0) + 1
        self.loss_acc += loss
        self.n_acc += samples

    def monitor_figures(self, steps_done: int, control) -> tuple:
        """``(steps done, seconds waiting on others, of which for pulls and pushes, seconds of fence
        wait on each PS, bytes pulled from and pushed to each PS)`` over the whole run, for
        :class:`hpcps.monitor.monitor.Monitor`. Local."""
        sp = self.spent
        return (steps_done, sp["idle"] + sp["pull"] + sp["push"] + sp["dense_allreduce"], sp["pull"] + sp["push"],
                control.wait_by_ps.copy(), [sum(t.traffic.bytes_per_ps[p] for t in self.tables) for p in range(self.num_ps)])

    def record(self, step: int, stale: int) -> dict:
        """The metrics record of the steps since the last one (``step`` steps done), and reset. Local."""
        now = time.perf_counter()
        n = max(step - self.last_step, 1)
        rate = (step - self.last_step) * self.batch_size / max(now - self.last_t, 1e-9)
        tables = self.tables
        rec = {"step": step, "loss": self.loss_acc / max(self.n_acc, 1), "samples_per_s": rate,
               "staleness": stale,
               "pull_ms": 1e3 * sum(t.traffic.pull_seconds - p[0] for t, p in zip(tables, self._table_s)) / n,
               "push_ms": 1e3 * sum(t.traffic.push_seconds - p[1] for t, p in zip(tables, self._table_s)) / n,
               "rows_per_ps": [int(sum(t.traffic.rows_per_ps[p] for t in tables)) for p in range(self.num_ps)],
               "bytes_per_ps": [int(sum(t.traffic.bytes_per_ps[p] for t in tables)) for p in range(self.num_ps)],
               "staleness_counts": {str(k): v for k, v in sorted(self.stale_counts.items())},
               **pipeline_rates(self.embs, self.totals),
               "time_breakdown_s": {k: round(v, 6) for k, v in self.timing.items()}}
        self.timing = dict.fromkeys(self.timing, 0.0)
        self.stale_counts = {}
        self._mark_tables()
        self.last_step, self.last_t, self.loss_acc, self.n_acc = step, now, 0.0, 0
        return rec
