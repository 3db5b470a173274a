"""Dynamic embedding tables: rows keyed by any int64 id, made on first use (issue 26).

Each PS holds a :class:`hpcps.core.dynshard.DynamicShard` of ``capacity / num_ps`` rows and
serves the table from its serve loop (a service hook). A worker's pull sends each owner
(:func:`hpcps.core.hashindex.owner_of`) the distinct ids it owns, one message per owner per call,
and gets their rows back (a pull stores nothing: an absent id's row is its initial row); a push
sends each owner its ids and their summed gradients, and stores the admitted absent ones. In sync
mode every worker sends each owner exactly one push message a step (empty when it has nothing
for it), the PS keeps them by worker, and before the step's apply (:attr:`StepControl.before_apply`)
it waits for all of them and applies their sum in worker order: the same bits in every run. In
async and ssp modes a push is applied when it arrives, and every worker marks each step's end
(END) and its own (FIN) so checkpoint cuts and ``finalize`` hold every push before them.
``stats()`` asks every PS for its counters. Checkpoints: :mod:`hpcps.sparse.dynamic_ckpt`.
A PS on the worker's own host is read from its window, and pushed to through the worker's slab
(:mod:`hpcps.sparse.dynamic_shm`): only a header message travels.

Messages travel on a communicator of the table's own (a duplicate of the world), as bytes: a
header ``[kind, step, n]`` (int64) and then ids (int64) and gradients (float32).
"""

import time

import numpy as np
from mpi4py import MPI

from ..core.faults import track
from ..core.dynshard import EVICTIONS, DynamicShard, sum_rows
from ..core.hashindex import owner_of
from ..core.ids import initial_rows
from ..core.optimizers import SGD, SparseOptimizer
from ..core.errors import RoleError
from .dynamic_ckpt import DynamicCheckpointable
from .dynamic_recv import DynamicReceiving
from .dynamic_shm import ShardMemory
from .table import TableStats
from .validate import _to_numpy, as_grads

__all__ = ["DynamicEmbeddingTable"]

PULL, PUSH, STATS = 1, 2, 3
_REPLY = 4                       # a reply's tag: _REPLY + the request's kind
END, FIN = 8, 9                  # async/ssp: a worker ended a step; a worker is done (finalize)
PEEK = 10                        # a pull that stores nothing (evaluation): reply tag _REPLY + PEEK
OBSERVE = 11                     # a same-host worker read rows itself: the PS counts the uses (no reply)
OBSERVE_DISTINCT = 12            # the same, of sorted distinct ids
PUSH_SLAB = 13                   # a push put in the worker's slab for this PS (only the header travels)
STATS_KEYS = ("size", "capacity", "inserts", "evictions", "rejected")


def _ids(name: str, ids) -> np.ndarray:
    arr = _to_numpy(ids)
    if arr.size == 0 and arr.dtype.kind in "fO":
        arr = arr.astype(np.int64)
    if arr.dtype.kind not in "iu" or (arr.dtype.kind == "u" and arr.dtype.itemsize == 8):
        raise ValueError(f"table {name!r}: ids must be integers that fit int64, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"table {name!r}: ids must be 1-D, got shape {arr.shape}")
    return arr.astype(np.int64, copy=False)


def _sorted_distinct(ids: np.ndarray) -> bool:
    """Whether ``ids`` are sorted and distinct (a pass, no sort). Local."""
    return ids.size < 2 or bool((ids[1:] > ids[:-1]).all())


def _pack(kind: int, step: int, ids: np.ndarray, grads: np.ndarray | None = None) -> np.ndarray:
    parts = [np.array([kind, step, ids.size], np.int64).view(np.uint8), ids.view(np.uint8)]
    if grads is not None:
        parts.append(np.ascontiguousarray(grads, np.float32).reshape(-1).view(np.uint8))
    return np.concatenate(parts)


class _Handle:
    """What ``pull_async``/``push_async`` return: ``wait()`` gives the rows (pull) or None."""

    def __init__(self, finish):
        self._finish, self._done, self._value = finish, False, None

    def wait(self):
        if not self._done:
            self._value, self._done = self._finish(), True
        return self._value


class DynamicEmbeddingTable(DynamicCheckpointable, DynamicReceiving):
    """A table of ``dim`` floats per int64 id, ``capacity`` rows over all PS ranks. Collective over
    the world (create it on every rank, in the same order as the other tables)."""

    def __init__(self, ctx, name: str, dim: int, capacity: int, optimizer: SparseOptimizer | None = None,
                 seed: int = 0, admit_min_count: int = 1, evict: str = "lru", init: str = "uniform",
                 scale: float | None = None):
        if not isinstance(dim, (int, np.integer)) or dim < 1:
            raise ValueError(f"table {name!r}: dim must be an integer >= 1, got {dim!r}")
        if not isinstance(capacity, (int, np.integer)) or capacity < ctx.num_ps:
            raise ValueError(f"table {name!r}: capacity must be an integer of at least one row per PS "
                             f"({ctx.num_ps}), got {capacity!r}")
        if evict not in EVICTIONS:
            raise ValueError(f"table {name!r}: evict must be one of {', '.join(EVICTIONS)}, got {evict!r}")
        if not isinstance(admit_min_count, (int, np.integer)) or admit_min_count < 1:
            raise ValueError(f"table {name!r}: admit_min_count must be an integer >= 1, got {admit_min_count!r}")
        self.optimizer = optimizer if optimizer is not None else SGD(lr=0.01)
        self.optimizer.check()
        self.ctx, self.name, self.dim, self.capacity = ctx, name, int(dim), int(capacity)
        self.comm = track(ctx.world.Dup())                    # collective
        P = ctx.num_ps
        self.caps = [self.capacity // P + (p < self.capacity % P) for p in range(P)]   # rows per PS
        self.shard = None
        self.seed, self.init, self.scale = int(seed), init, scale
        self.traffic = TableStats(rows_per_ps=[0] * P, bytes_per_ps=[0] * P)   # this rank's pulls and pushes
        self._sends = []                                      # outstanding Isends (requests, buffers)
        self._seen = [[] for _ in range(P)]                   # worker: same-host reads' ids, not sent yet
        self.memory = ShardMemory(ctx, name, self.dim, self.caps)     # collective; same-host reads
        if ctx.is_ps:
            self.shard = DynamicShard(name, self.dim, self.caps[ctx.ps_rank], self.optimizer, seed, int(admit_min_count), evict,
                                      init, scale, memory=self.memory.memory())
            self._staged = {}                                 # sync: step -> {worker: (ids, grads)}
            self._observed = {}                               # sync: step -> [pulled ids], counted at its apply
            self._out = np.empty((0, self.dim), np.float32)   # pull replies
            self._worker_of = {r: w for w, r in enumerate(ctx.worker_world_ranks)}
            self._ended = np.full(ctx.num_workers, -1, np.int64)    # async/ssp: each worker's last END
            self._fins, self._finished = 0, set()
            ctx.add_service_hook(self._serve, "serve")
            ctx.control.before_apply.append(self._apply_step)
            self._ends = 0                                    # async/ssp: END messages taken
            ctx.control.before_publish.append(self._drain_ends)    # async/ssp: a fence holds every push
        elif ctx.control.kind != "sync":
            ctx.control.on_end.append(self._end_step)
        ctx.add_resource(self)
        ctx.world.Barrier()             # every shard's index is made before a worker reads one

    # ------------------------------------------------------------ worker side
    def _worker(self, what: str) -> None:
        if not self.ctx.is_worker:
            raise RoleError(f"table {self.name!r}: {what}() is for worker ranks")

    def _split(self, ids: np.ndarray):
        own = owner_of(ids, self.ctx.num_ps)
        return [np.flatnonzero(own == p) for p in range(self.ctx.num_ps)]

    def _flush(self) -> None:
        MPI.Request.Waitall([r for r, _ in self._sends])
        self._sends = []

    def _prune(self) -> None:
        """Drop the sends that completed (their buffers with them). Local."""
        self._sends = [s for s in self._sends if not s[0].Test()]

    def pull_async(self, ids, insert: bool = True) -> _Handle:
        """Rows of ``ids`` (any int64 values, repeats allowed): ``wait()`` gives float32 ``(n, dim)``.
        A new id's row is its initial row (``hpcps.initial_rows``); a pull stores nothing (a push
        of an admitted id does). ``insert=False`` (evaluation) counts no use or sighting either.
        A PS on this host is read from its window (:mod:`hpcps.sparse.dynamic_shm`); any other
        gets one message each way. Local."""
        self._worker("pull")
        t0 = time.perf_counter()
        ids = _ids(self.name, ids)
        step = self.ctx.control.step
        kind = PULL if insert else PEEK
        one = self.ctx.num_ps == 1
        owned = [None] if one else self._split(ids)            # None: all of them
        distinct = _sorted_distinct(ids)              # (so is each owner's part)
        for p, at in enumerate(owned):                        # before any message
            n = ids.size if at is None else at.size
            if insert and n > self.caps[p]:                   # (fewer ids cannot be too many distinct ones)
                n = np.unique(ids if at is None else ids[at]).size
            if insert and n > self.caps[p]:
                raise ValueError(f"table {self.name!r}: {n} distinct ids "
                                 f"of PS {p} in one pull, more than its {self.caps[p]} rows (capacity {self.capacity} "
                                 f"over {len(self.caps)} PS ranks): raise capacity")
        parts = []
        for p, at in enumerate(owned):
            sub = ids if at is None else ids[at]
            if sub.size == 0:
                continue
            got = self.memory.read(p, sub) if self.memory.views[p] is not None else None
            if got is not None:                     # on this host: read from its window, no PS
                buf, found = got
                miss = found < 0
                if miss.any():
                    buf[miss] = initial_rows(self.seed, self.name, sub[miss], self.dim, self.scale, kind=self.init)
                if insert:                          # the PS counts the uses: sent before the next push
                    self._seen[p].append((step, distinct, sub))
                parts.append((None, buf, at, None))
                self.traffic.rows_per_ps[p] += sub.size
                self.traffic.bytes_per_ps[p] += buf.nbytes
                continue
            uniq, inv = np.unique(sub, return_inverse=True)
            buf = np.empty((uniq.size, self.dim), np.float32)
            dst = self.ctx.ps_world_ranks[p]
            recv = self.comm.Irecv(buf, source=dst, tag=_REPLY + kind)
            msg = _pack(kind, step, uniq)
            self._sends.append((self.comm.Isend(msg, dest=dst, tag=kind), msg))
            self.ctx.control.ring(dst)               # a PS asleep on its doorbell looks now
            parts.append((recv, buf, at, inv))
            self.traffic.rows_per_ps[p] += uniq.size
            self.traffic.bytes_per_ps[p] += buf.nbytes
        self.traffic.pulls += 1
        self.traffic.pull_rows += ids.size
        self.traffic.pull_seconds += time.perf_counter() - t0

        def finish():
            t1 = time.perf_counter()
            out = None
            for recv, buf, at, inv in parts:
                if recv is not None:
                    recv.Wait()
                if at is None or at.size == ids.size:    # one PS holds them all: no scatter
                    out = buf if inv is None else np.take(buf, inv, axis=0)
                    continue
                if out is None:
                    out = np.empty((ids.size, self.dim), np.float32)
                # (buf[inv] gathers 2-D rows several times slower than np.take)
                out[at] = buf if inv is None else np.take(buf, inv, axis=0)
            # requests answered are sent; an OBSERVE may wait for the PS to take it (a push or
            # free completes it): the pull does not wait for that
            self._prune()
            self.traffic.pull_seconds += time.perf_counter() - t1
            return out if out is not None else np.empty((0, self.dim), np.float32)
        return _Handle(finish)

    def pull(self, ids, insert: bool = True) -> np.ndarray:
        """``pull_async(ids, insert).wait()``. Local."""
        return self.pull_async(ids, insert).wait()

    def push_async(self, ids, grads) -> _Handle:
        """Send the gradients of ``ids`` (float32 ``(n, dim)``, finite; repeated ids summed) to their
        PS ranks. In sync mode call it once a step (every PS gets one message from every worker).
        Local."""
        self._worker("push")
        t0 = time.perf_counter()
        ids = _ids(self.name, ids)
        grads = as_grads(self.name, grads, ids.size, self.dim)
        step = self.ctx.control.step
        distinct = _sorted_distinct(ids)              # no sum needed
        parts = []
        for p, at in enumerate(self._split(ids)):     # every check before any message
            uniq, summed = (ids[at], np.take(grads, at, axis=0)) if distinct else \
                sum_rows(ids[at], np.take(grads, at, axis=0))
            if uniq.size > self.caps[p]:
                raise ValueError(f"table {self.name!r}: {uniq.size} distinct ids of PS {p} in one push, more than "
                                 f"its {self.caps[p]} rows (capacity {self.capacity} over {len(self.caps)} PS "
                                 f"ranks): raise capacity")
            parts.append((p, at, uniq, summed))
        for p, at, uniq, summed in parts:
            if at.size == 0 and self.ctx.control.kind != "sync":
                self._send_seen(p)
                continue
            dst = self.ctx.ps_world_ranks[p]
            pending = self._seen[p]         # a pull's ids to count, before this push: in the slab with it
            seen = pending[0] if len(pending) == 1 and pending[0][2].size <= self.memory.slab_rows else None
            if seen is None:
                self._send_seen(p)
            if self.memory.put(p, step, uniq, summed, seen):   # same host: only a header travels
                self._seen[p] = []
                msg, kind = np.array([PUSH_SLAB, step, uniq.size], np.int64), PUSH_SLAB
            else:
                self._send_seen(p)
                msg, kind = _pack(PUSH, step, uniq, summed), PUSH
            self._sends.append((self.comm.Isend(msg, dest=dst, tag=kind), msg))
            self.ctx.control.ring(dst)
            self.traffic.rows_per_ps[p] += uniq.size
            self.traffic.bytes_per_ps[p] += summed.nbytes
        self.traffic.pushes += 1
        self.traffic.push_rows += ids.size
        self.traffic.push_seconds += time.perf_counter() - t0

        def finish():
            t1 = time.perf_counter()
            self._flush()
            self.traffic.push_seconds += time.perf_counter() - t1
        return _Handle(finish)

    def push(self, ids, grads) -> None:
        """``push_async(ids, grads).wait()``. Local."""
        self.push_async(ids, grads).wait()

    def _send_seen(self, p: int) -> None:
        """Worker: send PS ``p`` the ids this worker read from its window since the last send
        (OBSERVE, no reply), a message per step read: before a push, an END, ``stats`` or FIN,
        so the PS counts them in order (in sync mode at that step's apply). Local."""
        for step, distinct, ids in self._seen[p]:
            what = OBSERVE_DISTINCT if distinct else OBSERVE
            msg = _pack(what, step, ids)
            self._sends.append((self.comm.Isend(msg, dest=self.ctx.ps_world_ranks[p], tag=what), msg))
        self._seen[p] = []

    def _end_step(self, step: int) -> None:
        """Worker, async/ssp, at ``step_end(step)``: tell every PS (after this step's pushes, on the
        same ordered channel), so a checkpoint cut and ``finalize`` wait for exactly those. Local."""
        for p, dst in enumerate(self.ctx.ps_world_ranks):
            self._send_seen(p)
            msg = _pack(END, step, np.zeros(0, np.int64))
            self._sends.append((self.comm.Isend(msg, dest=dst, tag=END), msg))
        self._prune()

    def stats(self) -> dict:
        """``size``, ``capacity``, ``inserts``, ``evictions``, ``rejected``, summed over the PS ranks.
        Any worker on its own: not collective. Local (a message to and from each PS)."""
        self._worker("stats")
        total = np.zeros(len(STATS_KEYS), np.int64)
        for p, dst in enumerate(self.ctx.ps_world_ranks):
            self._send_seen(p)
            got = np.zeros(len(STATS_KEYS), np.int64)
            recv = self.comm.Irecv(got, source=dst, tag=_REPLY + STATS)
            self.comm.Send(_pack(STATS, 0, np.zeros(0, np.int64)), dest=dst, tag=STATS)
            self.ctx.control.ring(dst)
            recv.Wait()
            total += got
        return dict(zip(STATS_KEYS, total.tolist()))

    # ------------------------------------------------------------ PS side
    def _serve(self) -> bool:
        """PS (a service hook): answer every request that has arrived. Local."""
        worked = False
        status = MPI.Status()
        while self.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
            self._handle(status)
            worked = True
        self._prune()                                   # replies still in flight
        return worked

    def _handle(self, status: MPI.Status) -> None:
        src, tag = status.Get_source(), status.Get_tag()
        raw = np.empty(status.Get_count(MPI.BYTE), np.uint8)
        self.comm.Recv(raw, source=src, tag=tag)
        kind, step, n = (int(x) for x in raw[:24].view(np.int64))
        ids = raw[24:24 + 8 * n].view(np.int64)
        if kind in (PULL, PEEK):
            # the worker sent them sorted and distinct; a peek stores nothing
            rows = self.shard.index.find(ids)
            if kind == PULL:
                self._observe(ids, step, distinct=True)
            if self._out.shape[0] < n:              # one reply buffer, grown as needed: fresh pages cost
                self._out = np.empty((n, self.dim), np.float32)
            reply = self.shard.pull(rows, ids, out=self._out[:n])
            self.comm.Send(reply, dest=src, tag=_REPLY + kind)   # the worker posted its receive first
            return
        elif kind in (OBSERVE, OBSERVE_DISTINCT):       # a same-host read's ids
            self._observe(ids, step, distinct=kind == OBSERVE_DISTINCT)
            return
        elif kind in (END, FIN):
            w = self._worker_of[src]
            self._ended[w] = max(self._ended[w], step)
            self._ends += kind == END
            self._fins += kind == FIN
            if kind == FIN:
                self._finished.add(w)
            return
        elif kind == STATS:
            s = self.shard.stats()
            reply = np.array([s[k] for k in STATS_KEYS], np.int64)
        else:
            if kind == PUSH_SLAB:
                ids, grads, seen = self.memory.take(src, n)
                if seen is not None:                    # the uses of the pull before it
                    self._observe(seen[2], seen[0], distinct=seen[1])
            else:
                grads = raw[24 + 8 * n:].view(np.float32).reshape(n, self.dim)
            if self.ctx.control.kind == "sync":
                self._staged.setdefault(step, {})[self._worker_of[src]] = (ids, grads)
            else:
                self.shard.push(self.shard.place(ids, step), grads, step)
            return
        self._sends.append((self.comm.Isend(reply, dest=src, tag=_REPLY + kind), reply))

    def _observe(self, ids: np.ndarray, step: int, distinct: bool) -> None:
        """PS: count a pull's uses and sightings; in sync mode at the step's apply (a checkpoint cut
        at ``step``, just before that apply, must see none of them, whenever they came). Local."""
        if self.ctx.control.kind == "sync":
            self._observed.setdefault(step, []).append((ids, distinct))
        else:
            self.shard.observe(ids, step, distinct=distinct)

    def _drain_to(self, step: int) -> None:
        """PS, async/ssp, at a checkpoint cut of ``step``: apply every push of steps ``< step``
        (receive until each worker's END of ``step - 1`` is in). Local (receives)."""
        if self.ctx.control.kind != "sync":
            self._take_until(lambda: self._ended.min() >= step - 1)

    remote = "messages"                 # how a worker reaches the other PS ranks (the layout line)

    @property
    def shared_memory_ps(self) -> list[int]:
        """PS indices whose rows this worker reads straight from shared memory (its pushes to them
        go through its slab). Local."""
        return [p for p, v in enumerate(self.memory.views) if v is not None]

    def held_bytes(self) -> int:
        """PS: bytes of its shard (rows, optimizer state, index, per-row counters); 0 elsewhere. Local."""
        return self.shard.nbytes if self.shard is not None else 0

    def _drain_ends(self, done: int) -> None:
        """PS, async/ssp, before publishing ``done`` step ends (the control's count): take the END
        each of them sent first, so every push before it is applied (a fence holds them). Local."""
        if self.ctx.control.kind != "sync":
            self._take_until(lambda: self._ends >= done - self.ctx.control.first_done)

    def free(self) -> None:
        """Collective over the world (the context frees it at ``finalize``); safe twice. A PS first
        takes every message the workers sent (each sends FIN last) and applies every push: none is
        lost at the end."""
        if self.comm == MPI.COMM_NULL:
            return
        if self.shard is not None:
            self._take_until(lambda: self._fins >= self.ctx.num_workers)
            W = self.ctx.num_workers
            for step in sorted(s for s, got in self._staged.items() if len(got) == W):   # sync: the last step
                self._apply_step(step)
        elif self.ctx.is_worker:
            fin = _pack(FIN, self.ctx.control.step, np.zeros(0, np.int64))
            for p, dst in enumerate(self.ctx.ps_world_ranks):
                self._send_seen(p)
                self._sends.append((self.comm.Isend(fin, dest=dst, tag=FIN), fin))
        self._flush()
        self.comm.Free()
        self.memory.free()
