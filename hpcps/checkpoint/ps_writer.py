"""The PS side of taking checkpoints: each cut at once, the files written one after another.

A PS cuts a checkpoint the moment it is asked for: a copy of the rows changed since its level's
last one (a delta), or the whole shard (a full one; in deterministic sync mode a chunked copy on
write, :mod:`hpcps.sparse.snapshot`, so no apply waits for it). The cut then waits in a queue:
its file is written, sent to the partner (node-local level) and committed after those cut
before it, and ``WRITTEN`` says so in order. So a node-local delta asked for while a full one
of a large shard is still being written is cut on time and waits in memory (a few MB), and
neither the workers nor the PS's applies wait for the write. Only a full cut asked for while
another full one's chunked copy is still going waits for that copy (one copy on write per table).

Mixed into :class:`hpcps.checkpoint.coordinator.Checkpointer`; every method runs on a PS rank
from its serve loop (local).
"""

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..core.wait import overdue
from . import local, store
from .restore import restore_tables
from .shards import Background, shard_file, write_shard

__all__ = ["PsWriter", "links", "FULL", "DELTA", "LOCAL", "LOCAL_DELTA", "REQUEST", "COPIED", "WRITTEN", "ERROR", "KIND",
           "HANDLED", "LOAD", "LOADED", "WORDS"]

logger = logging.getLogger(__name__)
REQUEST, COPIED, WRITTEN, ERROR, KIND, HANDLED = 0, 1, 2, 3, 4, 5      # control words (HANDLED: the last request cut)
LOAD, LOADED = 6, 7           # a checkpoint's step every PS is to load its rows from (the best, at the end); the one loaded
WORDS = 8
FULL, DELTA, LOCAL, LOCAL_DELTA = 0, 1, 2, 3                # KIND: filesystem full / delta, node-local full / delta


def links(chain: list) -> dict:
    """A node-local part's manifest fields of its chain: ``kind`` and ``chain`` (the steps whose
    parts a restore reads, the full one first, this one last)."""
    return {"kind": "delta" if len(chain) > 1 else "full", "chain": list(chain)}


@dataclass
class _Cut:
    """One checkpoint cut on this PS: its ``step``, ``level`` ("pfs" or "local"), node-local
    ``chain``, the chunked copies still going (``chunked``) or the copies (``snaps``)."""

    step: int
    level: str
    chain: list
    chunked: list = field(default_factory=list)
    snaps: dict | None = None
    copies: list = field(default_factory=list)     # [(table, ChunkedSnapshot)] copied, for their arrays' reuse


class PsWriter:
    """The PS's queue of cut checkpoints (see the module). Local to a PS."""

    def _ps_start(self) -> None:
        self._cuts = deque()          # cut, not being written yet (oldest first)
        self._cut = None              # the one being written (its file, then its partner copies)
        self._writer = None           # its writing thread
        self._partnering = False      # its file is written, the partner copies travel
        self._local_chain = []        # the newest node-local cut's chain
        self._loaded = -1             # the step of the checkpoint this PS last loaded (LOAD)

    def _ps_poll(self) -> bool:
        """Each poll of the serve loop: copy chunks, move the write in flight on, start the next,
        cut a checkpoint asked for. True when it did work (the loop polls again at once)."""
        worked = self._copy_chunks()
        if self._cut is not None:
            self._advance()
        if self._cut is None and self._cuts and not self._cuts[0].chunked:
            self._start_write(self._cuts.popleft())
            worked = True
        req = self._get(self.ctx.rank, REQUEST)
        if req <= self._handled or self.ctx.control.step < req or self._must_wait():
            return self._load_asked() or worked
        self._handle(req)
        return True

    def _load_asked(self) -> bool:
        """Load the rows and optimizer state of the checkpoint at the step worker 0 put into
        ``LOAD`` (the best evaluation's, at the end of training: :meth:`Checkpointer.load`) once
        no cut waits to be written, then publish ``LOADED``. True when it loaded. Every row counts
        as changed for both levels' next checkpoint."""
        step = int(self._mine[LOAD])          # synced by the read of REQUEST just before (one Win_sync a poll)
        if step < 0 or step == self._loaded or self._cut is not None or self._cuts:
            return False
        restore_tables(store.step_dir(self.root, step), self.ctx, self.tables)
        for t in self.tables:
            if t.dirty is not None:
                t.dirty.mark_local(np.arange(t.dirty.local_rows))
                t.dirty.window.sync()
        self._loaded = step
        self._put(self.ctx.rank, LOADED, step)
        logger.debug("PS %d loaded the checkpoint of step %d", self.ctx.ps_rank, step)
        return True

    def _must_wait(self) -> bool:
        """A full cut asked for while a full one's chunked copy still goes (deterministic sync)."""
        return self.early and self._get(self.ctx.rank, KIND) in (FULL, LOCAL) and \
            any(c.chunked for c in self._cuts)

    def _ps_before_apply(self) -> None:
        """Deterministic sync mode, about to apply step ``control.step``: a checkpoint asked for at
        that step is cut now, before the apply (workers did not wait for it: their pushes of the
        step wait in the mailboxes, and only this apply changes rows)."""
        req = self._get(self.ctx.rank, REQUEST)
        if req != self.ctx.control.step or req <= self._handled:
            return
        misses, started = 0, time.monotonic()
        while self._must_wait():                                 # never skip the cut
            self._ps_poll()
            misses += 1
            time.sleep(0.0005)
            overdue(started, misses, f"checkpoint at step {req}: the previous full checkpoint is still copied")
        self._handle(req)

    def _handle(self, req: int) -> None:
        """Cut the checkpoint at step ``req``: take the level's changed rows (no new marks meanwhile:
        no push is applied now), copy them (or start chunked copies of a full one), queue it."""
        kind = self._get(self.ctx.rank, KIND)
        level = "local" if kind in (LOCAL, LOCAL_DELTA) else "pfs"
        delta = kind in (DELTA, LOCAL_DELTA)
        self._handled = req
        self._put(self.ctx.rank, HANDLED, req)
        chain = [*self._local_chain, req] if delta else [req]
        if level == "local":
            self._local_chain = chain
        dirty = {t.name: t.take_dirty(level) if t.track_dirty else None for t in self.tables}
        cut = _Cut(req, level, chain)
        if self.early and not delta:
            cut.chunked = [(t, t.begin_snapshot()) for t in self.tables]
        else:
            cut.snaps = {t.name: t.snapshot(dirty[t.name] if delta else None) for t in self.tables}
            self._put(self.ctx.rank, COPIED, req)
        self._cuts.append(cut)

    def _copy_chunks(self) -> bool:
        """Copy chunks of the cut whose chunked copy goes, for about a millisecond. True when it
        copied anything."""
        cut = next((c for c in self._cuts if c.chunked), None)
        if cut is None:
            return False
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.001:
            if all([snap.step() for _, snap in cut.chunked]):
                cut.snaps = {t.name: snap.result() for t, snap in cut.chunked}
                cut.copies, cut.chunked = cut.chunked, []
                break
        return True

    def _start_write(self, cut: _Cut) -> None:
        """Write the file of ``cut`` from a thread (its error, if any, goes out as ``ERROR``)."""
        me = self.ctx.rank
        snap = {t.name: {**cut.snaps[t.name], "num_rows": t.num_rows, "dim": t.dim, "optimizer": repr(t.optimizer)}
                for t in self.tables}
        cut.snaps = None
        if cut.level == "local":
            tmp = local.part_tmp(self.local_dir, cut.step, me)
            tmp.mkdir(mode=self.dir_mode, parents=True, exist_ok=True)
            self.partners.start(cut.step, tmp)
            path = tmp / shard_file(self.ctx.ps_rank)
        else:
            path = store.tmp_dir(self.root, cut.step) / shard_file(self.ctx.ps_rank)
        self._cut = cut
        self._writer = Background(write_shard, path, cut.step, self.ctx.ps_rank, self.ctx.num_ps, snap,
                                  self.compression, self.file_mode, local.ALGO if cut.level == "local" else "sha256")

    def _advance(self) -> None:
        """The write in flight: once its file is written, send it to the partner (node-local) or
        report it; once the partner copies are in, commit the part."""
        me, cut = self.ctx.rank, self._cut
        if self._writer is not None:
            if self._writer.is_alive():
                return
            w, self._writer = self._writer, None
            for t, snap in cut.copies:               # its arrays are free: the next full copy reuses them
                t.recycle_snapshot(snap)
            cut.copies = []
            if w.error is not None:
                logger.error("checkpoint at step %d: writing %s failed: %s", cut.step, shard_file(self.ctx.ps_rank),
                             w.error)
                self._put(me, ERROR, cut.step)
                self._cut = None
                return
            if cut.level != "local":
                self._put(me, WRITTEN, cut.step)
                self._cut = None
                return
            self.partners.send(self.ctx.ps_rank, w.args[0])
            self._partnering = True
        if self._partnering and self.partners.progress():
            self._partnering = False
            self._commit_ps_part(cut)
            self._cut = None

    def _commit_ps_part(self, cut: _Cut) -> None:
        """Its own shard and the partner copies are written: commit its local part, or report the
        error."""
        me, step = self.ctx.rank, cut.step
        if self.partners.error is not None:
            logger.error("local checkpoint at step %d: a partner copy failed: %s", step, self.partners.error)
            self._put(me, ERROR, step)
            return
        shards = sorted([self.ctx.ps_rank, *self.partners.received])
        try:
            local.commit_part(self.local_dir, step, me, {**self._job_fields(step), **links(cut.chain),
                                                         "shards": shards, "dense": False},
                              self.local_keep, self.file_mode, writers=self.local_writers)
        except OSError as e:
            logger.error("local checkpoint at step %d: committing failed: %s", step, e)
            self._put(me, ERROR, step)
            return
        self._put(me, WRITTEN, step)
