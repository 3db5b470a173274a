"""Reading a dynamic table back from a checkpoint chain (its full checkpoint, then its deltas):
the rows a PS owns under the job's PS count, whatever count wrote them (rows are placed by
``owner_of(id)``, a hash). Local."""

import h5py
import numpy as np

from ..core.hashindex import owner_of

__all__ = ["check_spec", "replay", "restore_dynamic"]

_ROW = ("weights", "last", "uses")      # arrays of one entry per id, besides the ids and the state


def check_spec(path, spec: dict | None, t) -> None:
    """Raise ``ValueError`` when checkpoint ``path``'s table ``spec`` cannot restore dynamic table
    ``t`` (absent, a fixed table, another dim). Its capacity may differ. Local."""
    if spec is None:
        raise ValueError(f"checkpoint {path} has no table {t.name!r}")
    if not spec.get("dynamic"):
        raise ValueError(f"checkpoint {path}: table {t.name!r} is a fixed table there, a dynamic table in the job "
                         f"(model.dynamic_tables)")
    if spec["dim"] != t.dim:
        raise ValueError(f"checkpoint {path}: table {t.name!r} has dim {spec['dim']}, the job has {t.dim}")


def _read(path, name: str, state_names, keep) -> tuple[dict, np.ndarray, h5py.AttributeManager]:
    with h5py.File(path, "r", locking=False) as f:
        g = f[f"tables/{name}"]
        missing = [k for k in state_names if f"state/{k}" not in g]
        if missing:
            raise ValueError(f"checkpoint table {name!r} lacks optimizer state {missing} "
                             f"(written by {g.attrs['optimizer']})")
        ids = g["ids"][...]
        m = keep(ids)
        rows = {"ids": ids[m], **{k: g[k][...][m] for k in _ROW},
                "state": {k: g[f"state/{k}"][...][m] for k in state_names}}
        gone = g["evicted"][...]
        info = {k: v for k, v in g.attrs.items()}
        info["admission"] = g["admission"][...] if "admission" in g else None
        info["num_ps"], info["ps"] = int(f.attrs["num_ps"]), int(f.attrs["ps_rank"])
    return rows, gone[keep(gone)], info


def _concat(parts: list, state_names) -> dict:
    return {"ids": np.concatenate([p["ids"] for p in parts]),
            **{k: np.concatenate([p[k] for p in parts]) for k in _ROW},
            "state": {k: np.concatenate([p["state"][k] for p in parts]) for k in state_names}}


def _without(rows: dict, drop: np.ndarray) -> dict:
    keep = ~np.isin(rows["ids"], drop)
    return {"ids": rows["ids"][keep], **{k: rows[k][keep] for k in _ROW},
            "state": {k: v[keep] for k, v in rows["state"].items()}}


def replay(links: list, name: str, state_names, ps: int, num_ps: int):
    """The rows of dynamic table ``name`` that PS ``ps`` of ``num_ps`` owns, from ``links`` (per
    checkpoint of the chain, full one first: its shard files): ``(rows, counters, applies,
    admission)``. ``rows``: ``ids``, ``weights``, ``last``, ``uses``, ``state``. A delta drops
    the ids it records as evicted, then replaces or adds its rows. Counters (cumulative) are the
    newest link's, of the old PS ranks ``p`` with ``p % num_ps == ps`` (so their sum over the job
    is the sum written); the admission sketch is this PS's own (same PS count) or every old PS's
    summed (a reshard: still never below a true count). Local."""
    def mine(ids):
        return owner_of(ids, num_ps) == ps
    rows = None
    for files in links:
        parts, gone, infos = [], [], []
        for f in files:
            r, g, info = _read(f, name, state_names, mine)
            if not info.get("dynamic"):
                raise ValueError(f"checkpoint table {name!r} in {f} is not a dynamic table")
            parts.append(r)
            gone.append(g)
            infos.append(info)
        new = _concat(parts, state_names)
        if rows is None:
            rows = new
        else:
            rows = _without(rows, np.concatenate([*gone, new["ids"]]))
            rows = _concat([rows, new], state_names)
    counters = {}
    for info in infos:
        same = info["num_ps"] == num_ps
        if (info["ps"] == ps) if same else (info["ps"] % num_ps == ps):
            for k, v in info.items():
                if k.startswith("count_"):
                    counters[k[6:]] = counters.get(k[6:], 0) + int(v)
    applies = max(int(i["applies"]) for i in infos)
    sketches = [i["admission"] for i in infos if i["admission"] is not None
                and (i["num_ps"] != num_ps or i["ps"] == ps)]
    admission = None
    if sketches:
        total = np.sum(np.stack(sketches).astype(np.uint64), axis=0)
        admission = np.minimum(total, np.iinfo(np.uint32).max).astype(np.uint32)
    return rows, counters, applies, admission


def restore_dynamic(t, links: list, ps: int, num_ps: int) -> None:
    """PS: load dynamic table ``t``'s rows from the chain ``links`` (per checkpoint, its shard
    files). Local."""
    rows, counters, applies, admission = replay(links, t.name, t.state_names, ps, num_ps)
    t.load(rows, counters, applies, admission)
