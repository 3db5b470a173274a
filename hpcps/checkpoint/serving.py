"""A checkpoint's fixed tables as one HDF5 file of sorted ids and rows, for serving
(``hpcps ckpt export --format serving``). Local, pure (no MPI).

Each logical table (a table-batched table's segments apart) is a group ``tables/<name>`` with
``ids`` (int64, sorted: the row ids a reader's hash gives) and ``rows`` (float32, ``(len(ids),
dim)``, row ``i`` that of ``ids[i]``). Both are contiguous datasets, so that a server can map them
(``numpy.memmap`` at ``dataset.id.get_offset()``) and touch only the pages it looks up. They are
written through such a map, one PS shard's slice at a time, so a table larger than this process's
memory is written without holding it (the page cache holds what it can).
"""

from pathlib import Path

import h5py
import numpy as np

from ..core.sharding import logical_tables
from . import store
from .shards import shard_file

__all__ = ["write_sorted_tables", "SLICE_ROWS"]

SLICE_ROWS = 1 << 20          # rows read from a shard at a time


def _contiguous(f: h5py.File, name: str, shape: tuple, dtype) -> int:
    """A contiguous dataset allocated now (so that it has a file offset); returns that offset."""
    f.require_group(str(Path(name).parent))
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.CONTIGUOUS)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    dsid = h5py.h5d.create(f.id, name.encode(), h5py.h5t.py_create(np.dtype(dtype)),
                           h5py.h5s.create_simple(shape), dcpl=dcpl)
    return dsid.get_offset()


def write_sorted_tables(path, out, attrs: dict | None = None) -> list:
    """Checkpoint ``path``'s fixed tables into the HDF5 file ``out`` (see the module's text), with
    ``attrs`` on the file; returns ``[(name, rows, dim)]``. ``ValueError`` for a dynamic table. Local."""
    p = Path(path)
    man = store.read_manifest(p)
    dynamic = [s["name"] for s in man["tables"] if s.get("dynamic")]
    if dynamic:
        raise ValueError(f"table {dynamic[0]!r} is dynamic: --format serving takes fixed tables "
                         "(export the rows with --format h5)")
    layout = []                                   # (spec, [(name, first, rows, offset)])
    with h5py.File(out, "w", locking=False) as f:
        f.attrs.update(attrs or {})
        for spec in man["tables"]:
            segs = []
            for name, first, n in logical_tables(spec["name"], spec["num_rows"], spec.get("segments")):
                _contiguous(f, f"tables/{name}/ids", (n,), np.int64)
                segs.append((name, first, n, _contiguous(f, f"tables/{name}/rows", (n, spec["dim"]), np.float32)))
            layout.append((spec, segs))
        for spec, segs in layout:
            for name, _, n, _ in segs:
                for a in range(0, n, SLICE_ROWS):
                    f[f"tables/{name}/ids"][a:min(a + SLICE_ROWS, n)] = np.arange(a, min(a + SLICE_ROWS, n), dtype=np.int64)
    for spec, segs in layout:
        _fill(p, out, spec, segs)
    return [(name, n, spec["dim"]) for spec, segs in layout for name, _, n, _ in segs]


def _fill(p: Path, out, spec: dict, segs: list) -> None:
    """Every row of table ``spec`` from the checkpoint's chain (full, then its increments in order)
    into its segments' mapped ``rows``."""
    maps = [np.memmap(out, np.float32, "r+", offset, (n, spec["dim"])) for _, _, n, offset in segs]
    starts = np.array([first for _, first, _, _ in segs], np.int64)
    for link in store.chain(p):
        for ps in range(store.read_manifest(link)["num_ps"]):
            with h5py.File(link / shard_file(ps), "r", locking=False) as f:
                g = f[f"tables/{spec['name']}"]
                for a in range(0, g["ids"].shape[0], SLICE_ROWS):
                    ids, w = g["ids"][a:a + SLICE_ROWS], g["weights"][a:a + SLICE_ROWS]
                    seg = np.searchsorted(starts, ids, side="right") - 1
                    for s in np.unique(seg):
                        on = seg == s
                        maps[s][ids[on] - starts[s]] = w[on]
    for m in maps:
        m.flush()
