"""Launch an MPI program from a serial test: always under a timeout, never leaving a process behind."""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = Path(__file__).resolve().parent / "programs"


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


def mpi_env(extra=None) -> dict:
    env = dict(os.environ)
    env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "OMPI_MCA_rmaps_base_oversubscribe": "1", "HDF5_USE_FILE_LOCKING": "FALSE",
                "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    env.pop("HPCPS_NUM_PS", None)
    env.pop("HPCPS_TRANSPORT", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra or {})
    return env


def run_mpi(n: int, argv, timeout: float = 120, env=None, mpi4py_run: bool = True,
            check: bool = True) -> subprocess.CompletedProcess:
    """Run ``mpiexec -n n python [-m mpi4py] argv...``; kill the whole process group on timeout."""
    if isinstance(argv, (str, Path)):
        argv = [argv]
    argv = [str(a) for a in argv]
    if argv[0].endswith(".py") and not os.path.isabs(argv[0]):
        argv[0] = str(PROGRAMS / argv[0])
    cmd = [mpiexec(), "-n", str(n), sys.executable]
    if mpi4py_run:
        cmd += ["-m", "mpi4py"]
    cmd += argv
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=mpi_env(env), cwd=ROOT, start_new_session=True)
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
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}: {' '.join(cmd)}\n--- stdout\n{out}\n--- stderr\n{err}")
    return result
