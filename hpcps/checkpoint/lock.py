"""One job per checkpoint directory: ``<dir>/LOCK`` names the job that writes there.

Two jobs writing one directory would interleave their checkpoints and prune each other's.
The job's world rank 0 creates ``LOCK`` (``O_EXCL``, never following a symlink) with its host,
process, Slurm job and start time, refreshes its time every ``BEAT_S`` while it trains and
removes it when training is done. A second job finds it and refuses, naming the first, unless
the lock is stale: its process is gone (same host), it belongs to the same Slurm job (a
requeue), or it was not refreshed for ``STALE_S``. No MPI here: local.
"""

import json
import os
import socket
import time
from pathlib import Path

__all__ = ["DirLock", "STALE_S", "BEAT_S", "pin", "unpin", "pinned"]

PINS = "PINS"           # <checkpoint.dir>/PINS/<host>-<pid>: a reader's checkpoint, which pruning keeps
PIN_STALE_S = 3600.0    # a pin of another host is kept this long (its process cannot be asked)

STALE_S, BEAT_S = 120.0, 20.0


_job_token = None           # one launch's id: its ranks take over each other's locks (set_job_token)


def set_job_token(token: str | None) -> None:
    """Name this launch (the same on every rank): a lock a rank of it took counts as this job's, so
    another of its ranks takes it over once a lost rank's work moved (``hpcps.train.failover``). Local."""
    global _job_token
    _job_token = token


def _me() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job": os.environ.get("SLURM_JOB_ID"),
            "time": time.time(), "launch": _job_token}


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError, TypeError):
        return False
    except PermissionError:
        return True
    return True


class DirLock:
    """The lock of checkpoint directory ``root`` (``<root>/LOCK``), or of the file ``path`` where
    given (``what`` names what it guards in the refusal). Local."""

    def __init__(self, root=None, path=None, what: str = ""):
        self.path = Path(path) if path is not None else Path(root) / "LOCK"
        self.what = what or f"checkpoint.dir {self.path.parent}"
        self.held = False
        self._beat = 0.0

    def holder(self) -> dict | None:
        """The live job that holds the lock (not this process), or None: what :meth:`acquire`
        would refuse on, read only. Local."""
        found = self._holder()
        if found is None or self._stale(*found, _me()) or found[0].get("pid") == os.getpid():
            return None
        return found[0]

    def _holder(self):
        """``(holder dict or None, seconds since it was refreshed)``, or None when there is no lock."""
        try:
            age = time.time() - self.path.lstat().st_mtime
            holder = json.loads(self.path.read_text()) if not self.path.is_symlink() else None
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            holder = None
        return (holder if isinstance(holder, dict) else None), age

    def _stale(self, holder, age: float, me: dict) -> bool:
        if holder is None or age > STALE_S:
            return True
        if me["slurm_job"] and holder.get("slurm_job") == me["slurm_job"]:
            return True                                  # a requeued run of the same Slurm job
        if me.get("launch") and holder.get("launch") == me["launch"]:
            return True                                  # this launch, before a rank was lost
        return holder.get("host") == me["host"] and not _alive(holder.get("pid"))

    def acquire(self) -> None:
        """Take the lock, or raise ``ValueError`` naming the job that holds it."""
        me = _me()
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            except FileExistsError:
                found = self._holder()
                if found is None:
                    continue
                holder, age = found
                if not self._stale(holder, age, me):
                    raise ValueError(
                        f"{self.what} is in use by another job: host {holder.get('host')}, "
                        f"process {holder.get('pid')}, Slurm job {holder.get('slurm_job') or '-'}, started "
                        f"{time.strftime('%F %T', time.localtime(holder.get('time', 0)))}, alive {age:.0f} s ago "
                        f"({self.path}); two jobs must not write there at once. If that job is gone, "
                        f"remove {self.path} or wait {STALE_S:.0f} s")
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held, self._beat = True, time.monotonic()
            return
        raise ValueError(f"could not take {self.path}: other jobs keep taking it")

    def refresh(self) -> None:
        """Holder: say it is alive, at most every ``BEAT_S``."""
        if self.held and time.monotonic() - self._beat > BEAT_S:
            self._beat = time.monotonic()
            try:
                os.utime(self.path, follow_symlinks=False)
            except OSError:
                pass

    def release(self) -> None:
        """Holder: remove the lock (training is done). Safe twice."""
        if self.held:
            self.held = False
            self.path.unlink(missing_ok=True)


def pin(root, name: str) -> Path:
    """A reader (predict, evaluate) says it reads checkpoint ``name`` of ``root``: a training job's
    pruning keeps it (:func:`pinned`) until :func:`unpin`, or until the reader's process is gone
    (same host) or :data:`PIN_STALE_S` passed. Returns the pin's path. Local."""
    me = _me()
    d = Path(root) / PINS
    d.mkdir(exist_ok=True)
    path = d / f"{me['host']}-{me['pid']}"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({**me, "checkpoints": sorted({*_pins_of(path), name})}))
    os.replace(tmp, path)
    return path


def _pins_of(path: Path) -> list:
    try:
        return list(json.loads(path.read_text()).get("checkpoints", []))
    except (OSError, ValueError, AttributeError):
        return []


def unpin(path) -> None:
    """Remove a pin :func:`pin` made (the reader is done). Local."""
    Path(path).unlink(missing_ok=True)


def pinned(root) -> set:
    """The checkpoint names live readers of ``root`` pinned; stale pins are removed. Local."""
    out, me = set(), _me()
    for p in (Path(root) / PINS).glob("*"):
        try:
            holder, age = json.loads(p.read_text()), time.time() - p.stat().st_mtime
        except (OSError, ValueError):
            continue
        same = isinstance(holder, dict) and holder.get("host") == me["host"]
        if not isinstance(holder, dict) or (same and not _alive(holder.get("pid"))) or (not same and age > PIN_STALE_S):
            p.unlink(missing_ok=True)
            continue
        out.update(holder.get("checkpoints", []))
    return out
