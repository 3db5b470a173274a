"""Launch an MPI program from a serial test: always under a timeout, never leaving a process behind."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = Path(__file__).resolve().parent / "programs"
CLUSTER = ROOT / "scripts" / "cluster.sh"

SKIP_MALLOC_TUNE = False       # tests/conftest.py: True


def mpiexec() -> str:
    exe = os.environ.get("HPCPS_MPIEXEC")
    if exe:
        return exe
    local = Path(sys.prefix) / "bin" / "mpiexec"
    if local.exists():
        return str(local)
    found = shutil.which("mpiexec")
    if not found:
        raise RuntimeError("no mpiexec found: set HPCPS_MPIEXEC or run through scripts/run test")
    return found


def launcher(n: int, hosts: str | None = None) -> list:
    """``mpiexec -n n``; with ``hosts`` (``"h0:2,h1:1"``) the same on the pretend hosts of the cluster
    ``$HPCPS_CLUSTER`` (``scripts/cluster.sh``), launched from the first of them."""
    if hosts is None:
        return [mpiexec(), "-n", str(n)]
    return [str(CLUSTER), "mpiexec", hosts, "-n", str(n)]


def mpi_env(extra=None) -> dict:
    """The environment of a test's launch: ``extra`` on top (a value None removes the variable)."""
    env = dict(os.environ)
    env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "OMPI_MCA_rmaps_base_oversubscribe": "1", "HDF5_USE_FILE_LOCKING": "FALSE",
                "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    env.pop("HPCPS_NUM_PS", None)
    env.pop("HPCPS_TRANSPORT", None)
    env.pop("HPCPS_MPI_THREADS", None)
    env["HPCPS_MPIEXEC"] = mpiexec()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    # `hpcps train` restarts itself with glibc's tcache off (a heap that does not fragment over
    # thousands of steps); a test's few steps do not need it, and the restart costs ~1 s of a 10 s
    # launch on 2 cores: tests/conftest.py sets SKIP_MALLOC_TUNE (benchmarks run as users do). The
    # tests of the restart itself ask for it (extra {"HPCPS_MALLOC_TUNE": None}).
    if SKIP_MALLOC_TUNE:
        env["HPCPS_MALLOC_TUNE"] = "0"
    for k, v in (extra or {}).items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def run_mpi(n: int, argv, timeout: float = 120, env=None, mpi4py_run: bool = True,
            check: bool = True, preexec=None, hosts: str | None = None) -> subprocess.CompletedProcess:
    """Run ``mpiexec -n n python [-m mpi4py] argv...`` (on pretend ``hosts``: see ``launcher``);
    kill the whole process group on timeout."""
    if isinstance(argv, (str, Path)):
        argv = [argv]
    argv = [str(a) for a in argv]
    if argv[0].endswith(".py") and not os.path.isabs(argv[0]):
        argv[0] = str(PROGRAMS / argv[0])
    cmd = launcher(n, hosts) + [sys.executable]
    if mpi4py_run:
        cmd += ["-m", "mpi4py"]
    cmd += argv
    started = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=mpi_env(env), cwd=ROOT, start_new_session=True, preexec_fn=preexec)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s: {' '.join(cmd)}\n--- stdout\n{out}\n--- stderr\n{err}")
    finally:
        try:                        # nothing of this launch may outlive it
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if proc.returncode != 0:    # nor its shared memory, when it was killed or aborted
            clean_shm(started)
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}: {' '.join(cmd)}\n--- stdout\n{out}\n--- stderr\n{err}")
    return result


def launch_mpi(n: int, argv, env=None, tag: str = "", hosts: str | None = None) -> subprocess.Popen:
    """Start ``mpiexec -n n python -m mpi4py argv...`` in its own process group (caller must reap it).
    ``tag`` marks every rank's environment so ``rank_pid`` can find them."""
    argv = [str(a) for a in argv]
    extra = dict(env or {})
    if tag:
        extra["HPCPS_TEST_TAG"] = tag
    cmd = launcher(n, hosts) + [sys.executable, "-m", "mpi4py"] + argv
    started = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=mpi_env(extra), cwd=ROOT, start_new_session=True)
    proc.started_at = started
    return proc


def rank_pid(tag: str, rank: int):
    """PID of world rank ``rank`` of the launch tagged ``tag`` (MPICH/Open MPI put the rank in the
    environment), or None."""
    want_tag = f"HPCPS_TEST_TAG={tag}".encode()
    ranks = (f"PMI_RANK={rank}".encode(), f"OMPI_COMM_WORLD_RANK={rank}".encode())
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            env = open(f"/proc/{d}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if want_tag in env and any(r in env for r in ranks) and b"python" in open(f"/proc/{d}/cmdline", "rb").read():
            return int(d)
    return None


def clean_shm(since: float, wait: float = 5.0) -> int:
    """Remove MPICH shared-memory segments (/dev/shm/mpich_shm_*) made since ``since`` once no
    live process maps them: a job killed with -9 leaves its segments behind. The ranks of a
    killed launch die a moment after their launcher (Hydra puts each in a session of its own),
    so segments still mapped are retried for up to ``wait`` seconds. Returns the count removed."""
    shm = Path("/dev/shm")
    deadline, removed = time.time() + wait, 0
    while True:
        mine = [p for p in shm.glob("mpich_shm_*") if p.exists() and p.stat().st_mtime >= since - 1]
        if not mine:
            return removed
        mapped = set()
        for maps in Path("/proc").glob("[0-9]*/maps"):
            try:
                mapped.update(line.split()[-1] for line in maps.read_text().splitlines() if "/dev/shm/" in line)
            except OSError:
                continue
        for p in mine:
            if str(p) not in mapped:
                p.unlink(missing_ok=True)
                removed += 1
        if len(mine) == sum(1 for p in mine if not p.exists()) or time.time() > deadline:
            return removed
        time.sleep(0.1)


def reap(proc: subprocess.Popen, timeout: float = 60):
    """Wait for a launch; kill its whole group if it overstays. Returns (returncode, stdout, stderr)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if proc.returncode != 0 and hasattr(proc, "started_at"):
        clean_shm(proc.started_at)
    return proc.returncode, out, err
