"""Taking a consistent checkpoint while training (loading one: :mod:`hpcps.checkpoint.restore`).

Protocol at a step boundary ``t`` (workers drive it, PS ranks follow from their serve loop):

1. every worker: ``fence(t)``: every push of steps ``< t`` is applied on every PS;
2. worker 0 creates ``step-t.tmp/`` and writes ``request = t`` into each PS's control words
   (once that PS published ``handled`` = the step asked before: one request word, none lost);
3. each PS copies its shards and optimizer state to memory, publishes ``copied = t``, and
   writes its HDF5 file from a background thread (``written = t``, or ``error = t``);
4. workers wait for ``copied = t`` on every PS (training pauses only for the copies), then go on;
   worker 0 copies the dense state and writes ``dense.h5`` from a thread;
5. worker 0 commits (checksums, manifest, fsync, rename, ``latest``, prune) once every file is
   written; the next checkpoint first waits for that.

No push is half inside a checkpoint: between 1 and 4 no worker pushes. In deterministic sync mode
rows change only in the PS's apply (pushes wait in the mailboxes), so steps 1 and 4 are skipped:
the PS cuts the checkpoint at step ``t`` just before it applies step ``t`` (``before_apply``), and
the workers pause only to copy the dense state.

A node-local checkpoint (``level="local"``: :mod:`hpcps.checkpoint.local`) runs the same cut; each
PS writes its shard into its host's ``local_dir``, sends it to its partner PS on another host
(:mod:`hpcps.checkpoint.partner`), and commits its part once its file and the partner copies it
received are written; each host's first worker writes and commits the dense part. It does not
wait for the one before: each PS cuts at once and writes its cuts in order
(:mod:`hpcps.checkpoint.ps_writer`), and worker 0 keeps up to ``LOCAL_QUEUE`` in flight.
"""

import importlib.metadata
import logging
import platform
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np
from mpi4py import MPI

from .._version import __version__
from ..core.wait import overdue
from ..core.errors import HpcpsError
from ..core.window import Window
from . import local, store
from .partner import Partners
from .ps_writer import (COPIED, DELTA, ERROR, FULL, HANDLED, KIND, LOAD, LOADED, LOCAL, LOCAL_DELTA, REQUEST, WORDS, WRITTEN,
                        PsWriter, links)
from .shards import Background, write_dense

__all__ = ["Checkpointer", "sharding_names"]

logger = logging.getLogger(__name__)


class Checkpointer(PsWriter):
    """Checkpoint coordination for one job (the PS side: :class:`~hpcps.checkpoint.ps_writer.PsWriter`).
    Collective over the world (creates a window)."""

    LOCAL_QUEUE = 16    # node-local checkpoints in flight at most; one due beyond waits (local_deferred_steps)

    def __init__(self, ctx, tables, root, keep: int, compression: str, meta: dict, full_every: int = 1,
                 dir_mode: int = store.DIR_MODE, file_mode: int = store.FILE_MODE, local_dir: str = "",
                 local_keep: int = 2, local_full_every: int = 1):
        self.ctx, self.tables, self.root = ctx, tables, Path(root)
        self.local_dir, self.local_keep = (Path(local_dir) if local_dir else None), local_keep
        self.holder = ctx.is_worker and ctx.rank == ctx.node_workers[0]    # writes this host's dense part
        # the ranks of this host that write node-local parts (pruning counts a step once all did)
        self.local_writers = sorted({r for r in ctx.node_ranks if r in set(ctx.ps_world_ranks)} | set(ctx.node_workers[:1]))
        self.partners = Partners(ctx, file_mode) if ctx.is_ps and self.local_dir else None
        self._local_pending = None    # a host's first worker: the local step its dense part is being written for
        self._dense_writer = None     # ... and the thread writing it
        self._rng_req = None          # workers: the all-gather of the RNG states in flight
        self._deferred = None         # worker 0 / a host's first worker: the dense file waiting for them
        self.local_committed = []     # worker 0: committed local steps
        self.local_full_every = max(1, int(local_full_every))   # 1: every node-local checkpoint is full
        self._local_since = None      # workers: local checkpoints since the last full one (None: next is full)
        self._local_chain = []        # workers: steps the newest local checkpoint builds on, itself last
        self._local_inflight = deque()    # worker 0: local steps asked for, not committed yet
        self._local_info = {}         # worker 0: local step -> [kind, time asked, stall]
        self.dir_mode, self.file_mode = dir_mode, file_mode
        self.keep, self.compression, self.meta = keep, compression, meta
        self.full_every = max(1, int(full_every))   # 1: every checkpoint is full
        if (self.full_every > 1 or self.local_full_every > 1 and self.local_dir) and not all(t.track_dirty for t in tables):
            raise ValueError("incremental checkpoints need tables created with track_dirty=True")
        self._since_full = None                     # worker 0: checkpoints since the last full one
        self._last = None                           # worker 0: name of the last committed checkpoint
        self._base = None                           # worker 0: name of the last full checkpoint
        self._win = Window(ctx.world, 8 * WORDS if ctx.is_ps else 0, what="checkpoint control")
        # deterministic sync mode: rows change only in the PS's apply, so the PS cuts the checkpoint
        # before the next apply and the workers need not wait for its copy (hpcps.sparse.push)
        self.early = ctx.deterministic and ctx.control.kind == "sync"
        self._mine = self._win.local(np.int64) if ctx.is_ps else None     # PS: its words, this memory
        self._handled = -1            # PS: last request cut
        self._asked = None            # worker 0: the last step asked for
        if ctx.is_ps:
            self._ps_start()
            self._mine[:] = -1
            self._win.sync()
            ctx.add_service_hook(self._ps_poll, "checkpoint")
            if self.early:
                # first: the cut sees no push of the step (a dynamic table applies its own in a hook)
                ctx.control.before_apply.insert(0, self._ps_before_apply)
        self._res = np.zeros(1, np.int64)
        self._ign = np.zeros(1, np.int64)
        self._writer = None           # PS or worker 0: the thread writing the current file
        self._pending = None          # worker 0: step written but not committed yet
        self._step_meta = {}          # worker 0: what the checkpoint in flight adds to its manifest
        self.stall_seconds = []       # workers: pause per checkpoint
        self.timings = []             # worker 0: {"step", "kind", "bytes", "stall_s", "write_s"} per commit
        self._started = {}            # worker 0: step -> time of its request
        self.committed = []           # worker 0: committed steps
        self.resumed_step = None      # the step this run resumed from: older checkpoints of earlier runs may be pruned
        self.is_lead = ctx.is_worker and ctx.worker_rank == 0
        ctx.world.Barrier()

    # -------------------------------------------------------------- control words
    def _get(self, rank, word):
        if rank == self.ctx.rank and self._mine is not None:   # a PS's own words: a load after a barrier
            self._win.sync()
            return int(self._mine[word])
        win = self._win.win
        win.Get_accumulate([self._ign, MPI.INT64_T], [self._res, MPI.INT64_T], rank,
                           (word * 8, 1, MPI.INT64_T), op=MPI.NO_OP)
        win.Flush(rank)
        return int(self._res[0])

    def _put(self, rank, word, value):
        if rank == self.ctx.rank and self._mine is not None:   # the serve loop reads these dozens of times a step
            self._mine[word] = value
            self._win.sync()
            return
        win = self._win.win
        win.Accumulate([np.array([value], np.int64), MPI.INT64_T], rank, (word * 8, 1, MPI.INT64_T),
                       op=MPI.REPLACE)
        win.Flush(rank)

    def _job_fields(self, step: int) -> dict:
        """What every manifest says of the job: step, layout, tables, placement, versions."""
        return {"step": step, "time": time.time(), "num_ps": self.ctx.num_ps, "num_workers": self.ctx.num_workers,
                "checkpoint_dir": str(self.root.resolve()),
                "tables": [{"name": t.name, "num_rows": t.num_rows, "dim": t.dim, "optimizer": repr(t.optimizer),
                            **({"segments": [list(x) for x in t.segments]} if t.segments else {}),
                            **({"dynamic": True} if getattr(t, "dynamic", False) else {})}
                           for t in self.tables],
                "sharding": sharding_names(self.tables), "host": platform.node(), "versions": _versions()}

    # -------------------------------------------------------------- worker side
    def checkpoint(self, step: int, model, optimizer, meta: dict | None = None, level: str = "pfs") -> None:
        """Take the checkpoint of the state after ``step`` steps; ``meta`` (worker 0's) goes into its
        manifest. ``level``: ``"pfs"`` (``root``) or ``"local"`` (``local_dir`` on every host, PS
        shards copied to partners). Collective over the worker communicator."""
        t0 = time.perf_counter()          # the stall counts a wait for the previous checkpoint too
        local_level = level == "local"
        if local_level:                   # cut now; the files are written after those before it
            self._local_room()
        else:
            self.wait_commit()
        if not self.early:
            self.ctx.fence(step)
        if self.is_lead:
            if local_level:
                kind = "local-delta" if self._local_next_delta() else "local"
                self._local_inflight.append(step)
                self._local_info[step] = [kind, time.perf_counter(), 0.0]
            else:
                self._step_meta, self._started[step] = meta or {}, time.perf_counter()
                tmp = store.tmp_dir(self.root, step)
                if tmp.exists() or tmp.is_symlink():
                    store.remove_tree(tmp)           # an unfinished one (a link planted there is unlinked)
                tmp.mkdir(mode=self.dir_mode, parents=True)
                tmp.chmod(self.dir_mode)            # exactly the configured mode, whatever the umask
                delta = self._since_full is not None and self._since_full + 1 < self.full_every
                self._kind = "delta" if delta else "full"
            word = {"local": LOCAL, "local-delta": LOCAL_DELTA}[kind] if local_level else \
                {"full": FULL, "delta": DELTA}[self._kind]
            for r in self.ctx.ps_world_ranks:
                self._wait_handled(r)
                self._put(r, KIND, word)
                self._put(r, REQUEST, step)
            self._asked = step
        if local_level:                 # every worker follows the chain (a host's first one writes it down)
            delta = self._local_next_delta()
            self._local_since = self._local_since + 1 if delta else 0
            self._local_chain = [*self._local_chain, step] if delta else [step]
        self._gather_rngs()
        if not self.early:
            self._wait_copied(step)
        if self.is_lead or (local_level and self.holder):
            dense = self._dense_state(model, optimizer, step)
            if local_level:         # every worker has ``meta`` (the evaluations' state is shared)
                tmp = local.part_tmp(self.local_dir, step, self.ctx.rank)
                tmp.mkdir(mode=self.dir_mode, parents=True, exist_ok=True)
                self._deferred = ("local", tmp / "dense.h5", step, dense)
                self._local_pending, self._local_meta = step, meta or {}
            else:
                self._deferred = ("pfs", store.tmp_dir(self.root, step) / "dense.h5", step, dense)
                self._pending = step
            self._start_dense(block=False)
        self.stall_seconds.append(time.perf_counter() - t0)
        if self.is_lead and local_level:
            self._local_info[step][2] = self.stall_seconds[-1]
        if not self.early:             # the workers leave the cut together (they waited for the copies)
            self.ctx.worker_comm.Barrier()

    def _local_next_delta(self) -> bool:
        """Whether the next node-local checkpoint holds only the rows changed since the previous
        one (``local_full_every`` > 1; the first one of a run is full). Local."""
        return self._local_since is not None and self._local_since + 1 < self.local_full_every

    def in_flight(self) -> bool:
        """Whether a node-local checkpoint due now would wait: worker 0 has ``LOCAL_QUEUE`` in
        flight. Local."""
        return len(self._local_inflight) >= self.LOCAL_QUEUE

    def _local_room(self) -> None:
        """Before a node-local checkpoint: this host's previous dense part committed (a few MB,
        written since), and worker 0 has fewer than ``LOCAL_QUEUE`` in flight. Local."""
        self._start_dense(block=True)
        self._commit_dense_part(block=True)
        if self.is_lead:
            self._drain_local(block=False)
            while len(self._local_inflight) >= self.LOCAL_QUEUE:
                time.sleep(0.001)
                self._drain_local(block=False)

    def _drain_local(self, block: bool) -> bool:
        """Worker 0: record the node-local checkpoints every PS committed, oldest first; True when
        none is left in flight (``block``: wait for them). Local."""
        while self._local_inflight:
            step = self._local_inflight[0]
            if not self._ps_done(step):
                if not block:
                    return False
                time.sleep(0.001)
                continue
            self._local_inflight.popleft()
            kind, asked, stall = self._local_info.pop(step)
            self.local_committed.append(step)
            self.timings.append({"step": step, "kind": kind, "bytes": None, "stall_s": stall,
                                 "write_s": time.perf_counter() - asked})
        return True

    def _wait_handled(self, r: int) -> None:
        """Worker 0, before asking PS world rank ``r`` for a checkpoint: until it cut the one asked
        before. A PS reads one request word; in deterministic sync mode workers do not wait for the
        copy, and a request written over one not yet cut would lose that cut on this PS alone (its
        partner copies would then pair with the wrong steps)."""
        misses, started = 0, time.monotonic()
        while self._asked is not None and self._get(r, HANDLED) < self._asked:
            time.sleep(0.0002)
            misses += 1
            overdue(started, misses, f"checkpoint at step {self._asked}: PS world rank {r} has not cut it")

    def _wait_copied(self, step: int) -> None:
        """Until every PS copied its shards for the checkpoint at ``step``."""
        for r in self.ctx.ps_world_ranks:
            misses, started = 0, time.monotonic()
            while self._get(r, COPIED) < step:
                if self._get(r, ERROR) >= step:
                    raise HpcpsError(f"checkpoint at step {step} failed on PS world rank {r} (see its log)")
                time.sleep(0.0005)      # not spinning: leave the cores to the PS ranks copying
                misses += 1
                overdue(started, misses, f"checkpoint at step {step}: PS world rank {r} has not copied its shards")

    def _gather_rngs(self) -> None:
        """Start gathering every worker's torch RNG state for the dense file (a non-blocking
        all-gather, completed by :meth:`_start_dense`: no worker waits for another here).
        Collective over the workers."""
        import torch
        mine = torch.get_rng_state().numpy()
        self._rng_mine = mine
        self._rngs = np.empty((self.ctx.num_workers, mine.size), np.uint8)
        self._rng_req = self.ctx.worker_comm.Iallgather([mine, MPI.BYTE], [self._rngs, MPI.BYTE])

    def _start_dense(self, block: bool) -> bool:
        """Once the RNG states are in, start writing the dense file taken at the cut (worker 0, and
        for the local level each host's first worker); every worker completes its part of the
        all-gather here. False while it is not in yet (``block``: wait for it). Local."""
        if self._rng_req is not None:
            if not (self._rng_req.Wait() if block else self._rng_req.Test()):
                return False
            self._rng_req = None
        if self._deferred is not None:
            level, path, step, (model_state, optim_state, extra) = self._deferred
            self._deferred = None
            extra = {**extra, "torch_rng": self._rngs}
            writer = Background(write_dense, path, step, model_state, optim_state, extra, self.file_mode,
                                local.ALGO if level == "local" else "sha256")
            if level == "local":
                self._dense_writer = writer
            else:
                self._writer = writer
        return True

    def _dense_state(self, model, optimizer, step: int):
        """``(model arrays, optimizer state, extra)`` of :func:`write_dense`: copies, taken now (the
        RNG states are added once gathered)."""
        import torch
        model_state = {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}
        osd = optimizer.state_dict()
        optim_state = {"state": {i: {k: (v.detach().cpu().numpy().copy() if torch.is_tensor(v) else v)
                                     for k, v in st.items()} for i, st in osd["state"].items()},
                       "param_groups": osd["param_groups"]}
        extra = {"next_step": np.array(step), "worker_positions": np.full(self.ctx.num_workers, step, np.int64)}
        return model_state, optim_state, extra

    def _commit_dense_part(self, block: bool) -> bool:
        """A host's first worker: commit its local dense part once written. Local."""
        if self._local_pending is None:
            return True
        w = self._dense_writer
        if w is None:                   # not started yet: the RNG states were not in
            return False
        if w.is_alive():
            if not block:
                return False
            w.join()
        step, self._local_pending, self._dense_writer = self._local_pending, None, None
        if w.error is not None:
            raise HpcpsError(f"local checkpoint at step {step}: writing dense.h5 failed: {w.error}") from w.error
        local.commit_part(self.local_dir, step, self.ctx.rank,
                          {**self.meta, **self._local_meta, **self._job_fields(step), **links(self._local_chain),
                           "shards": [], "dense": True}, self.local_keep, self.file_mode,
                          writers=self.local_writers)
        return True

    def _ps_done(self, step: int) -> bool:
        """Worker 0: whether every PS wrote its file (and, local, its partner copies) for ``step``."""
        done = True
        for r in self.ctx.ps_world_ranks:
            if self._get(r, ERROR) >= step:
                raise HpcpsError(f"checkpoint at step {step}: PS world rank {r} could not write its "
                                 f"file (see its log); the previous checkpoint is intact")
            done = done and self._get(r, WRITTEN) >= step
        return done

    def poll_commit(self, block: bool = False) -> bool:
        """Commit the checkpoint in flight once every file is written (worker 0; a host's first
        worker commits its local part). Local."""
        if not self._start_dense(block) or not self._commit_dense_part(block):
            return False
        if not self.is_lead:
            return True
        if not self._drain_local(block) and self._pending is None:
            return False
        if self._pending is None:
            return True
        step = self._pending
        while True:
            done = self._writer is None or not self._writer.is_alive()
            if self._ps_done(step) and done:
                break
            if not block:
                return False
            time.sleep(0.001)
        if self._writer is not None and self._writer.error is not None:
            raise HpcpsError(f"checkpoint at step {step}: writing dense.h5 failed: {self._writer.error}; "
                             f"the previous checkpoint is intact") from self._writer.error
        self._writer = None
        name = store.step_dir(self.root, step).name
        kind = self._kind
        link = {"kind": kind, "parent": self._last if kind == "delta" else None,
                "base": self._base if kind == "delta" else name}
        manifest = {**self.meta, **self._step_meta, **link, **self._job_fields(step)}
        final = store.commit(self.root, step, manifest, self.keep, self.file_mode, prunable=self._prunable)
        self.committed.append(step)
        nbytes = sum(f["bytes"] for f in store.read_manifest(final)["files"].values())
        self.timings.append({"step": step, "kind": kind, "bytes": nbytes, "stall_s": self.stall_seconds[-1],
                             "write_s": time.perf_counter() - self._started.pop(step)})
        self._last = name
        if kind == "full":
            self._base, self._since_full = name, 0
        else:
            self._since_full += 1
        self._pending = None
        logger.debug("checkpoint step %d committed", step)
        return True

    def _prunable(self, name: str) -> bool:
        """Whether pruning may delete checkpoint ``name``: one this run wrote, or one of an earlier run
        older than the checkpoint this run resumed from (superseded by a verified one); never
        another run's checkpoint this run did not build on."""
        step = int(name.split("-")[1])
        return step in self.committed or (self.resumed_step is not None and step < self.resumed_step)

    def load(self, step: int) -> None:
        """Every PS replaces its rows and optimizer state with those of the committed checkpoint
        at ``step`` (:func:`hpcps.checkpoint.restore.restore_tables`, from its serve loop); returns
        once all have. The caller loads the dense part. Called at the end of training, after the
        last fence: no push is in flight. Collective over the worker communicator."""
        self.wait_commit()
        if self.is_lead:
            for r in self.ctx.ps_world_ranks:
                self._put(r, LOAD, step)
            for r in self.ctx.ps_world_ranks:
                misses, started = 0, time.monotonic()
                while self._get(r, LOADED) != step:
                    misses += 1
                    time.sleep(0.001)
                    overdue(started, misses, f"PS rank {r} loading the checkpoint of step {step}")
        self.ctx.worker_comm.Barrier()

    def wait_commit(self) -> None:
        """Worker 0 (and a host's first worker, for its local part) blocks until the checkpoint in
        flight is committed. Local."""
        self.poll_commit(block=True)

    def free(self) -> None:
        """Collective over the world."""
        self._win.free()


def sharding_names(tables):
    """The manifest's ``sharding``: one name when every table is placed alike, else name by table."""
    names = {t.name: t.sharding.name for t in tables}
    return next(iter(names.values())) if len(set(names.values())) == 1 else names


def _versions() -> dict:
    import h5py
    # a PS rank that writes the manifest may not have imported torch: its installed version, then
    torch = sys.modules["torch"].__version__ if "torch" in sys.modules else importlib.metadata.version("torch")
    return {"hpcps": __version__, "torch": torch, "h5py": h5py.__version__,
            "numpy": np.__version__, "mpi": MPI.Get_library_version().splitlines()[0].strip()}
