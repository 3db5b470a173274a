"""Loading a checkpoint (at start; the best one at the end, ``job.restore_best``): each PS's rows
under the job's placement, the workers' dense state."""

from pathlib import Path

import numpy as np

from ..core.sharding import logical_tables
from . import local, store
from .dynamic import check_spec, restore_dynamic
from .readback import read_checked
from .shards import read_dense, read_rows, shard_applies, shard_file

__all__ = ["restore_tables", "restore_dense", "load_dense_model"]


def _sources(path, specs: dict, t) -> list:
    """Where table ``t``'s rows are in a checkpoint: ``[(checkpoint table, first id, ids, shift)]``,
    read as ``job id = checkpoint id + shift`` for checkpoint ids in ``[first, first + ids)``. The
    same table, or its logical tables found apart or inside a table-batched one (so a checkpoint
    restores with ``model.fuse_tables`` either way)."""
    spec = specs.get(t.name)
    if spec is not None and spec.get("dynamic"):
        raise ValueError(f"checkpoint {path}: table {t.name!r} is a dynamic table there, a fixed table in the job "
                         f"(model.dynamic_tables)")
    if spec is not None:
        job = {"num_rows": t.num_rows, "dim": t.dim, "segments": [list(x) for x in (t.segments or ())]}
        theirs = {"num_rows": spec.get("num_rows"), "dim": spec.get("dim"),
                  "segments": [list(x) for x in (spec.get("segments") or ())]}
        diff = [f"{k} {theirs[k]} in the checkpoint, {job[k]} in the job" for k in job if theirs[k] != job[k]]
        if diff:
            raise ValueError(f"checkpoint {path}, table {t.name!r}: " + "; ".join(diff))
        return [(t.name, 0, t.num_rows, 0)]
    where = {name: (s, first, n) for s in specs.values()
             for name, first, n in logical_tables(s["name"], s["num_rows"], s.get("segments"))}
    out = []
    for name, start, n in t.logical:
        got = where.get(name)
        if got is None:
            raise ValueError(f"checkpoint {path} has no table {name!r} (it has "
                             f"{sorted(where)})")
        s, first, rows = got
        if rows != n or s["dim"] != t.dim:
            raise ValueError(f"checkpoint {path} has table {name!r} as {rows} x {s['dim']}, the job has "
                             f"{n} x {t.dim}")
        out.append((s["name"], first, n, start - first))
    return out


def restore_tables(path, ctx, tables, own=None) -> int:
    """PS ranks: load this rank's rows (any old num_ps) into the tables, following an incremental
    checkpoint back to its full baseline. Returns the step. Local.

    ``own``: the paths of this PS's own shard files (a node-local checkpoint of the same PS count
    and placement: the full one holds exactly its rows, then the deltas of its chain, in order);
    ``path`` then gives the manifest.

    A table-batched table (``segments``) restores from its logical tables stored apart, and a
    table from its segment of a table-batched one: rows are matched by name and row id."""
    links = store.chain(path) if own is None else [Path(path)]
    man = store.read_manifest(path)
    specs = {t["name"]: t for t in man["tables"]}
    dynamic = [t for t in tables if getattr(t, "dynamic", False)]
    for t in dynamic:
        check_spec(path, specs.get(t.name), t)
    tables = [t for t in tables if t not in dynamic]
    sources = {t.name: _sources(path, specs, t) for t in tables}      # every rank checks, then PS ranks load
    if ctx.is_ps:
        def files_of():
            return [[Path(link) / shard_file(p) for p in range(store.read_manifest(link)["num_ps"])]
                    for link in links] if own is None else [[Path(f)] for f in own]
        loaded = _load_own([Path(f) for f in own], tables, sources) if own is not None else {}   # checks them
        for t in dynamic:
            restore_dynamic(t, files_of(), ctx.ps_rank, ctx.num_ps)
        for t in tables:
            files = files_of()
            applies = max(shard_applies(f, name) for f in files for name, *_ in sources[t.name])
            for i, chunk in enumerate(loaded.get(t.name, [])):
                filled = t.restore([chunk], applies)
                if i == 0 and filled != t.shard().shape[0]:
                    raise ValueError(f"checkpoint table {t.name!r}: found {filled} of this PS's "
                                     f"{t.shard().shape[0]} rows")
            if t.name in loaded:
                continue
            # a full checkpoint of the same layout: the rows and state are read straight into the table
            into = t.restore_targets() if len(sources[t.name]) == 1 else None
            for i, paths in enumerate(files):
                filled = sum(t.restore(read_rows(paths, name, t.sharding, ctx.ps_rank, t.dim, t.state_names,
                                                 span=(first, first + n), shift=shift,
                                                 into=into if i == 0 else None), applies)
                             for name, first, n, shift in sources[t.name])
                if i == 0 and filled != t.shard().shape[0]:     # a full checkpoint holds every row
                    raise ValueError(f"checkpoint table {t.name!r}: found {filled} of this PS's "
                                     f"{t.shard().shape[0]} rows")
    return int(man["step"])


def _load_own(files: list, tables, sources) -> dict:
    """A PS's own node-local files (the full one: its rows, in its order; then the deltas): each
    read and checked in one pass (:func:`hpcps.checkpoint.readback.read_checked`), the full one of
    the tables stored as they are in the job straight into their memory. ``{table name:
    [(ids, weights, state) per file]}`` of those tables (the others, fused or split since, go
    through :func:`read_rows` from the checked files). Raises
    :class:`~hpcps.checkpoint.readback.CorruptFile`. Local."""
    exact = [t for t in tables if sources[t.name] == [(t.name, 0, t.num_rows, 0)]]
    targets = {f"tables/{t.name}/{'weights' if k == 'weights' else 'state/' + k}": v
               for t in exact for k, v in t.restore_targets().items()}
    out = {t.name: [] for t in exact}
    for i, f in enumerate(files):
        arrays = read_checked(f, local.sidecar(f), targets if i == 0 else {})
        for t in exact:
            g = f"tables/{t.name}"
            missing = [k for k in t.state_names if f"{g}/state/{k}" not in arrays]
            if missing:
                raise ValueError(f"checkpoint table {t.name!r} lacks optimizer state {missing}")
            out[t.name].append((arrays[f"{g}/ids"], arrays[f"{g}/weights"],
                                {k: arrays[f"{g}/state/{k}"] for k in t.state_names}))
    return out


def restore_dense(path, model, optimizer, rank: int | None = None) -> None:
    """Workers: load the dense model and optimizer state, and worker ``rank``'s torch RNG. Local.

    Data positions need no restoring: global batch ``t`` is a pure function of ``t``, so a job
    resumed at step ``t`` (with any number of workers) reads exactly the samples not yet seen."""
    import torch
    osd, extra = load_dense_model(path, model)
    state = {i: {k: torch.from_numpy(np.asarray(v)) if isinstance(v, np.ndarray) else v for k, v in st.items()}
             for i, st in osd["state"].items()}
    optimizer.load_state_dict({"state": state, "param_groups": osd["param_groups"]})
    rngs = extra.get("torch_rng")
    if rngs is not None and rank is not None and rngs.ndim == 2 and rank < rngs.shape[0]:
        torch.set_rng_state(torch.from_numpy(rngs[rank].copy()))   # same worker count: its own stream


def load_dense_model(path, model) -> tuple:
    """Load checkpoint ``path``'s dense model into ``model`` (a ``ValueError`` naming the tensors
    that differ); returns the rest of ``dense.h5``: ``(optimizer state_dict, extra arrays)``. Local."""
    import torch
    model_arrays, osd, extra = read_dense(Path(path) / "dense.h5")
    mine = model.state_dict()
    diff = [f"{k}: {list(np.shape(v))} in the checkpoint, {list(mine[k].shape)} in the job"
            for k, v in model_arrays.items() if k in mine and tuple(np.shape(v)) != tuple(mine[k].shape)]
    diff += [f"{k}: only in the checkpoint" for k in model_arrays if k not in mine]
    diff += [f"{k}: only in the job" for k in mine if k not in model_arrays]
    if diff:
        raise ValueError(f"checkpoint {path}: the dense model differs (model.bottom_mlp, model.top_mlp, "
                         f"model.dim?): " + "; ".join(diff[:6]) + (f"; and {len(diff) - 6} more" if len(diff) > 6 else ""))
    model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in model_arrays.items()}, strict=True)
    return osd, extra
