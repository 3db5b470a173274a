"""Checkpoint directories on a (parallel) filesystem: layout, manifest, commit, verify, prune.

    <dir>/step-000001200/          one committed checkpoint
        manifest.json              step, time, num_ps, num_workers, tables, sharding,
                                   files with SHA-256 and size, versions, config
        ps-00000.h5 ...            one HDF5 file per PS rank (global ids, weights, state)
        dense.h5                   dense model + optimizer state, RNG, reader positions
    <dir>/step-000001200.tmp/      being written (ignored, removed on the next commit)
    <dir>/latest                   name of the newest committed checkpoint
    <dir>/best                     JSON: the best-evaluated checkpoint (``checkpoint.keep_best``),
                                   never pruned
    <dir>/PINS/<host>-<pid>        JSON: checkpoints a predict or evaluate reads, never pruned
                                   while it lives (``lock.pin``)

A checkpoint is written under ``.tmp``, every file and the directory are
fsynced, and one ``rename`` commits it; ``latest`` moves only after that, and
older ones are pruned only after it. No MPI here: every function is local.
"""

import contextlib
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

from . import digest
from .lock import pinned

__all__ = ["step_dir", "tmp_dir", "file_digests", "list_checkpoints", "verify", "verify_chain", "chain", "newest_verified",
           "trust_own_commits", "commit", "resolve", "inside_checkpoint", "write_new", "mark_best", "read_best",
           "read_manifest", "MANIFEST", "DIR_MODE", "FILE_MODE"]

logger = logging.getLogger(__name__)
MANIFEST = "manifest.json"
DIR_MODE, FILE_MODE = 0o700, 0o600
_NAME = re.compile(r"^step-(\d{9,})$")
_COMMITTED: dict = {}       # {checkpoint: {file: (its identity, digest)}} of this process's last commits
_COMMITTED_KEPT = 8
_TRUST_OWN = [False]


def trust_own_commits(on: bool = True) -> None:
    """From now on, :func:`verify` does not hash again a file this process committed that still has
    the inode, size and modification time it had then (its digest was taken as it was written).
    A live failover turns it on: it resumes from the checkpoint its rank 0 committed seconds
    before. Off by default (file times are coarse: a rewrite within a few ms keeps the time). Local."""
    _TRUST_OWN[0] = bool(on)


def step_dir(root, step: int) -> Path:
    return Path(root) / f"step-{step:09d}"


def tmp_dir(root, step: int) -> Path:
    return Path(root) / f"step-{step:09d}.tmp"


def sha256(path) -> str:
    return digest.of_file(path, "sha256")


def dumps(obj) -> str:
    """A manifest's text."""
    return json.dumps(obj, indent=1, sort_keys=True) + "\n"


def fsync_path(path) -> None:
    """fsync a file or a directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(root) -> list[Path]:
    """Committed checkpoint directories, oldest first (verification not implied)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def mark_best(root, step: int, info: dict, file_mode: int = FILE_MODE) -> None:
    """Record committed checkpoint ``step`` as the best one (``info``: the metric and its value,
    the eval results); pruning keeps it and its chain. Local: worker 0, after the commit."""
    text = json.dumps({"checkpoint": step_dir(root, step).name, "step": step, **info}, sort_keys=True)
    write_new(Path(root) / "best.tmp", text + "\n", file_mode)
    os.replace(Path(root) / "best.tmp", Path(root) / "best")
    fsync_path(root)


def read_best(root) -> dict | None:
    """The ``best`` record of a checkpoint directory (with ``path``), or None when there is none or
    its checkpoint is gone. Local."""
    try:
        best = json.loads((Path(root) / "best").read_text())
        path = Path(root) / best["checkpoint"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return {**best, "path": path} if _NAME.match(path.name) and path.is_dir() else None


def remove_tree(path: Path, ignore_errors: bool = False) -> None:
    """Remove directory ``path`` and what it holds; a symbolic link or a file there is unlinked
    (never followed). An ``OSError`` names the path. Local."""
    try:
        if path.is_symlink() or path.is_file():
            path.unlink()
        else:
            shutil.rmtree(path)
    except OSError as e:
        if not ignore_errors:
            raise OSError(e.errno, f"cannot remove {path}: {e.strerror or e}") from None


def read_manifest(path) -> dict:
    """The manifest of checkpoint ``path``; ``ValueError`` when it is not a JSON object. Local."""
    try:
        with open(Path(path) / MANIFEST, encoding="utf-8") as f:
            man = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{Path(path).name}: {MANIFEST} is not JSON ({e}): the checkpoint is damaged") from None
    if not isinstance(man, dict):
        raise ValueError(f"{Path(path).name}: {MANIFEST} is not a JSON object")
    return man


def _identity(f: Path) -> tuple:
    """What changes when a file is rewritten or replaced: inode, size, modification time."""
    st = f.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


def verify(path, only=None) -> tuple[bool, str]:
    """(True, "ok") if the manifest reads and every file has its size and checksum (SHA-256, or
    CRC-32 on the node-local level: :mod:`hpcps.checkpoint.digest`), else (False, why); but see
    :func:`trust_own_commits`. ``only``: check the contents of these files alone (the manifest as
    a whole still). Local."""
    path = Path(path)
    try:
        man = read_manifest(path)
    except (OSError, ValueError) as e:
        return False, f"{path.name}: manifest unreadable ({e})"
    files = man.get("files")
    if not isinstance(files, dict) or not all(isinstance(m, dict) and isinstance(m.get("bytes"), int)
                                              and digest.algo_of(m) for m in files.values()):
        return False, f"{path.name}: the manifest's files are not {{name: {{bytes, sha256 or crc32}}}}"
    for name, meta in files.items():
        if "/" in name or name in ("", ".", ".."):
            return False, f"{path.name}: the manifest names a file outside the checkpoint: {name!r}"
    for name in (files if only is None else only):
        why = _check_file(path, name, files.get(name))
        if why:
            return False, why
    if not files:
        return False, f"{path.name}: the manifest lists no files"
    for key, kind in (("step", int), ("num_ps", int), ("num_workers", int), ("tables", list)):
        if not isinstance(man.get(key), kind) or isinstance(man.get(key), bool):
            return False, f"{path.name}: the manifest's {key} is {man.get(key)!r}, not a {kind.__name__}"
    named = _NAME.match(path.name)
    if named and int(named.group(1)) != man["step"]:
        return False, (f"{path.name}: the manifest says step {man['step']}, its directory step {int(named.group(1))} "
                       f"(the manifest was edited?)")
    return True, "ok"


def _check_file(path: Path, name: str, meta) -> str:
    """Why file ``name`` of checkpoint ``path`` does not match its manifest entry ``meta``; "" if it does."""
    if meta is None:
        return f"{path.name}: the manifest does not list {name}"
    f = path / name
    try:
        size = f.stat().st_size
    except OSError:
        return f"{path.name}: {name} is missing"
    if size != meta["bytes"]:
        return f"{path.name}: {name} has {size} bytes, the manifest says {meta['bytes']} (truncated?)"
    algo = digest.algo_of(meta)
    if _TRUST_OWN[0] and _COMMITTED.get(os.path.abspath(path), {}).get(name) == (_identity(f), meta[algo]):
        return ""                                   # committed by this process, unchanged since
    if digest.of_file(f, algo) != meta[algo]:
        return f"{path.name}: {name} fails its {digest.NAMES[algo]} check (corrupted)"
    return ""


def chain(path) -> list[Path]:
    """The checkpoints a restore of ``path`` reads, oldest first: its full baseline, then the
    incremental ones up to ``path`` (just ``[path]`` for a full checkpoint). Raises
    ``ValueError`` on a manifest whose ``parent`` is not a checkpoint name, leads back to a
    checkpoint already in the chain (a loop), or is not older."""
    path = Path(path)
    links = [path]
    while True:
        man = read_manifest(links[0])
        parent = man.get("parent")
        if not parent:
            return links
        if not isinstance(parent, str) or not _NAME.match(parent):
            raise ValueError(f"{links[0].name}: manifest parent {parent!r} is not a checkpoint name")
        child = _NAME.match(links[0].name)
        if parent in {p.name for p in links} or (child and int(_NAME.match(parent).group(1)) >= int(child.group(1))):
            raise ValueError(f"{links[0].name}: manifest parent {parent!r} is not an older checkpoint (a loop)")
        links.insert(0, path.parent / parent)


def verify_chain(path) -> tuple[bool, str]:
    """``verify`` for ``path`` and every checkpoint its restore needs."""
    try:
        links = chain(path)
    except (OSError, ValueError) as e:
        why = f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.filename else str(e)
        if why.startswith(f"{Path(path).name}: "):            # its own manifest
            return False, why
        return False, f"{Path(path).name}: a checkpoint it builds on is unreadable ({why})"
    for p in reversed(links):
        ok, why = verify(p)
        if not ok:
            return False, why if p == Path(path) else f"{Path(path).name} builds on {why}"
    return True, "ok"


def newest_verified(root, report=None) -> Path | None:
    """The newest checkpoint that verifies (with what it builds on); each one that does not is
    reported and skipped."""
    for path in reversed(list_checkpoints(root)):
        ok, why = verify_chain(path)
        if ok:
            return path
        (report or logger.warning)(f"hpcps: skipping checkpoint {why}")
    return None


def resolve(spec: str, root) -> Path | None:
    """``resume`` setting -> checkpoint to load: "auto" (newest verified in root, or None), "none",
    or a path (a checkpoint, or a directory of them meaning its newest verified one). Raises
    ``ValueError`` when an explicit path does not verify."""
    if spec == "none":
        return None
    if spec == "auto":
        if not root:
            return None
        failed = []
        found = newest_verified(root, report=failed.append)
        if found is None and failed:
            raise ValueError(f"no checkpoint in {root} verifies ({'; '.join(f.removeprefix('hpcps: skipping checkpoint ') for f in failed)}): "
                             f"not starting over from step 0 over them; start a fresh run in another "
                             f"checkpoint.dir (with checkpoint.resume=none; these are kept), or set "
                             f"checkpoint.resume=PATH")
        for why in failed:
            logger.warning(why)
        return found
    p = Path(spec)
    if (p / MANIFEST).exists():
        ok, why = verify_chain(p)
        if not ok:
            raise ValueError(f"checkpoint {p} does not verify: {why}")
        return p
    found = newest_verified(p)
    if found is None:
        raise ValueError(f"no verified checkpoint at {spec}")
    return found


def write_new(path: Path, text: str, mode: int = FILE_MODE) -> None:
    """Write ``text`` to a new file ``path`` with ``mode``, fsynced. Whatever is at ``path`` (a
    stale file, or a symlink planted there) is removed first, never followed. Local."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    os.fchmod(fd, mode)                      # exactly the mode, whatever the umask
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def inside_checkpoint(path, root=None) -> Path | None:
    """The checkpoint directory (``step-N`` or ``step-N.tmp``) that ``path`` lies in or is, else
    None. Local."""
    p = Path(path).resolve()
    for d in (p, *p.parents):
        if _NAME.match(d.name) or re.match(r"^step-\d{9,}\.tmp$", d.name):
            return d
    return None


def file_digests(folder, algo: str = "sha256") -> dict:
    """``{name: {"bytes", algo}}`` of the files of a directory being committed: a file's
    ``<name>.<algo>`` beside it (its writer hashed the bytes it wrote) is taken and removed; a file
    without one is fsynced and hashed here. Local."""
    files = {}
    sides = tuple(f".{a}" for a in digest.ALGOS)
    for f in sorted(Path(folder).iterdir()):
        if f.name == MANIFEST or f.name.endswith(sides):
            continue
        side = f.with_name(f"{f.name}.{algo}")
        if side.exists():
            value = side.read_text().strip()
            side.unlink()
        else:
            fsync_path(f)
            value = digest.of_file(f, algo)
        files[f.name] = {"bytes": f.stat().st_size, algo: value}
    return files


def commit(root, step: int, manifest: dict, keep: int, file_mode: int = FILE_MODE, prunable=None) -> Path:
    """Checksum the files of ``tmp_dir(root, step)``, write the manifest, fsync, rename into
    place, move ``latest``, then prune to the newest ``keep`` (0 = keep all), deleting only
    checkpoints ``prunable(name)`` allows (default: any). A checkpoint already at this step is
    moved aside (``step-N.replaced-<time>``), never deleted. Local: one rank calls it once every
    file is written."""
    tmp, final = tmp_dir(root, step), step_dir(root, step)
    manifest = {**manifest, "files": file_digests(tmp), "committed_at": time.time()}
    man = tmp / MANIFEST
    with open(man, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(man, file_mode)
    fsync_path(tmp)
    if final.exists():                       # another run's checkpoint at this step: kept aside, not lost
        aside = final.with_name(f"{final.name}.replaced-{int(time.time())}")
        os.rename(final, aside)
        logger.warning("hpcps: %s existed (another run's): moved to %s", final, aside.name)
    os.rename(tmp, final)
    fsync_path(root)
    _COMMITTED[os.path.abspath(final)] = {name: (_identity(final / name), meta[digest.algo_of(meta)])
                                          for name, meta in manifest["files"].items()}
    while len(_COMMITTED) > _COMMITTED_KEPT:          # the oldest commit's (dicts keep their order)
        del _COMMITTED[next(iter(_COMMITTED))]
    write_new(Path(root) / "latest.tmp", final.name + "\n", file_mode)
    os.replace(Path(root) / "latest.tmp", Path(root) / "latest")
    fsync_path(root)
    if keep > 0:
        kept = list_checkpoints(root)[-keep:]
        best = read_best(root)
        if best is not None:
            kept.append(best["path"])
        kept += [Path(root) / name for name in pinned(root) if (Path(root) / name).is_dir()]
        needed = set()
        for k in kept:
            try:
                needed.update(p.name for p in chain(k))
            except (OSError, ValueError):
                needed.add(k.name)
        for old in list_checkpoints(root):
            if old.name not in needed and (prunable is None or prunable(old.name)):
                # renamed out of the checkpoint namespace first: a kill during the delete leaves
                # a ``.del`` directory (removed next time), never a half-deleted checkpoint
                gone = old.with_name(old.name + ".del")
                os.rename(old, gone)
                shutil.rmtree(gone, ignore_errors=True)
    for stale in [*Path(root).glob("step-*.tmp"), *Path(root).glob("step-*.del")]:
        if stale != tmp:
            remove_tree(stale, ignore_errors=True)
    return final
