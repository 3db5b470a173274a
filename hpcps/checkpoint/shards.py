"""HDF5 contents of a checkpoint: PS shard files and the dense file. Plain HDF5 (h5py, h5dump
read them), never pickle. Local."""

import contextlib
import errno
import json
import os
import threading

import h5py
import numpy as np
from h5py import h5d, h5p

from . import digest
from .store import FILE_MODE, fsync_path

__all__ = ["write_shard", "read_rows", "shard_applies", "write_dense", "read_dense", "shard_file"]

CHUNK_ROWS = 1 << 14


def shard_file(ps: int) -> str:
    return f"ps-{ps:05d}.h5"


class Background(threading.Thread):
    """Run ``fn(*args)`` now in a daemon thread; its exception is kept in ``error`` and
    ``join()`` re-raises it here."""

    def __init__(self, fn, *args):
        super().__init__(daemon=True)
        self.fn, self.args, self.error = fn, args, None
        self.start()

    def run(self):
        try:
            self.fn(*self.args)
        except BaseException as e:      # noqa: BLE001 - re-raised by join
            self.error = e

    def join(self, timeout=None):
        super().join(timeout)
        if self.error is not None:
            raise self.error


def _payload(arrays) -> int:
    return sum(int(np.asarray(a).nbytes) for a in arrays)


class _File:
    """An HDF5 file being written: h5py lays out every dataset (metadata, chunk index, space
    allocated up front, no fill), and the bulk bytes of uncompressed datasets are written after
    h5py closes the file, with ``os.pwrite`` at each chunk's offset: no chunk cache, no copies,
    and the GIL released while the serve loop runs. Compressed datasets go through h5py."""

    RAW_MIN = 1 << 16           # smaller datasets are written by h5py

    def __init__(self, f):
        self.f, self.raw = f, []

    def dataset(self, g, name, data, compression=""):
        data = np.ascontiguousarray(data)
        chunks = None
        if data.ndim >= 1 and data.shape[0] > 0:
            # equal chunks of at most CHUNK_ROWS rows: HDF5 allocates the last chunk whole, so a
            # fixed size would write up to one chunk of padding per dataset
            n = -(-data.shape[0] // CHUNK_ROWS)
            chunks = (-(-data.shape[0] // n),) + data.shape[1:]
        if compression or chunks is None or data.nbytes < self.RAW_MIN:
            return g.create_dataset(name, data=data, chunks=chunks, compression=compression or None)
        dcpl = h5p.create(h5p.DATASET_CREATE)
        dcpl.set_chunk(chunks)
        dcpl.set_alloc_time(h5d.ALLOC_TIME_EARLY)
        dcpl.set_fill_time(h5d.FILL_TIME_NEVER)
        ds = g.create_dataset(name, shape=data.shape, dtype=data.dtype, dcpl=dcpl)
        flat = data.reshape(data.shape[0], -1)
        rows = chunks[0]

        def add(info):
            r = info.chunk_offset[0]
            self.raw.append((info.byte_offset, flat[r:r + rows]))
        ds.id.chunk_iter(add)
        return ds

    def write_and_hash(self, path, algo: str = "sha256") -> str:
        """After h5py closed the file: write the bulk blocks from a thread while this one hashes
        the whole file in order (the blocks from memory, the bytes h5py wrote between them from
        the file); both release the GIL, so hashing hides behind the write. Returns the digest
        (``algo``: :mod:`hpcps.checkpoint.digest`)."""
        blocks = sorted(((off, memoryview(b).cast("B")) for off, b in self.raw), key=lambda x: x[0])
        writer = Background(self._pwrite_all, path, blocks)
        h = digest.new(algo)
        with open(path, "rb") as f:
            pos = 0
            for offset, view in blocks:
                if offset > pos:                    # metadata, or padding of a last chunk
                    f.seek(pos)
                    h.update(f.read(offset - pos))
                h.update(view)
                pos = offset + view.nbytes
            f.seek(pos)
            h.update(f.read())
        writer.join()
        return h.hexdigest()

    @staticmethod
    def _pwrite_all(path, blocks) -> None:
        fd = os.open(path, os.O_WRONLY)
        try:
            for offset, view in blocks:
                while view:
                    n = os.pwrite(fd, view, offset)
                    view, offset = view[n:], offset + n
        finally:
            os.close(fd)


@contextlib.contextmanager
def _create(path, payload: int, datasets: int, file_mode: int = FILE_MODE, algo: str = "sha256"):
    """Write an HDF5 file to ``path`` (see ``_File``), hashing it while its bulk is written,
    fsync it, and leave ``<path>.<algo>`` (its checksum) for the commit.

    A full disk must be a clear ``OSError`` and never a half-written file that looks whole: the
    free space is checked first against the payload plus HDF5's overhead, and a write that fails
    anyway (a quota, a filesystem filling up meanwhile) removes the partial file and re-raises
    as ``OSError`` naming it."""
    path = os.fspath(path)
    need = payload + payload // 50 + (16 << 10) + 4096 * datasets
    st = os.statvfs(os.path.dirname(path) or ".")
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: {path} needs about {need} bytes, "
                                    f"the filesystem has {free} free")
    # created with its final mode before any byte is in it (h5py would use 0666 & ~umask)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, file_mode))
    os.chmod(path, file_mode)
    try:
        with h5py.File(path, "w", locking=False) as f:
            out = _File(f)
            yield out
        value = out.write_and_hash(path, algo)
        fsync_path(path)
    except Exception as e:
        with contextlib.suppress(OSError):
            os.unlink(path)
        if isinstance(e, OSError) and e.errno:
            raise
        raise OSError(errno.EIO, f"writing {path} failed: {e}") from e
    # the writer hashes its own file (in parallel on every PS) so the commit need not read it back;
    # a later verify reads it again, so a bad write is caught there
    with open(f"{path}.{algo}", "w") as side:
        side.write(value)


def write_shard(path, step: int, ps: int, num_ps: int, tables: dict, compression: str = "",
                file_mode: int = FILE_MODE, algo: str = "sha256") -> None:
    """One PS's snapshot: ``tables[name] = {"ids", "weights", "state": {k: array}, "applies",
    "num_rows", "dim", "optimizer"}``, and optionally ``"extra"`` (more arrays, by name) and
    ``"attrs"`` (more attributes: a dynamic table's). Local."""
    arrays = [a for t in tables.values()
              for a in (t["ids"], t["weights"], *t["state"].values(), *t.get("extra", {}).values())]
    with _create(path, _payload(arrays), len(arrays), file_mode, algo) as out:
        f = out.f
        f.attrs.update({"step": step, "ps_rank": ps, "num_ps": num_ps, "format": "hpcps-shard-1"})
        for name, t in tables.items():
            g = f.create_group(f"tables/{name}")
            g.attrs.update({"num_rows": t["num_rows"], "dim": t["dim"], "applies": t["applies"],
                            "optimizer": t["optimizer"], **t.get("attrs", {})})
            out.dataset(g, "ids", t["ids"], compression)
            out.dataset(g, "weights", t["weights"], compression)
            for k, v in t["state"].items():
                out.dataset(g, f"state/{k}", v, compression)
            for k, v in t.get("extra", {}).items():
                out.dataset(g, k, v, compression)


def shard_applies(paths, name: str) -> int:
    """The most optimizer steps any of the shard files ``paths`` records for table ``name``. Local."""
    applies = 0
    for path in paths:
        with h5py.File(path, "r", locking=False) as f:
            applies = max(applies, int(f[f"tables/{name}"].attrs["applies"]))
    return applies


def _whole(ds, path, into=None) -> np.ndarray:
    """All of dataset ``ds`` of file ``path``, read into ``into`` when that is an array of its
    shape and type (memory already in use: no fresh pages to fault in, ~3 s a GB on this VM). An
    uncompressed chunked dataset (what :class:`_File` writes) is read chunk by chunk with
    ``os.preadv`` straight into the array: h5py's own read of a 1 GB shard took ~3x as long.
    Anything else through h5py. Local."""
    fits = into is not None and into.shape == ds.shape and into.dtype == ds.dtype and into.flags.c_contiguous
    if ds.chunks is None or ds.compression is not None or ds.id.get_create_plist().get_nfilters() or ds.size == 0:
        if fits:
            ds.read_direct(into)
            return into
        return ds[...]
    out = into if fits else np.empty(ds.shape, ds.dtype)
    flat = out.reshape(out.shape[0], -1).view(np.uint8)
    rows = ds.chunks[0]
    spans = []
    ds.id.chunk_iter(lambda info: spans.append((info.chunk_offset[0], info.byte_offset, info.size)))
    if sum(n for _, _, n in spans) < out.nbytes and len(spans) * rows < out.shape[0]:
        return ds[...]                      # chunks not all written (never by hpcps): h5py fills them
    fd = os.open(path, os.O_RDONLY)
    try:
        for first, offset, size in spans:
            view = memoryview(flat[first:first + rows]).cast("B")[:size]
            while view:
                n = os.preadv(fd, [view], offset)
                if n <= 0:
                    raise OSError(f"{path}: short read of a chunk")
                view, offset = view[n:], offset + n
    finally:
        os.close(fd)
    return out


def read_rows(paths, name: str, sharding, ps: int, dim: int, state_names, span=None, shift: int = 0, into=None):
    """Yield ``(ids, weights, state)`` of the rows of table ``name`` that PS ``ps`` owns under
    ``sharding``, from every shard file, whatever number of PS wrote them and however they were
    placed (rows are matched by global id): one chunk per file, what
    :meth:`hpcps.EmbeddingTable.restore` takes. ``span = (lo, hi)``: only the checkpoint's ids in
    ``[lo, hi)``, each as job id ``id + shift`` (one logical table of a table-batched table, or
    into one). ``into``: the PS's arrays (``restore_targets``) that a file of exactly its rows, in
    its order, is read straight into. Local."""
    for path in paths:
        with h5py.File(path, "r", locking=False) as f:
            g = f[f"tables/{name}"]
            if g["weights"].shape[1] != dim:
                raise ValueError(f"checkpoint table {name!r} has dim {g['weights'].shape[1]}, the job has {dim}")
            missing = set(state_names) - set(g.get("state", {}))
            if missing:
                raise ValueError(f"checkpoint table {name!r} lacks optimizer state {sorted(missing)} "
                                 f"(written by {g.attrs['optimizer']})")
            ids = g["ids"][...]
            keep = np.ones(ids.shape, bool) if span is None else (ids >= span[0]) & (ids < span[1])
            ids = ids + shift
            mine = keep & (sharding.owner(ids) == ps)
            if not mine.any():
                continue
            if mine.all():              # this PS's own file (the same layout): no copy through a mask
                dst = into if into and sharding.in_order(ps, ids) else {}   # its order too
                yield ids, _whole(g["weights"], path, dst.get("weights")), \
                    {k: _whole(g[f"state/{k}"], path, dst.get(k)) for k in state_names}
                continue
            yield (ids[mine], g["weights"][...][mine],
                   {k: g[f"state/{k}"][...][mine] for k in state_names})


def write_dense(path, step: int, model_state: dict, optim_state: dict, extra: dict,
                file_mode: int = FILE_MODE, algo: str = "sha256") -> None:
    """Worker 0's snapshot: model tensors, the torch optimizer's state (tensors per parameter
    index; hyper-parameters as JSON), RNG state and reader positions. Local."""
    arrays = [*model_state.values(), *(v for st in optim_state["state"].values() for v in st.values()),
              *extra.values()]
    with _create(path, _payload(arrays), len(arrays), file_mode, algo) as out:
        f = out.f
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
