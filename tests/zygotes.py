"""The test launches' rank fork servers (``tests/zygote.py``): one on this machine for the launches
of this pytest process, and one on each pretend host (``scripts/cluster.sh``) that a launch of it
used, started inside that host (its network, hostname and IPC namespaces, its /dev/shm and CPUs),
as a rank there must run. A rank's client (``tests/zygote_client.py``) asks the one of its own
network namespace: ``$HPCPS_TEST_ZYGOTE_HOSTS/<namespace inode>/sock``, else
``$HPCPS_TEST_ZYGOTE``. A host's fork server ends with its host (``cluster.sh down --force``
kills it, and a lost host's processes are killed with it); the next launch there starts another.

Sessions: Linux's scheduler (``kernel.sched_autogroup_enabled``, on by default) shares the CPUs
first among sessions, then among a session's processes. This machine's server has a session of its
own, so a launch's forked ranks are one group, as a launch's fresh ranks are (its own session). The
hosts' servers stay in the session of the process that started them (a process group of their own):
with a session per host, a 16-rank launch on 4 hosts was 4 groups, a waiting rank's ``sched_yield``
passed the CPU only to its own host's waiting ranks, and scripts/bench_host_loss.py's first run took
163 s against 30 s in one session."""

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CLUSTER = HERE.parent / "scripts" / "cluster.sh"
CLIENT = [sys.executable, "-S", str(HERE / "zygote_client.py")]

_local = None                   # this machine's fork server's directory, once started
_local_proc = None              # and its process, where this process started it
_hosts_dir = None               # the pretend hosts' fork servers' directories: <netns inode>/
_on_hosts: dict = {}            # netns inode -> that host's fork server (Popen)


def enabled() -> bool:
    """Whether launches fork their ranks: under MPICH and Open MPI, unless ``HPCPS_TEST_ZYGOTE=0``."""
    return os.environ.get("HPCPS_TEST_ZYGOTE") != "0" and os.environ.get("HPCPS_MPI", "mpich") in ("mpich", "openmpi")


def _start(argv: list, directory: str, own_session: bool = True) -> subprocess.Popen:
    from mpirun import mpi_env, mpiexec
    env = mpi_env()
    if os.environ.get("HPCPS_MPI") == "openmpi":
        # prterun puts its lib directory first in the ranks' LD_LIBRARY_PATH, which the dynamic
        # loader reads at start: the zygote starts with it
        r = subprocess.run([mpiexec(), "-n", "1", "printenv", "LD_LIBRARY_PATH"], env=env, capture_output=True,
                           text=True, timeout=60)
        env["LD_LIBRARY_PATH"] = r.stdout.strip()
    return subprocess.Popen([*argv, sys.executable, str(HERE / "zygote.py"), directory], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env, cwd=HERE.parent, start_new_session=own_session,
                            process_group=None if own_session else 0)


def _ready(proc: subprocess.Popen, where: str) -> None:
    if proc.stdout.readline().strip() != b"ready":
        raise RuntimeError(f"tests/zygote.py did not start ({where})")


def _stop(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def local() -> str | None:
    """This machine's fork server's directory (its ``sock``), started on first use (or the one of
    the process that started this one, named by ``$HPCPS_TEST_ZYGOTE``), started again if it died;
    None where launches start their interpreters as usual (``enabled``)."""
    global _local, _local_proc
    if not enabled():
        return None
    if _local_proc is not None and _local_proc.poll() is not None:
        _local = _local_proc = None
    inherited = os.environ.get("HPCPS_TEST_ZYGOTE", "")
    if _local is None and os.path.exists(inherited):   # a benchmark's smoke test: its pytest process's
        _local = os.path.dirname(inherited)
    if _local is None:
        d = tempfile.mkdtemp(prefix="hpcps-zygote-", dir="/tmp")
        proc = _start([], d)
        _ready(proc, "this machine")
        atexit.register(lambda: (_stop(proc), shutil.rmtree(d, ignore_errors=True)))
        _local, _local_proc = d, proc
    return _local


def on_hosts(hosts: str) -> bool:
    """Start a fork server on each pretend host of ``hosts`` (``"h0:2,h1:1"``, cluster
    ``$HPCPS_CLUSTER``) that has none running; False where launches start their interpreters."""
    global _hosts_dir
    if not enabled():
        return False
    if _hosts_dir is None:
        _hosts_dir = tempfile.mkdtemp(prefix="hpcps-zygote-hosts-", dir="/tmp")
        atexit.register(_stop_hosts)
    cluster, started = os.environ.get("HPCPS_CLUSTER", "hpc"), []
    for host in dict.fromkeys(item.split(":")[0] for item in hosts.split(",")):
        ino = os.stat(f"/run/netns/{cluster}-{host}").st_ino
        proc = _on_hosts.get(ino)
        if proc is not None and proc.poll() is None:
            continue
        d = os.path.join(_hosts_dir, str(ino))
        shutil.rmtree(d, ignore_errors=True)            # a server of a host gone, whose inode came round
        os.makedirs(d)
        _on_hosts[ino] = proc = _start([str(CLUSTER), "exec", host], d, own_session=False)
        started.append((proc, host))
    for proc, host in started:                          # they import torch side by side
        _ready(proc, f"pretend host {host} of cluster {cluster}")
    return True


def _stop_hosts() -> None:
    for proc in _on_hosts.values():
        if proc.poll() is None:
            _stop(proc)
    shutil.rmtree(_hosts_dir, ignore_errors=True)


def python(hosts: str | None = None) -> list:
    """How a launch starts each rank's interpreter: through the fork server of the machine, or of
    each pretend host of ``hosts`` (``tests/zygote_client.py``); plain ``python`` where there is none."""
    if (local() if hosts is None else on_hosts(hosts)):
        return list(CLIENT)
    return [sys.executable]


def environment() -> dict:
    """What a launch's environment needs to find the fork servers started so far."""
    env = {}
    if _local:
        env["HPCPS_TEST_ZYGOTE"] = os.path.join(_local, "sock")
    if _hosts_dir:
        env["HPCPS_TEST_ZYGOTE_HOSTS"] = _hosts_dir
    return env


def pids_dirs() -> list:
    """The directories where the fork servers write, per client, the pid of the rank it waits for."""
    dirs = [Path(_local) / "pids"] if _local else []
    if _hosts_dir:
        dirs += [Path(_hosts_dir) / d / "pids" for d in os.listdir(_hosts_dir)]
    return dirs
