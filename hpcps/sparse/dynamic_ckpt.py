"""The checkpoint side of a dynamic table (mixed into :class:`hpcps.DynamicEmbeddingTable`): what
:class:`hpcps.checkpoint.Checkpointer` asks of every table (``take_dirty``, ``snapshot``,
``begin_snapshot``, ``state_names``) and ``load``, what :func:`hpcps.checkpoint.restore_tables`
gives it. A snapshot holds the live rows' ids, rows, optimizer state, last step and uses; an
incremental one only the rows changed since its level's last checkpoint and the ids evicted
since; every one also the shard's counters and its admission sketch. Every method runs on a PS
rank (local)."""

import numpy as np

from ..core.optimizers import new_state
from ..core.errors import RoleError

__all__ = ["DynamicCheckpointable", "HashPlacement"]


class HashPlacement:
    """What a checkpoint manifest says of a dynamic table's placement: ``owner_of`` (a hash)."""

    name = "hash"


class _Done:
    """A snapshot taken at once (what ``begin_snapshot`` returns: no chunks left to copy)."""

    def __init__(self, snap: dict):
        self._snap = snap

    def step(self, chunks: int = 1) -> bool:
        return True

    def result(self) -> dict:
        return self._snap


class DynamicCheckpointable:
    """Checkpoint methods of a dynamic table (see the module). Needs ``ctx``, ``name``, ``dim``,
    ``optimizer`` and, on PS ranks, ``shard`` (a :class:`hpcps.core.dynshard.DynamicShard`)."""

    dynamic = True                  # a checkpoint's manifest marks it; a restore reads it by id
    segments = None
    track_dirty = True
    sharding = HashPlacement()

    @property
    def num_rows(self) -> int:
        """The manifest's ``num_rows`` of a dynamic table: its capacity. Local."""
        return self.capacity

    @property
    def logical(self) -> list:
        return [(self.name, 0, self.capacity)]

    @property
    def state_names(self) -> list[str]:
        """Names of the optimizer state arrays of a snapshot. Local."""
        return [("momentum_seen" if k == "_seen" else k) for k in new_state(self.optimizer, 0, self.dim)] \
            if self.optimizer.stateful else []

    def _ps(self, what: str):
        if self.shard is None:
            raise RoleError(f"table {self.name!r}: {what}() is for PS ranks")
        return self.shard

    def take_dirty(self, level: str = "pfs"):
        """PS, at a checkpoint cut: rows changed and ids evicted since ``level``'s last cut (for
        :meth:`snapshot`). Local."""
        self._drain_to(self.ctx.control.step)
        return self._ps("take_dirty").take_dirty(level)

    def snapshot(self, dirty=None) -> dict:
        """PS, at a checkpoint cut: every live row, or those of ``dirty`` (:meth:`take_dirty`), as
        ``write_shard`` takes them (``extra``: ``last``, ``uses``, ``evicted``, ``admission``;
        ``attrs``: the counters). Local."""
        if dirty is None:
            self._drain_to(self.ctx.control.step)
        snap = self._ps("snapshot").snapshot(dirty)
        state = {("momentum_seen" if k == "_seen" else k): (v.astype(np.uint8) if k == "_seen" else v)
                 for k, v in snap["state"].items()}
        extra = {"last": snap["last"], "uses": snap["uses"], "evicted": snap["evicted"]}
        if snap["admission"] is not None:
            extra["admission"] = snap["admission"]
        return {"ids": snap["ids"], "weights": snap["weights"], "state": state, "applies": snap["applies"],
                "extra": extra, "attrs": {"dynamic": 1, **{f"count_{k}": v for k, v in snap["counters"].items()}}}

    def begin_snapshot(self) -> _Done:
        """PS: :meth:`snapshot` of every row, taken now (a dynamic shard is copied at once). Local."""
        return _Done(self.snapshot())

    def recycle_snapshot(self, snap) -> None:
        """PS: nothing to keep (a dynamic snapshot is copied whole each time). Local."""

    def load(self, rows: dict, counters: dict, applies: int, admission) -> int:
        """PS, at start: put a checkpoint's rows (:func:`hpcps.checkpoint.dynamic.replay`) into the
        shard (emptied first); more than it holds are evicted by its policy. Returns how many were.
        Local."""
        shard = self._ps("load")
        state = {k: rows["state"]["momentum_seen" if k == "_seen" else k].astype(v.dtype)
                 for k, v in shard.state.items()}
        dropped = shard.load(rows["ids"], rows["weights"], state, rows["last"], rows["uses"])
        for k in shard.counters:
            shard.counters[k] += int(counters.get(k, 0))
        shard.applies = max(shard.applies, int(applies))
        if admission is not None and shard.admission.counts is not None \
                and admission.shape == shard.admission.counts.shape:
            shard.admission.counts[:] = admission
        return dropped
