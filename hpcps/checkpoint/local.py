"""The node-local level of checkpoints (as in SCR and VeloC): each writer's part on its host.

    <checkpoint.local_dir>/<job>/           on every host (node-local: /dev/shm, a local SSD); <job>
                                            names the job's checkpoint.dir (:func:`job_root`), so jobs
                                            sharing a local_dir never touch each other's parts
        step-000000010.r00003/              world rank 3's part of checkpoint 10, committed
            manifest.json                   step, num_ps, num_workers, tables, files (CRC-32),
                                            "shards": the PS indices of its ps-*.h5 files,
                                            "dense": whether it holds dense.h5; a worker's part
                                            also has the job's manifest fields (config, data plan)
            ps-00000.h5                     a PS's own shard, and the partner copies it received
            dense.h5                        a host's first worker: the dense state (the same on
                                            every worker)
        step-000000010.r00003.tmp/          being written (ignored, removed later)

Each part is committed as a checkpoint is (files hashed by their writer, with CRC-32 here:
:mod:`hpcps.checkpoint.digest`; a manifest, fsync, one ``rename``), by its writer alone: no rank waits for another host's disk. A restart gathers every
host's committed parts and takes the newest step that has every PS shard somewhere and a dense
part (:mod:`hpcps.checkpoint.levels`). No MPI here: every function is local.
"""

import contextlib
import os
import re
import shutil
from pathlib import Path

from . import digest, store

__all__ = ["job_root", "part_dir", "part_tmp", "free_copy", "commit_part", "scan", "prune", "drop_after", "set_aside", "write_bytes", "sidecar", "ALGO"]

_PART = re.compile(r"^step-(\d{9,})\.r(\d+)(-\d+)?$")


def job_root(local_dir, ckpt_dir) -> Path:
    """Where the job whose ``checkpoint.dir`` is ``ckpt_dir`` keeps its parts in ``local_dir``: a
    directory named by that path (its last name and a hash of it resolved), the same on every host. Local."""
    import hashlib
    full = str(Path(ckpt_dir).resolve())
    return Path(local_dir) / f"{Path(full).name or 'root'}-{hashlib.sha1(full.encode()).hexdigest()[:10]}"


def part_dir(root, step: int, rank: int, copy: int = 0) -> Path:
    """A part's directory; ``copy`` > 0: a part a restart rebuilt from other hosts' files."""
    return Path(root) / f"step-{step:09d}.r{rank:05d}{f'-{copy}' if copy else ''}"


def part_tmp(root, step: int, rank: int, copy: int = 0) -> Path:
    return part_dir(root, step, rank, copy).with_name(part_dir(root, step, rank, copy).name + ".tmp")


def free_copy(root, step: int, rank: int) -> int:
    """The first ``copy`` number whose part (and its ``.tmp``) does not exist yet. Local."""
    k = 1
    while part_dir(root, step, rank, k).exists() or part_tmp(root, step, rank, k).exists():
        k += 1
    return k


ALGO = "crc32"        # the level's checksum (hpcps.checkpoint.digest)


def sidecar(path) -> str:
    """The checksum a writer left beside ``path``, tagged ``"<algo>:<hex>"``; else its manifest's
    entry (a committed part). Local."""
    for algo in digest.ALGOS:
        side = Path(f"{path}.{algo}")
        if side.exists():
            return f"{algo}:{side.read_text().strip()}"
    entry = store.read_manifest(Path(path).parent)["files"][Path(path).name]
    algo = digest.algo_of(entry)
    return f"{algo}:{entry[algo]}"


def write_bytes(path, data, tagged: str, file_mode: int = store.FILE_MODE) -> None:
    """A received file: ``data`` to ``path`` (fsynced), and its checksum ``tagged`` (the sender's,
    ``"<algo>:<hex>"``) beside it for the commit; raises ``OSError`` when the bytes do not hash to
    it. Local."""
    algo, _, value = tagged.partition(":")
    if algo not in digest.ALGOS or digest.of_bytes(data, algo) != value:
        raise OSError(f"{path}: the bytes received do not match the sender's checksum ({tagged!r})")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, file_mode)
    with os.fdopen(fd, "wb") as f:
        f.write(memoryview(data))
        f.flush()
        os.fsync(f.fileno())
    Path(f"{path}.{algo}").write_text(value)


def commit_part(root, step: int, rank: int, manifest: dict, keep: int, file_mode: int = store.FILE_MODE,
                copy: int = 0, writers=None) -> Path:
    """Commit world rank ``rank``'s part of checkpoint ``step`` (its files in :func:`part_tmp`), then
    prune this host's parts (:func:`prune`; ``writers``: the ranks of this host that write parts).
    Local."""
    tmp, final = part_tmp(root, step, rank, copy), part_dir(root, step, rank, copy)
    files = store.file_digests(tmp, ALGO)
    store.write_new(tmp / store.MANIFEST, store.dumps({**manifest, "files": files, "level": "local"}), file_mode)
    store.fsync_path(tmp)
    if final.exists():                      # a part rebuilt at the same step and rank: the new one wins
        shutil.rmtree(final)
    os.rename(tmp, final)
    store.fsync_path(root)
    prune(root, keep, manifest.get("checkpoint_dir"), writers)
    return final


def scan(root, check: bool = True) -> list[dict]:
    """This host's committed parts, oldest first: ``{"path", "step", "rank", "manifest", "ok",
    "why"}`` (``check``: each verified against its checksums; else ``ok`` is True when its manifest
    reads). Local."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _PART.match(p.name)
        if not m or not p.is_dir():
            continue
        ok, why = store.verify(p) if check else (True, "ok")
        try:
            man = store.read_manifest(p)
        except (OSError, ValueError) as e:
            man, ok, why = {}, False, f"{p.name}: manifest unreadable ({e})"
        out.append({"path": p, "step": int(m.group(1)), "rank": int(m.group(2)), "manifest": man,
                    "ok": ok, "why": why})
    return sorted(out, key=lambda x: (x["step"], x["rank"]))


def _remove(path: Path) -> None:
    """Rename out of the part namespace first: a kill mid-delete leaves a ``.del``, never half a part."""
    gone = path.with_name(path.name + ".del")
    with contextlib.suppress(OSError):
        os.rename(path, gone)
        shutil.rmtree(gone, ignore_errors=True)


def set_aside(part) -> None:
    """A committed part that failed its check while loaded: renamed ``<part>.bad`` (kept for a
    look, out of the part namespace: no restart takes it again). Local."""
    part = Path(part)
    with contextlib.suppress(OSError):
        os.rename(part, part.with_name(part.name + ".bad"))


def drop_after(root, step: int, job_dir) -> None:
    """A job of ``checkpoint.dir`` ``job_dir`` goes on from ``step``: remove this host's parts of
    its later steps (written before a failure, they belong to a run that is abandoned). Local."""
    for p in scan(root, check=False):
        if p["step"] > step and p["manifest"].get("checkpoint_dir") == job_dir:
            _remove(p["path"])


def prune(root, keep: int, job_dir=None, writers=None) -> None:
    """Keep this host's parts of the newest ``keep`` steps (0: all) of the job whose
    ``checkpoint.dir`` is ``job_dir``, and of the steps their chains build on (an incremental
    part needs its full one and the deltas between); remove its other parts. With ``writers``
    (the ranks of this host that write parts: each commits its own in step order, some lagging
    behind others), only steps every writer committed count towards ``keep``, and newer ones are
    kept as still being written. An unfinished part (``.tmp``: a kill mid-write) is removed once
    its writer committed a later step (or, without ``writers``, when older than every step kept).
    Local."""
    parts = [p for p in scan(root, check=False) if job_dir is None or p["manifest"].get("checkpoint_dir") == job_dir]
    steps = sorted({p["step"] for p in parts})
    if keep <= 0 or not steps:
        return
    if writers:
        have = {}
        for p in parts:
            have.setdefault(p["step"], set()).add(p["rank"])
        done = [s for s in steps if set(writers) <= have[s]]
        kept = set(done[-keep:]) | {s for s in steps if not done or s > done[-1]}
    else:
        kept = set(steps[-keep:])
    needed = kept | {s for p in parts if p["step"] in kept for s in p["manifest"].get("chain", [])}
    for p in parts:
        if p["step"] not in needed:
            _remove(p["path"])
    newest = {}
    for p in parts:
        newest[p["rank"]] = max(newest.get(p["rank"], -1), p["step"])
    for stale in [*Path(root).glob("step-*.r*.tmp"), *Path(root).glob("step-*.r*.del")]:
        m = re.match(r"^step-(\d{9,})\.r(\d+)", stale.name)
        if not m:
            continue
        step, rank = int(m.group(1)), int(m.group(2))
        if stale.name.endswith(".del") or (newest.get(rank, -1) > step if writers else step < min(needed)):
            shutil.rmtree(stale, ignore_errors=True)
