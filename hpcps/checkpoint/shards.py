"""HDF5 contents of a checkpoint: PS shard files and the dense file. Plain HDF5 (h5py, h5dump
read them), never pickle. Local."""

import contextlib
import hashlib
import io
import json
import os

import h5py
import numpy as np

from .store import FILE_MODE

__all__ = ["write_shard", "load_rows", "write_dense", "read_dense", "shard_file"]

CHUNK_ROWS = 1 << 14


def shard_file(ps: int) -> str:
    return f"ps-{ps:05d}.h5"


@contextlib.contextmanager
def _create(path):
    """Build the HDF5 image in memory, then write and fsync it with plain OS calls, so a full
    disk is one ``OSError`` here and never an HDF5 error surfacing later from a half-closed file."""
    buf = io.BytesIO()
    with h5py.File(buf, "w") as f:
        yield f
    data = buf.getbuffer()
    # The writer hashes its own image (in parallel on every PS) so the commit need not read it back;
    # a later verify still reads the file, so a bad write is caught there.
    with open(f"{path}.sha256", "w") as side:
        side.write(hashlib.sha256(data).hexdigest())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)


def _dataset(g, name, data, compression):
    chunks = None
    if data.ndim >= 1 and data.shape[0] > 0:
        chunks = (min(CHUNK_ROWS, data.shape[0]),) + data.shape[1:]
    g.create_dataset(name, data=data, chunks=chunks, compression=compression or None)


def write_shard(path, step: int, ps: int, num_ps: int, tables: dict, compression: str = "") -> None:
    """One PS's snapshot: ``tables[name] = {"ids", "weights", "state": {k: array}, "applies",
    "num_rows", "dim", "optimizer"}``."""
    with _create(path) as f:
        f.attrs.update({"step": step, "ps_rank": ps, "num_ps": num_ps, "format": "hpcps-shard-1"})
        for name, t in tables.items():
            g = f.create_group(f"tables/{name}")
            g.attrs.update({"num_rows": t["num_rows"], "dim": t["dim"], "applies": t["applies"],
                            "optimizer": t["optimizer"]})
            _dataset(g, "ids", t["ids"], compression)
            _dataset(g, "weights", t["weights"], compression)
            for k, v in t["state"].items():
                _dataset(g, f"state/{k}", v, compression)


def load_rows(paths, name: str, owner, num_ps: int, ps: int, weights: np.ndarray, state: dict,
              complete: bool = True) -> int:
    """Fill this PS's ``weights`` and ``state`` for table ``name`` from every shard file, whatever
    number of PS wrote them (rows are matched by global id). ``complete``: a full checkpoint
    must hold every row (an incremental one only the changed ones). Returns the update count."""
    applies = 0
    filled = 0
    for path in paths:
        with h5py.File(path, "r", locking=False) as f:
            g = f[f"tables/{name}"]
            if g["weights"].shape[1] != weights.shape[1]:
                raise ValueError(f"checkpoint table {name!r} has dim {g['weights'].shape[1]}, "
                                 f"the job has {weights.shape[1]}")
            missing = set(state) - set(g.get("state", {}))
            if missing:
                raise ValueError(f"checkpoint table {name!r} lacks optimizer state {sorted(missing)} "
                                 f"(written by {g.attrs['optimizer']})")
            applies = max(applies, int(g.attrs["applies"]))
            ids = g["ids"][...]
            mine = owner(ids) == ps
            if not mine.any():
                continue
            local = ids[mine] // num_ps
            weights[local] = g["weights"][...][mine]
            for k, arr in state.items():
                arr[local] = g[f"state/{k}"][...][mine]
            filled += int(mine.sum())
    if complete and filled != weights.shape[0]:
        raise ValueError(f"checkpoint table {name!r}: found {filled} of this PS's {weights.shape[0]} rows")
    return applies


def write_dense(path, step: int, model_state: dict, optim_state: dict, extra: dict) -> None:
    """Worker 0's snapshot: model tensors, the torch optimizer's state (tensors per parameter
    index; hyper-parameters as JSON), RNG state and reader positions."""
    with _create(path) as f:
        f.attrs.update({"step": step, "format": "hpcps-dense-1"})
        for k, v in model_state.items():
            f.create_dataset(f"model/{k}", data=v)
        for idx, st in optim_state["state"].items():
            for k, v in st.items():
                f.create_dataset(f"optimizer/state/{idx}/{k}", data=np.asarray(v))
        f.attrs["optimizer_param_groups"] = json.dumps(optim_state["param_groups"])
        for k, v in extra.items():
            f.create_dataset(f"extra/{k}", data=v)


def read_dense(path) -> tuple[dict, dict, dict]:
    """(model tensors as arrays, torch optimizer state_dict with arrays, extra arrays)."""
    with h5py.File(path, "r", locking=False) as f:
        model = {}
        f["model"].visititems(lambda k, d: model.__setitem__(k, d[...]) if isinstance(d, h5py.Dataset) else None)
        state = {}
        if "optimizer/state" in f:
            for idx, g in f["optimizer/state"].items():
                state[int(idx)] = {k: d[...] for k, d in g.items()}
        groups = json.loads(f.attrs["optimizer_param_groups"])
        extra = {k: d[...] for k, d in f["extra"].items()} if "extra" in f else {}
    return model, {"state": state, "param_groups": groups}, extra
