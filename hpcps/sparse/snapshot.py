"""A PS shard's snapshot copied a chunk at a time between the PS's applies (copy on write).

A checkpoint's cut must see the rows as they were after step ``t - 1``'s apply. Copying a large
shard and its optimizer state at once stops the PS for as long (~0.3 s a GB here), and in sync
mode every worker waits for that PS's next apply. Where only the PS's apply changes rows
(deterministic sync mode: workers' pushes wait in the mailboxes), the copy can go on while
training does: the PS copies the next chunk of rows whenever its serve loop polls, and before
an apply changes rows not copied yet it copies those rows first. Chunks are copied in order, so
"not copied yet" is "at or past the next chunk, and not saved ahead".
"""

import numpy as np

from ..core.malloc import populated
from ..core.optimizers import new_state
from ..core.errors import RoleError

__all__ = ["ChunkedSnapshot", "Checkpointable", "CHUNK_ROWS"]

CHUNK_ROWS = 1 << 16


class ChunkedSnapshot:
    """The snapshot of one table's shard in progress. Local to the PS that owns it.

    ``sources``: name -> the live array (rows first); ``fixed``: the parts of the snapshot taken
    at once (ids, applies, version stamps). :meth:`result` gives what ``EmbeddingTable.snapshot``
    gives."""

    def __init__(self, sources: dict, fixed: dict, state_keys: dict, spare: dict | None = None):
        self.sources, self.fixed, self.state_keys = sources, fixed, state_keys
        self.rows = next(iter(sources.values())).shape[0]
        spare = spare or {}
        self.out = {}
        for k, v in sources.items():       # a previous snapshot's arrays when they fit (no new pages)
            dtype = np.uint8 if v.dtype == np.bool_ else v.dtype
            old = spare.get(k)
            self.out[k] = old if old is not None and old.shape == v.shape and old.dtype == dtype \
                else populated(v.shape, dtype)
        self.saved = np.zeros(self.rows, bool)
        self.next = 0

    @property
    def done(self) -> bool:
        return self.next >= self.rows

    def before_apply(self, rows: np.ndarray) -> None:
        """``rows`` (local) are about to change: copy those not copied yet."""
        if self.done:
            return
        todo = rows[rows >= self.next]
        todo = todo[~self.saved[todo]]
        if todo.size:
            for k, src in self.sources.items():
                self.out[k][todo] = src[todo]
            self.saved[todo] = True

    def step(self, chunks: int = 1) -> bool:
        """Copy the next ``chunks`` chunks (rows saved ahead are kept); True once all are copied."""
        for _ in range(chunks):
            if self.done:
                break
            lo, hi = self.next, min(self.rows, self.next + CHUNK_ROWS)
            keep = ~self.saved[lo:hi]
            whole = bool(keep.all())
            for k, src in self.sources.items():
                if whole:
                    self.out[k][lo:hi] = src[lo:hi]
                else:
                    dst = self.out[k][lo:hi]
                    dst[keep] = src[lo:hi][keep]
            self.next = hi
        return self.done

    def result(self) -> dict:
        """The snapshot (once :attr:`done`): ``{"ids", "weights", "state", "applies"[, "versions"]}``."""
        state = {name: self.out[k] for k, name in self.state_keys.items()}
        return {**self.fixed, "weights": self.out["weights"], "state": state}


class Checkpointable:
    """What a checkpoint takes from and gives back to an :class:`hpcps.EmbeddingTable`'s shard
    (a mixin of the table: its rows, optimizer state, version stamps and 16-bit copy)."""

    def snapshot(self, rows=None) -> dict:
        """PS: a copy of local ``rows`` (all when None; a checkpoint cut, while no worker pushes):
        ``{"ids", "weights", "state", "applies"}``: their global ids, float32 rows, optimizer
        state arrays by :attr:`state_names` (the momentum "seen" flag as uint8) and the number of
        optimizer steps applied to the shard; with ``track_versions`` also ``"versions"``, their
        stamps. Local."""
        if not self.ctx.is_ps:
            raise RoleError(f"table {self.name!r}: snapshot() is for PS ranks")
        sel = slice(None) if rows is None else rows
        # a delta's few rows: their ids alone (all 8M of a GB shard took 0.2 s of the PS's cut)
        ids = self.sharding.global_ids(self.ctx.ps_rank) if rows is None else self.sharding.ids_of(self.ctx.ps_rank, rows)
        state = {k: _copy(v, rows) for k, v in self._state.items() if not k.startswith("_")}
        if "_seen" in self._state:
            state["momentum_seen"] = self._state["_seen"][sel].astype(np.uint8)
        out = {"ids": ids, "weights": _copy(self.shard(), rows), "state": state, "applies": self._applies}
        if self.row_versions is not None:
            out["versions"] = np.array(self.row_versions.local()[sel])
        return out

    def begin_snapshot(self) -> ChunkedSnapshot:
        """PS, where only its apply changes rows (deterministic sync mode): start a snapshot of
        the whole shard, as :meth:`snapshot` gives, that the caller copies a chunk at a time
        (``step()``, then ``result()``) while training goes on; an apply first copies the rows it
        is about to change. Local."""
        if not self.ctx.is_ps:
            raise RoleError(f"table {self.name!r}: begin_snapshot() is for PS ranks")
        state_keys = {k: k for k in self._state if not k.startswith("_")}
        sources = {"weights": self.shard(), **{k: self._state[k] for k in state_keys}}
        if "_seen" in self._state:
            sources["_seen"], state_keys["_seen"] = self._state["_seen"], "momentum_seen"
        fixed = {"ids": self.sharding.global_ids(self.ctx.ps_rank), "applies": self._applies}
        if self.row_versions is not None:
            fixed["versions"] = np.array(self.row_versions.local())
        self._snap = ChunkedSnapshot(sources, fixed, state_keys, self._spare)
        self._spare = None
        return self._snap

    def recycle_snapshot(self, snap: ChunkedSnapshot) -> None:
        """PS: ``snap``'s file is written: keep its arrays for the next :meth:`begin_snapshot`
        (allocating 1 GB of new pages held the PS ~0.5 s a full checkpoint on the development VM;
        a PS that took one full checkpoint keeps that copy's memory). Local."""
        self._spare = snap.out

    def restore_targets(self) -> dict:
        """PS: ``{"weights": shard, state name: array}``, for a load to read straight into. Local."""
        return {"weights": self.shard(), **{k: v for k, v in self._state.items() if not k.startswith("_")}}

    @property
    def state_names(self) -> list[str]:
        """Names of the optimizer state arrays :meth:`snapshot` gives and :meth:`restore` takes. Local."""
        return [("momentum_seen" if k == "_seen" else k) for k in new_state(self.optimizer, 0, self.dim)] \
            if self.stateful else []

    def restore(self, chunks, applies: int) -> int:
        """PS: write rows back, as :meth:`snapshot` gave them: ``chunks`` yields ``(ids, weights,
        state)`` or ``(ids, weights, state, versions)`` (global ids this rank owns, float32 rows,
        state arrays by :attr:`state_names`, version stamps); then take ``applies`` as the
        optimizer steps applied and publish the rows (16-bit copy included). Returns the rows
        written. Raises ``ValueError`` on a row of another PS or an unknown state name. Local."""
        if not self.ctx.is_ps:
            raise RoleError(f"table {self.name!r}: restore() is for PS ranks")
        shard, written = self.shard(), 0
        for ids, weights, state, *versions in chunks:
            owner, local, at = _place(self.sharding, np.asarray(ids, np.int64), self.ctx.ps_rank)
            if owner.size and (owner != self.ctx.ps_rank).any():
                raise ValueError(f"table {self.name!r}: restore() got rows of another PS")
            unknown = set(state) - set(self.state_names)
            if unknown:
                raise ValueError(f"table {self.name!r}: restore() got unknown optimizer state {sorted(unknown)}")
            _put(shard, at, weights)
            for k, v in state.items():
                if k == "momentum_seen":
                    self._state["_seen"][at] = np.asarray(v).astype(bool)
                else:
                    _put(self._state[k], at, v)
            if versions and self.row_versions is not None:
                self.row_versions.local()[at] = versions[0]
            if self.half is not None:
                self.half.refresh(shard, local if local is not None else None)
            written += len(ids)
        self._applies = int(applies)
        self._unfilled = False      # the caller checks that every row came (restore_tables)
        self.rows.sync()
        if self.row_versions is not None:
            self.row_versions.window.sync()
        return written


def _copy(a: np.ndarray, rows) -> np.ndarray:
    """``a[rows]`` as a new array (all of ``a`` when ``rows`` is None, into populated pages)."""
    if rows is not None:
        return a[rows]
    out = populated(a.shape, a.dtype)
    out[...] = a
    return out


def _place(sharding, ids: np.ndarray, ps: int):
    """``(owner, local rows or None, where)``: ``where`` a slice for a run of consecutive rows (a
    copy, not a scatter); a whole shard in its order (its own file) is not placed id by id."""
    if ids.size >= 1 << 16 and sharding.in_order(ps, ids):
        return np.full(1, ps), None, slice(0, ids.size)
    owner, local = sharding.place(ids)
    run = local.size and bool(np.all(np.diff(local) == 1))
    return owner, local, slice(int(local[0]), int(local[0]) + local.size) if run else local


def _put(dst: np.ndarray, at, src) -> None:
    """``dst[at] = src``, unless ``src`` is that very memory (read there by the loader)."""
    if not (isinstance(src, np.ndarray) and src.shape == dst[at].shape and src.ctypes.data == dst[at].ctypes.data):
        dst[at] = src
