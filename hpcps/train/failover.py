"""Live failover and rebalancing: a lost rank does not end the job, and an overloaded PS gets help,
with no new process: the survivors and the standby ranks go on.

Under an MPI with ULFM (Open MPI launched ``mpiexec --with-ft ulfm``; ``hpcps.core.faults``), or
with ``job.standby`` ranks, ``hpcps train`` runs the job through :func:`run`:

1. ``job.standby`` ranks of the launch are held back (``hpcps.core.layout.place_standby``: spread
   over the hosts, from the last); the others train as one job on a communicator of their own.
2. Every rank posts a :class:`hpcps.core.faults.FaultWatch` over the launch's live ranks; every
   wait of hpcps polls it. A standby only polls it, and a non-blocking broadcast of the end.
3. A rank lost (killed, its host gone): within ~0.2 s each survivor's watch, or an MPI call that
   involved the lost rank, raises. The survivor revokes every communicator of the job (a peer
   blocked in a collective with it leaves too), gives up its context without freeing it (its
   windows stay mapped until the process ends), and joins ``MPI_Comm_shrink``.
4. On the shrunk communicator the job is built again: as many ranks as before train (the standbys
   take the lost ranks' places; none left: the survivors alone, with fewer workers), and every
   rank resumes from the job's last checkpoint at any level, as a restart would
   (``checkpoint.resume = auto``): no new process, no requeue, torch already imported. Steps after
   that checkpoint are done again; in deterministic sync mode with a standby the run ends bit-equal
   to an uninterrupted one, as a restart onto the same PS and worker counts does. What a restore
   overwrites is not written first (the PS's initial rows and optimizer state: ``EmbeddingTable``'s
   ``fill``), and rank 0 does not hash again the checkpoint it committed itself
   (``hpcps.checkpoint.store.trust_own_commits``).

5. Rebalance (any MPI, any hosts): a stop whose checkpoint a PS overloaded alert asked for
   (``monitor.on_alert = rebalance``) or a ``REBALANCE`` file beside ``STOP`` (one PS more) ends
   ``train_fn`` with ``summary["rebalance"]``; standbys then become PS (as many as asked and left)
   and the job goes on from that checkpoint, resharded onto the new PS count. None left: the stop
   stands (exit 85, ``LAYOUT`` for the restart), with an ALERT.

Live failover works where the job's ranks share one host (``ACROSS_HOSTS`` says why); across hosts
under ULFM a lost rank ends the launch (``MPI_Abort``), the restart path. Each recovery and rebalance
is one log line and one record in the final summary (``recoveries``): the launch ranks lost, the
standbys that took over, the step it went on from, the steps done again, and the seconds from
detection to the next completed step.
"""

import dataclasses
import logging
import os
import time
import uuid
from pathlib import Path

from mpi4py import MPI

from ..checkpoint import store
from ..checkpoint.lock import set_job_token
from ..core import faults
from ..core.faults import ulfm_note
from ..core.layout import check_launch, place_standby
from ..runtime.context import abandon_open
from ..runtime.topology import node_keys

__all__ = ["live", "run", "note_start", "note_step", "prints_summary", "describe"]

logger = logging.getLogger(__name__)

ACROSS_HOSTS = ("live failover works where the job's ranks share one host for now: across hosts Open MPI's "
                "one-sided pushes (osc/rdma over TCP) can block for good on a lost target, and the PRRTE in the "
                "Open MPI 5.0 wheel ends the launch when a host's daemon is lost. Across hosts a lost rank ends "
                "the launch and the job recovers by restart from its last checkpoint")
STANDBY_NAP_S = 0.02            # a standby's sleep between two looks (it takes a core's 1-2% of a 2-core host)
_pending: dict | None = None    # the last recovery's record, until its next completed step
_t_detect = 0.0
_last_step = -1                 # the last step this rank completed (a worker), for steps_redone
_prints = None                  # whether this rank prints the final summary (None: world rank 0)
_standbys: list = []            # the launch ranks standing by now
_live_ok = False                # a lost rank is survived live (ULFM, one host)


def live(cfg) -> bool:
    """Whether ``train`` runs the job through :func:`run`: launched under ULFM, or with standbys (to
    rebalance). Local (alike on every rank)."""
    return faults.ulfm_launched() or bool(cfg is not None and cfg.job.standby)


def describe() -> str:
    """What a lost rank means for this job, for the layout line. Local."""
    n = len(_standbys)
    who = f"{n} standby rank{'s' * (n != 1)}" + (f" (launch {', '.join(map(str, _standbys))})" if n else "")
    if _live_ok:
        return f"live failover (ULFM), {who}"
    return ("the launch ends; restart from the last checkpoint (" + (
        "live failover: one host only" if faults.ulfm_launched() else "no ULFM") + ")"
        + (f"; {who} for rebalancing" if n else ""))


def prints_summary() -> bool:
    """Whether this rank prints the job's final summary: world rank 0, or after a loss the first
    rank of the job that finished. Local."""
    return MPI.COMM_WORLD.Get_rank() == 0 if _prints is None else _prints


def note_start(step: int) -> None:
    """The driver: this attempt goes on from ``step`` (after its checkpoint is loaded). Local."""
    if _pending is not None:
        _pending["from_step"] = int(step)
        _pending["ready_s"] = round(time.monotonic() - _t_detect, 3)     # rebuilt and restored
        _pending["steps_redone"] = max(0, _pending.pop("last_step_done", step) - int(step))
        if "lost_ranks" in _pending:            # every step after the checkpoint is done again
            done = _pending.pop("steps_done", [])
            _pending["pushes_redone"] = sum(max(0, d - int(step)) for d in done)    # the survivors'
            _pending["updates_lost"] = 0


def note_step(step: int) -> None:
    """The worker's loop, after each completed step: the first after a recovery closes its
    record (seconds from detection). Local."""
    global _pending, _last_step
    _last_step = step + 1
    if _pending is not None:
        _pending["seconds_to_next_step"] = round(time.monotonic() - _t_detect, 3)
        _pending = None


def _placed(world: MPI.Comm, launch: MPI.Comm) -> tuple:
    """``(each rank's node key, its launch rank)``. Collective over ``world``."""
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    keys = node_keys(world, node)
    node.Free()
    return keys, world.allgather(launch.Get_rank())


def run(cfg, train_fn):
    """``train_fn(cfg, comm)`` over the launch's ranks less ``job.standby``; again, in the same
    processes, over the survivors and the standbys whenever a rank is lost (live failover: ULFM, one
    host), or with more PS when the job stopped to rebalance (any MPI). Returns the final summary on
    every live rank. Collective over ``MPI.COMM_WORLD``."""
    global _prints, _standbys, _pending, _t_detect, _live_ok
    launch = MPI.COMM_WORLD
    check_launch(launch.Get_size(), os.environ, cfg.job.world_size or None)
    ulfm = faults.ulfm_launched()
    if ulfm:
        launch.Set_errhandler(MPI.ERRORS_RETURN)
    set_job_token(launch.bcast(uuid.uuid4().hex if launch.Get_rank() == 0 else None, root=0))
    world, attempt, recoveries = launch.Dup(), cfg, []
    nodes, ids = _placed(world, launch)                          # again only after a shrink
    live_ok = _live_ok = ulfm and len(set(nodes)) == 1           # alike on every rank
    if cfg.job.standby and not live_ok and launch.Get_rank() == 0:
        logger.warning("hpcps: job.standby = %d: for rebalancing only (monitor.on_alert = rebalance, or a "
                       "REBALANCE file): %s", cfg.job.standby, ACROSS_HOSTS if ulfm else ulfm_note())
    job_size, num_ps = launch.Get_size() - cfg.job.standby, cfg.job.num_ps
    while True:
        standby = place_standby(nodes, max(0, world.Get_size() - job_size))
        me = world.Get_rank()
        root = min(r for r in range(world.Get_size()) if r not in standby)
        _standbys = [ids[r] for r in standby]
        job = faults.track(world.Split(1 if me in standby else 0, key=me))
        every, watch = _watches(world, job, me in standby, ulfm)
        try:
            if me in standby:
                import torch  # noqa: F401 - what the job imports, imported while it waits
                from . import worker  # noqa: F401
            summary = None if me in standby else train_fn(attempt, job)
            summary = _wait_end(world, watch, summary, root)
        except Exception as e:                                   # noqa: BLE001 - a loss, or raised again
            if watch is None or not faults.loss_seen(e, grace_s=0.0 if isinstance(e, ValueError) else 2.0):
                raise                                            # an error alike on every rank, say
            if not live_ok:
                _end_launch(launch)
            world, record, nodes, ids = _recover(world, job, watch, every, ids, [ids[r] for r in standby])
            store.trust_own_commits()               # rank 0's last commit is not hashed again
            recoveries.append(record)
            attempt = _resumed(attempt)
            continue
        finally:
            faults.install(None)
        more = _rebalance_to(summary, num_ps, len(standby), world.Get_rank() == 0)
        if more:
            _pending, _t_detect = {"rebalanced_to_num_ps": num_ps + more, "last_step_done": summary["steps"],
                                   "standbys_taking_over": sorted(ids[r] for r in standby)[-more:]}, time.monotonic()
            recoveries.append(_pending)
            if world.Get_rank() == 0 and cfg.checkpoint.dir:         # the job goes on: it did not stop
                (Path(cfg.checkpoint.dir) / "STOPPED").unlink(missing_ok=True)
            num_ps, job_size = num_ps + more, job_size + more
            attempt = _resumed(dataclasses.replace(attempt, job=dataclasses.replace(attempt.job, num_ps=num_ps)))
            continue
        _prints = me == root
        if summary is not None and recoveries:
            summary["recoveries"] = recoveries
        return summary


def _watches(world: MPI.Comm, job: MPI.Comm, standing_by: bool, ulfm: bool):
    """``(every, watch)``: a :class:`FaultWatch` of every live rank, and the one this rank polls (a
    standby every rank's; a rank of the job only the job's: a standby lost while the job trains costs
    it nothing until its end, where :func:`_wait_end` sees it). ``(None, None)`` without ULFM.
    Collective over ``world``."""
    if not ulfm:
        return None, None
    every = faults.FaultWatch(world)
    watch = every if standing_by else faults.FaultWatch(job)
    faults.install(watch)
    return every, watch


def _end_launch(launch: MPI.Comm) -> None:
    """A rank lost where live failover does not work (across hosts): end the launch, as without ULFM
    (the restart path); the ranks waiting on the lost one would wait on. Local (aborts the launch)."""
    logger.error("hpcps: a rank of the job was lost; ending the launch for a restart from the last "
                 "checkpoint (live failover: one host only for now)")
    time.sleep(0.3)
    launch.Abort(1)


def _rebalance_to(summary, num_ps: int, standbys: int, says: bool) -> int:
    """How many PS to add now: the job stopped to rebalance (``summary["rebalance"]``: the PS count
    it asks for) with its checkpoint saved, and standbys are left to serve. With none left the stop
    stands (exit 85, for a restart with the layout in ``LAYOUT``), with an ALERT. Local (alike on
    every rank: the summary is every rank's)."""
    want = (summary or {}).get("rebalance")
    if not want or not summary.get("saved"):
        return 0
    more = min(int(want) - num_ps, standbys)
    if more <= 0 and says:
        logger.warning("hpcps: ALERT rebalance to %d PS asked, but no standby is left: the job stops with its "
                       "checkpoint (exit 85); restart it with --set job.num_ps=%d", int(want), int(want))
    elif says:
        logger.warning("hpcps: rebalancing: %d standby rank%s become%s PS (%d PS in all), going on from the "
                       "checkpoint of step %d without a restart", more, "s" * (more > 1), "" if more > 1 else "s",
                       num_ps + more, summary["steps"])
    return max(more, 0)


def _wait_end(world: MPI.Comm, watch, summary, root: int):
    """Every live rank: the job's summary from ``root`` (a standby waits here while the job runs,
    polling ``watch``). Collective over ``world``."""
    req = world.Ibarrier()
    while not req.Test():
        if watch is not None:
            watch.check()
        time.sleep(STANDBY_NAP_S if summary is None else 0.0005)
    return world.bcast(summary, root=root)


def _recover(world: MPI.Comm, job: MPI.Comm, watch, every, ids: list, standby_ids: list):
    """After a loss: revoke, give up the job, shrink. ``(survivors' communicator, the record, each
    survivor's node key, its launch rank)``. Collective over the survivors of ``world``."""
    global _pending, _t_detect
    t_detect = watch.seen_at or time.monotonic()
    faults.revoke_all(world, job, watch.comm, every.comm)
    abandon_open()
    survivors = world.Shrink()
    survivors.Set_errhandler(MPI.ERRORS_RETURN)
    nodes, now = _placed(survivors, MPI.COMM_WORLD)
    alive = set(now)
    lost = sorted(set(ids) - alive)
    lost_job = [r for r in lost if r not in standby_ids]        # a lost standby leaves the job as it was
    took_over = sorted(r for r in standby_ids if r in alive)[:len(lost_job)]
    done = survivors.allgather(_last_step)                      # a standby or PS: -1
    record = {"lost_ranks": lost, "standbys_taking_over": took_over, "last_step_done": max(done),
              "steps_done": done, "shrink_s": round(time.monotonic() - t_detect, 3)}
    _pending, _t_detect = record, t_detect
    if survivors.Get_rank() == 0:
        if not lost_job:
            what = "a standby: the job keeps its ranks"
        elif len(took_over) == len(lost_job):
            what = f"standby rank{'s' * (len(took_over) > 1)} {', '.join(map(str, took_over))} take" \
                   f"{'' if len(took_over) > 1 else 's'} over"
        else:
            what = "too few standbys left: the survivors go on with fewer ranks"
        logger.warning("hpcps: lost launch rank%s %s, %s; going on from the last checkpoint without a restart",
                       "s" * (len(lost) > 1), ", ".join(map(str, lost)), what)
    return survivors, record, nodes, now


def _resumed(cfg):
    """``cfg`` resuming from its job's last checkpoint (any level). Local."""
    if not cfg.checkpoint.dir:
        return cfg
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume="auto"))
