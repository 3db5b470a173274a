"""Checkpoints of a training job: where they go, which one a job resumes from, and when workers
take one (``every_steps``, ``every_seconds``, a stop request)."""

import dataclasses
import json
import logging
import os
import stat
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from .. import checkpoint as ckpt_mod
from ..checkpoint.lock import DirLock
from ..config import Config, parse_permissions
from ..core.wait import quiet_barrier, wait_request
from ..core.errors import HpcpsError
from .compat import check_same_data, check_same_dense_optimizer, check_same_model

__all__ = ["open_checkpointer", "find_resume", "pick_level", "load_level", "CheckpointTrigger", "record_start"]

logger = logging.getLogger(__name__)


def open_checkpointer(cfg: Config, ctx, tables, layout=None, ids=None):
    """The job's :class:`hpcps.checkpoint.Checkpointer` (None without ``checkpoint.dir``); the
    directory is made by world rank 0 with ``checkpoint.dir_mode``. ``layout``: the input's columns
    (``hpcps.data.columns.Layout``) for the manifest, where the data has one (``hpcps ckpt export
    --format torchscript`` hashes raw columns by it). Collective over the world."""
    c = cfg.checkpoint
    if not c.dir:
        return None
    dir_mode = parse_permissions(c.dir_mode, "checkpoint.dir_mode")
    file_mode = parse_permissions(c.file_mode, "checkpoint.file_mode")
    lock, failed = DirLock(c.dir), None
    if ctx.world.Get_rank() == 0:
        try:
            Path(c.dir).mkdir(mode=dir_mode, parents=True, exist_ok=True)
            _check_writable(Path(c.dir))
            lock.acquire()
        except (OSError, ValueError) as e:
            failed = e
        mode = Path(c.dir).stat().st_mode if failed is None else 0
        if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
            logger.warning("hpcps: checkpoint.dir %s is writable by every user (mode %o): another user could "
                           "replace or plant checkpoints there; chmod o-w it", c.dir, stat.S_IMODE(mode))
    failed = ctx.world.bcast(failed, root=0)          # every rank stops alike, before training
    if failed is not None:
        raise ValueError(str(failed))
    if c.local_dir:                                   # every host's first rank makes its local directory
        local_failed = None
        if ctx.node_comm.Get_rank() == 0:
            try:
                Path(c.local_dir).mkdir(mode=dir_mode, parents=True, exist_ok=True)
                _check_writable(Path(c.local_dir), "checkpoint.local_dir")
                local_root(c).mkdir(mode=dir_mode, exist_ok=True)
            except OSError as e:
                local_failed = f"{e} (host {ctx.rank})"
        local_failed = [f for f in ctx.world.allgather(local_failed) if f]
        if local_failed:
            raise ValueError(local_failed[0])
    about = {"config": cfg.to_dict()}                 # what hpcps predict needs of the input, in each manifest
    if layout is not None:
        about["layout"] = dataclasses.asdict(layout)
    if ids is not None:
        about["ratings_ids"] = ids
    ckpt = ckpt_mod.Checkpointer(ctx, tables, c.dir, c.keep, c.compression, about,
                                 full_every=c.full_every, dir_mode=dir_mode, file_mode=file_mode,
                                 local_dir=local_root(c) if c.local_dir else "", local_keep=c.local_keep,
                                 local_full_every=c.local_full_every if c.local_every else 1)
    ckpt.lock = lock
    ctx.add_resource(ckpt)
    return ckpt


def local_root(c) -> Path:
    """This job's node-local directory: its own in ``checkpoint.local_dir`` (``local.job_root``). Local."""
    return ckpt_mod.local.job_root(c.local_dir, c.dir)


def _check_writable(root: Path, key: str = "checkpoint.dir") -> None:
    """Raise ``OSError`` naming ``root`` unless a file can be made there: before training, not at the
    first checkpoint."""
    probe = root / f".hpcps-write-test-{os.getpid()}"
    try:
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise OSError(e.errno, f"{key} {root} is not writable ({e.strerror}): checkpoints could not be "
                               f"saved") from None


def find_resume(cfg: Config, world: MPI.Comm):
    """The checkpoint to resume from (``checkpoint.resume``), or None; rank 0 looks, every rank
    gets its answer or its ``ValueError``. Collective over ``world``."""
    c = cfg.checkpoint
    if not c.dir and c.resume in ("none", "auto"):
        return None
    found = None
    if world.Get_rank() == 0:
        try:
            found = _earlier_run(c) if c.resume == "none" else ckpt_mod.resolve(c.resume, c.dir)
        except ValueError as e:
            found = e
    quiet_barrier(world)              # the others sleep while rank 0 verifies
    found = world.bcast(found, root=0)
    if isinstance(found, ValueError):
        raise found
    return found


def _earlier_run(c) -> None:
    """``checkpoint.resume = "none"``: a ``ValueError`` where ``checkpoint.dir`` holds an earlier
    run's checkpoints (this run's would mix with them: a restart resumes the newest step, pruning
    keeps the newest steps of either run). Local."""
    found = ckpt_mod.list_checkpoints(c.dir) if Path(c.dir).is_dir() else []
    if found:
        raise ValueError(f"checkpoint.resume = none, but checkpoint.dir {c.dir} holds {len(found)} checkpoint(s) of an "
                         f"earlier run (newest {found[-1].name}): this run's would mix with them (a restart resumes "
                         f"the newest step); use an empty checkpoint.dir, or move those away")


def pick_level(cfg: Config, ctx, tables):
    """The checkpoint a restart loads: ``(path, own shard files or None, level)`` (level ``"local"``,
    ``"pfs"`` or None: a fresh start). The node-local level (``checkpoint.local_dir``, rebuilt from
    partner copies where a host lost its files) when its newest complete step is at least the
    filesystem's; the filesystem's checkpoints are verified only when one is newer. Collective
    over the world."""
    c, world = cfg.checkpoint, ctx.world
    found = None
    if c.local_dir and c.resume == "auto":
        found = ckpt_mod.find_local(ctx, local_root(c), c.dir, ckpt_mod.sharding_names(tables), c.local_keep,
                                    parse_permissions(c.file_mode, "checkpoint.file_mode"))
    if found is None:
        pfs = find_resume(cfg, world)
        _drop_local_after(cfg, ctx, int(ckpt_mod.read_manifest(pfs)["step"]) if pfs is not None else 0)
        return pfs, None, "pfs" if pfs is not None else None
    newer = world.bcast(any(int(p.name.split("-")[1]) > found.step for p in ckpt_mod.list_checkpoints(c.dir))
                        if world.Get_rank() == 0 else None, root=0)
    pfs = None
    if newer:
        try:
            pfs = find_resume(cfg, world)
        except ValueError as e:            # every newer one broken: the local level is good
            if world.Get_rank() == 0:
                logger.warning("hpcps: %s", e)
    pfs_step = int(ckpt_mod.read_manifest(pfs)["step"]) if pfs is not None else -1
    if pfs_step > found.step:
        _drop_local_after(cfg, ctx, pfs_step)
        return pfs, None, "pfs"
    _drop_local_after(cfg, ctx, found.step)
    if world.Get_rank() == 0 and found.rebuilt:
        logger.warning("hpcps: local checkpoint step %d: %d file(s) copied from other hosts (partner copies)",
                       found.step, found.rebuilt)
    return found.path, found.own, "local"


def load_level(cfg: Config, ctx, tables) -> tuple:
    """Pick the checkpoint level (:func:`pick_level`) and load the PS ranks' rows from it:
    ``(path, level, step)`` (``(None, None, 0)``: a fresh start). A PS's node-local file that fails
    its check while it loads is set aside (``<part>.bad``) and the choice made again: the partner
    copy, an older step or the filesystem, which overwrite every row. Collective over the world."""
    world, failed = ctx.world, False
    while True:
        path, own, level = pick_level(cfg, ctx, tables)
        if path is None and failed:
            raise HpcpsError("a node-local checkpoint file failed its check while loading and no other "
                             "checkpoint is left; its rows are partly loaded: start afresh with "
                             "checkpoint.resume = none")
        if path is None:
            return None, None, 0
        manifest = ckpt_mod.read_manifest(path)
        if cfg.checkpoint.resume == "auto":
            check_same_data(cfg, manifest, path)     # alike on every rank
        check_same_model(cfg, manifest, path)
        check_same_dense_optimizer(cfg, manifest, path)
        bad = None
        try:
            start = ckpt_mod.restore_tables(path, ctx, tables, own)
        except ckpt_mod.CorruptFile as e:
            bad = e
            logger.error("hpcps: %s; setting that local checkpoint part aside", e)
            ckpt_mod.local.set_aside(Path(e.path).parent)
        quiet_barrier(world)                       # the others sleep while the PS ranks load
        if not any(world.allgather(bad is not None)):
            return path, level, start
        failed = True
        if world.Get_rank() == 0:
            logger.warning("hpcps: a node-local file failed its check while loading: choosing again")


def _drop_local_after(cfg: Config, ctx, step: int) -> None:
    """Each host's first rank: the job goes on from ``step``; its node-local parts of later steps
    are of an abandoned run (their pruning would count them). Local; the ranks of a host wait for it."""
    c = cfg.checkpoint
    if c.local_dir:
        if ctx.node_comm.Get_rank() == 0:
            ckpt_mod.local.drop_after(local_root(c), step, str(Path(c.dir).resolve()))
        ctx.node_comm.Barrier()


def _record_stop(root: Path, step: int, alert: dict | None = None) -> None:
    """Worker 0, after a stop's checkpoint committed: ``<dir>/STOPPED`` says so (step, time, Slurm
    job, the alert that stopped it), for a batch script that sees the ranks' exit codes mixed with
    srun's signals. An alert that suggests a layout also writes ``<dir>/LAYOUT`` (``{"job.num_ps":
    N, "alert": ...}``), which ``slurm/train.sbatch`` follows on every later run."""
    record = {"step": step, "time": time.time(), "slurm_job": os.environ.get("SLURM_JOB_ID")}
    if alert is not None:
        record["alert"] = alert
    _write_json(root, "STOPPED", record)
    if alert is not None and alert.get("suggest_num_ps"):
        _write_json(root, "LAYOUT", {"job.num_ps": alert["suggest_num_ps"], "step": step, "alert": alert["message"]})


def _write_json(root: Path, name: str, record: dict) -> None:
    ckpt_mod.store.write_new(root / f"{name}.tmp", json.dumps(record) + "\n")
    os.replace(root / f"{name}.tmp", root / name)


def record_start(cfg: Config, world: MPI.Comm) -> None:
    """Once every rank is up: ``<checkpoint.dir>/STARTED`` (time, Slurm job, every rank's host and
    process id, by world rank), which ``slurm/train.sbatch`` waits for to tell a launch stuck in
    ``MPI_Init`` from a slow one, and with which a user signals this job's processes alone.
    Collective over ``world`` (with a checkpoint directory)."""
    if not cfg.checkpoint.dir:
        return
    where = world.gather((MPI.Get_processor_name(), os.getpid()), root=0)
    if world.Get_rank() == 0:
        text = json.dumps({"time": time.time(), "slurm_job": os.environ.get("SLURM_JOB_ID"), "ranks": world.Get_size(),
                           "hosts": [h for h, _ in where], "pids": [p for _, p in where]})
        ckpt_mod.store.write_new(Path(cfg.checkpoint.dir) / "STARTED", text + "\n")


class CheckpointTrigger:
    """When the workers take checkpoints and stop: after a step, every ``checkpoint.every_steps``
    steps, when worker 0 saw ``checkpoint.every_seconds`` pass, or on a stop request (a signal to
    any worker or PS rank, or a ``STOP`` file). Every decision is agreed over the worker
    communicator from values all workers share (the step and an all-reduce of the flags), never
    from one rank's timing. Without a checkpoint directory a stop request is looked at every
    ``STOP_EVERY`` steps, through a non-blocking all-reduce completed at the next look (nobody
    waits in it), and ends the job without saving within ``2 x STOP_EVERY`` steps. Local to a
    worker, its calls collective over the workers."""

    STOP_EVERY = 10

    def __init__(self, cfg: Config, ckpt, stop, comm: MPI.Comm, lead: bool, start: int, control=None):
        self.c, self.ckpt, self.stop, self.comm, self.lead = cfg.checkpoint, ckpt, stop, comm, lead
        self.on_alert = cfg.monitor.on_alert
        self.control = control          # the step protocol, for a stop asked of a PS rank
        self.meta = lambda step: {}     # what the checkpoint at a step adds to its manifest (worker 0's view)
        self.last_time, self.last_step, self.stopped = time.time(), start, False
        self.alert = None               # worker 0: the alert that asks to stop (monitor.on_alert)
        self.num_ps = cfg.job.num_ps
        self.rebalance_to = None        # worker 0: the PS count a stop to rebalance asks for
        self._flags = np.zeros(3, np.int64)
        self._req = None
        self.local_due = False          # a node-local checkpoint fell due and is not taken yet
        self.local_deferred = 0         # steps a due node-local checkpoint waited for the previous one

    def _asked_here(self) -> bool:
        """A stop asked of this worker (a signal, the STOP file), or, seen by worker 0, of a PS. Local."""
        if self.lead and self.alert is not None:
            return True
        return self.stop.requested() or (self.lead and self.control is not None and self.control.ps_asked_to_stop())

    def _agreed(self) -> np.ndarray:
        """``[stop asked, time for a checkpoint, a checkpoint in flight]`` as every worker flagged them at the previous
        call's end (:meth:`_flag`): the same on every worker. The all-reduce started then is
        complete by now (every worker started it), so nobody waits in it: a blocking all-reduce
        each step cost the main job a third of its throughput on 2 CPUs. Collective over the workers."""
        agreed = np.zeros(3, np.int64)
        if self._req is not None:
            wait_request(self._req, "the other workers' checkpoint and stop flags")
            agreed[:], self._req = self._result, None
        return agreed

    def _flag(self, timed: bool) -> None:
        """Start the all-reduce of this worker's flags, for the next :meth:`_agreed`. Collective over
        the workers."""
        busy = self.ckpt is not None and self.ckpt.in_flight()
        self._flags[:] = (int(self._asked_here()), int(timed), int(busy))
        self._result = np.zeros(3, np.int64)
        self._req = self.comm.Iallreduce(self._flags, self._result, op=MPI.MAX)

    def _poll_stop(self) -> bool:
        """Without a checkpoint: the stop flag all-reduced at the previous call (:meth:`_agreed`),
        and this call's started unless it says stop. Collective over the workers (the same calls on
        every worker)."""
        asked = bool(self._agreed()[0])
        if not asked:
            self._flag(False)
        return asked

    def after_step(self, step: int, steps: int, model, opt, log, taken: bool = False) -> bool:
        """After step ``step`` (0-based) of ``steps``: checkpoint if due (``taken``: one was taken at
        this step already); True when a stop request ends training (its checkpoint committed, if
        there is a checkpoint directory). Collective over the worker communicator."""
        ckpt, c = self.ckpt, self.c
        if step + 1 >= steps:
            return False
        if ckpt is None:
            if (step + 1) % self.STOP_EVERY == 0:
                self.stopped = self._poll_stop()
                if self.stopped:
                    logger.warning("hpcps: stop requested: stopping after step %d without a checkpoint "
                                   "(no checkpoint.dir: nothing is saved)", step + 1)
            return self.stopped
        ckpt.poll_commit()
        ckpt.lock.refresh()
        due = bool(c.every_steps) and (step + 1) % c.every_steps == 0
        flags = self._agreed()
        if (due or flags[:2].any()) and not taken:
            self.save(step + 1, model, opt, log)
        elif self._local_now(step, flags, taken):
            self.save(step + 1, model, opt, log, level="local")
        if flags[0]:
            self.stopped = True
            ckpt.wait_commit()
            if self.lead:
                _record_stop(Path(c.dir), step + 1, self.alert)
                self._consume_stop_file(step + 1)
        else:                      # after the save: a checkpoint just taken resets the clock
            self._flag(self.lead and c.every_seconds > 0 and time.time() - self.last_time >= c.every_seconds)
        return self.stopped

    def _consume_stop_file(self, step: int) -> None:
        """Worker 0, after a stop's checkpoint committed: say why the job ends, and remove the STOP
        file it stopped on (left there, it would stop the next run after its first step). Local."""
        stop_file, again = self.stop.stop_file, self.stop.rebalance_file
        why = f"the file {stop_file}" if stop_file is not None and stop_file.exists() else "a signal"
        if self.stop.rebalance():
            why, self.rebalance_to = f"the file {again}", self.num_ps + 1
            again.unlink(missing_ok=True)
        if self.alert is not None:
            why = f"monitor.on_alert = {self.on_alert}, after the {self.alert['rule']} alert"
            if self.on_alert == "rebalance":
                self.rebalance_to = self.alert["suggest_num_ps"]
        if stop_file is not None:
            stop_file.unlink(missing_ok=True)
        if self.rebalance_to is not None:
            logger.warning("hpcps: rebalance requested (%s): checkpoint of step %d committed in %s", why, step, self.c.dir)
            return
        logger.warning("hpcps: stop requested (%s): checkpoint of step %d committed in %s; exiting with code 85 "
                       "(a restart resumes from it)", why, step, self.c.dir)

    def _local_now(self, step: int, flags, taken: bool) -> bool:
        """Whether the node-local checkpoint is taken after ``step``: it falls due every
        ``checkpoint.local_every`` steps, and is taken at the first step from then on where no
        checkpoint was in flight at the previous step (the flag all workers agreed on): it never
        waits for the one before (a full one of a large shard takes seconds), it comes later.
        Local (from values every worker shares)."""
        c = self.c
        if c.local_every and (step + 1) % c.local_every == 0:
            self.local_due = True
        if not self.local_due or taken:
            return False
        if flags[2]:
            self.local_deferred += 1
            return False
        self.local_due = False
        return True

    def save(self, step: int, model, opt, log=None, level: str = "pfs") -> None:
        """The checkpoint after ``step`` steps, now (``level``: ``pfs`` or ``local``). Collective over
        the worker communicator."""
        self.ckpt.checkpoint(step, model, opt, self.meta(step), level)
        if level == "pfs":
            self.last_time, self.last_step = time.time(), step
        if log is not None:
            log.write({"checkpoint": step, "level": level, "stall_s": self.ckpt.stall_seconds[-1]})

    def finish(self, steps: int, start: int, model, opt) -> None:
        """At the end of training: the final checkpoint (unless a stop request took one, or the job
        had nothing to do), committed. Collective over the worker communicator."""
        self._agreed()                                   # a flags all-reduce still in flight ends here
        if self.ckpt is None or self.stopped:
            return
        if self.last_step != steps and steps > start:       # a finished job takes no new checkpoint
            self.save(steps, model, opt)
        self.ckpt.wait_commit()

    def release(self) -> None:
        """After the last checkpoint (or a stop's): this job writes no more; let another use the directory."""
        if self.ckpt is not None:
            self.ckpt.wait_commit()
            self.ckpt.lock.release()

    def summary(self) -> dict:
        """The final summary's checkpoint fields (worker 0). Local."""
        ckpt = self.ckpt
        return {"checkpoints": ckpt.committed if ckpt is not None else [],
                "local_checkpoints": ckpt.local_committed if ckpt is not None else [],
                "checkpoint_timings": ckpt.timings if ckpt is not None else [],
                "local_deferred_steps": self.local_deferred,
                "checkpoint_stall_s": max(ckpt.stall_seconds) if ckpt is not None and ckpt.stall_seconds else 0.0}
