"""Losing a pretend host (``scripts/cluster.sh``): its processes, its node-local directory, and the
parts a job committed there. Used by tests/test_hosts.py and scripts/bench_host_loss.py. Local."""

import os
import signal
from pathlib import Path

from hpcps.checkpoint import local, store

__all__ = ["pids_on", "kill_all", "host_local_dir", "parts_of", "assert_ended_unfinished"]


def pids_on(host: str) -> list[int]:
    """The processes in host ``host``'s network namespace (cluster ``$HPCPS_CLUSTER``)."""
    ino = os.stat(f"/run/netns/{os.environ['HPCPS_CLUSTER']}-{host}").st_ino
    mine = []
    for d in os.listdir("/proc"):
        try:
            if d.isdigit() and os.readlink(f"/proc/{d}/ns/net") == f"net:[{ino}]":
                mine.append(int(d))
        except OSError:
            continue
    return mine


def kill_all(pids) -> None:
    """SIGKILL each of ``pids``; one that exited meanwhile (a launcher whose ranks just died) is
    gone already, as wanted."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def host_local_dir(host: str, name: str, ck: Path | None = None) -> Path:
    """Host ``host``'s /dev/shm/``name`` as this (outer) machine sees it (scripts/cluster.sh); with
    ``ck``, the job of that ``checkpoint.dir``'s own directory in it."""
    base = Path(f"/run/hpcps-cluster/{os.environ['HPCPS_CLUSTER']}/shm/{host}/{name}")
    return base if ck is None else local.job_root(base, ck)


def parts_of(local_dir: Path, ck: Path, step: int) -> list:
    """The committed node-local parts in ``local_dir`` of the job of ``checkpoint.dir`` ``ck``, of
    steps from ``step`` on (another job's parts may share the directory)."""
    out = []
    for p in local_dir.glob("step-*.r*[0-9]"):
        try:
            if int(p.name[5:14]) >= step and store.read_manifest(p)["checkpoint_dir"] == str(ck.resolve()):
                out.append(p)
        except (OSError, ValueError, KeyError):
            pass                            # removed meanwhile (pruned)
    return out


def assert_ended_unfinished(code: int, out: str, export: Path) -> None:
    """A launch that lost a host did not finish: no final line, no export, and (MPICH) a non-zero
    exit. Open MPI 5.0.11's prterun exited 0 when every process of a host was killed (it said "A
    daemon failed to report back"), so under Open MPI the exit code is not a sign."""
    assert '"final"' not in out and not export.exists(), out[-3000:]
    assert code != 0 or os.environ.get("HPCPS_MPI") == "openmpi", out[-3000:]
