"""Launch an MPI program from a serial test: always under a timeout, never leaving a process behind."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import zygotes

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = Path(__file__).resolve().parent / "programs"
CLUSTER = ROOT / "scripts" / "cluster.sh"

SKIP_MALLOC_TUNE = False       # tests/conftest.py: True


def launch_tmpdir() -> Path:
    """The TMPDIR of this pytest process's launches (one per xdist worker). Open MPI's prterun keeps
    its session directory there (``ompi.PID``: PMIx's rendezvous files); a launch in the other
    pytest process, or a stale directory of a killed launcher whose PID came round again, then
    cannot stop its PMIx server from starting ("The PMIx server's listener thread failed to start",
    seen once in CI)."""
    d = Path("/tmp") / f"hpcps-launches-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}"
    d.mkdir(exist_ok=True)
    return d


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


_MPI_ENVS: dict = {}           # MPI name -> the exports of `scripts/run env` for it


def mpi_exports(name: str) -> dict:
    """The environment that runs MPI ``name`` (``mpich``, ``openmpi``, ``impi``: ``HPCPS_MPI`` of
    ``scripts/run``), as ``scripts/run env`` prints it (setting it up first if needed)."""
    import shlex
    if name not in _MPI_ENVS:
        r = subprocess.run([str(ROOT / "scripts" / "run"), "env"], capture_output=True, text=True, check=True,
                           env={**os.environ, "HPCPS_MPI": name})
        exports = {}
        for line in r.stdout.splitlines():
            if line.startswith("export "):
                key, _, value = line[len("export "):].partition("=")
                exports[key] = shlex.split(value)[0] if value else ""
        exports["HPCPS_MPI"] = name
        _MPI_ENVS[name] = exports
    return _MPI_ENVS[name]


class using_mpi:
    """``with using_mpi("openmpi"):`` launches (``run_mpi``, ``launch_mpi``, ``train_many``) use that
    MPI; the environment is put back after. ``None`` changes nothing."""

    def __init__(self, name: str | None):
        self.name, self.saved = name, None

    def __enter__(self):
        if self.name is not None:
            new = mpi_exports(self.name)
            self.saved = {k: os.environ.get(k) for k in set(new) | {"MPI4PY_LIBMPI", "OPAL_PREFIX", "I_MPI_ROOT",
                                                                   "OMPI_MCA_osc", "I_MPI_FABRICS"}}
            for k in self.saved:
                os.environ.pop(k, None)
            os.environ.update(new)
        return self

    def __exit__(self, *exc):
        if self.saved is not None:
            for k, v in self.saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def launched_mpi(final: dict) -> dict:
    """``{"library", "version"}`` of the MPI a job ran on, from its final summary's layout."""
    mpi = (final.get("layout") or {}).get("mpi") or {}
    return {"library": mpi.get("library"), "version": mpi.get("version")}


zygote = zygotes.local          # this pytest process's rank fork server (tests/zygotes.py)
python = zygotes.python


def launcher(n: int, hosts: str | None = None, ft: bool = False) -> list:
    """``mpiexec -n n``; with ``hosts`` (``"h0:2,h1:1"``) the same on the pretend hosts of the cluster
    ``$HPCPS_CLUSTER`` (``scripts/cluster.sh``), launched from the first of them. ``ft``: Open MPI's
    ``--with-ft ulfm`` (a lost rank does not end the launch: ``hpcps.train.failover``)."""
    ulfm = ["--with-ft", "ulfm"] if ft else []
    if hosts is None:
        return [mpiexec(), *ulfm, "-n", str(n)]
    return [str(CLUSTER), "mpiexec", hosts, *ulfm, "-n", str(n)]


def mpi_env(extra=None) -> dict:
    """The environment of a test's launch: ``extra`` on top (a value None removes the variable)."""
    env = dict(os.environ)
    env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",     # Open MPI 5's prterun
                "PRTE_MCA_hwloc_default_binding_policy": "none", "HDF5_USE_FILE_LOCKING": "FALSE",
                "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TMPDIR": str(launch_tmpdir())})
    env.pop("HPCPS_NUM_PS", None)
    env.pop("HPCPS_TRANSPORT", None)
    env.pop("HPCPS_MPI_THREADS", None)
    env["HPCPS_MPIEXEC"] = mpiexec()
    env.update(zygotes.environment())
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


def session_pids(sid: int) -> list[int]:
    """The processes of session ``sid`` (``/proc/PID/stat``'s sixth field)."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = open(f"/proc/{d}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[3]) == sid:
                pids.append(int(d))
    return pids


def kill_launch(proc: subprocess.Popen) -> None:
    """SIGKILL every process of a launch started with ``start_new_session``: its process group, and
    the rest of its session, since Open MPI's prterun puts each rank in a process group of its own
    (its ranks outlived a kill of the launcher's group, still holding the checkpoint lock). MPICH's
    ranks die with their hydra proxy."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in session_pids(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.returncode is not None:     # a killed prterun leaves its session directory behind
        shutil.rmtree(launch_tmpdir() / f"ompi.{proc.pid}", ignore_errors=True)


def run_mpi(n: int, argv, timeout: float = 120, env=None, mpi4py_run: bool = True,
            check: bool = True, preexec=None, hosts: str | None = None, ft: bool = False) -> subprocess.CompletedProcess:
    """Run ``mpiexec -n n python [-m mpi4py] argv...`` (on pretend ``hosts``, ``ft``: see ``launcher``);
    kill the whole process group on timeout."""
    if isinstance(argv, (str, Path)):
        argv = [argv]
    argv = [str(a) for a in argv]
    if argv[0].endswith(".py") and not os.path.isabs(argv[0]):
        argv[0] = str(PROGRAMS / argv[0])
    cmd = launcher(n, hosts, ft) + python(hosts)
    if mpi4py_run:
        cmd += ["-m", "mpi4py"]
    cmd += argv
    started, tag = time.time(), _auto_tag("")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=mpi_env({**(env or {}), "HPCPS_TEST_TAG": tag}), cwd=ROOT, start_new_session=True,
                            preexec_fn=preexec)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_launch(proc)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s: {' '.join(cmd)}\n--- stdout\n{out}\n--- stderr\n{err}")
    finally:
        kill_launch(proc)           # nothing of this launch may outlive it
        if proc.returncode != 0:    # nor its shared memory, when it was killed or aborted
            clean_shm(started, tag=tag)
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}: {' '.join(cmd)}\n--- stdout\n{out}\n--- stderr\n{err}")
    return result


def train_many(n: int, runs, env=None, timeout: float = 300, hosts: str | None = None) -> dict:
    """Several ``hpcps train`` jobs in one launch of ``n`` ranks (``programs/train_many.py``): ``runs``
    maps a tag to ``[args...]`` (after ``hpcps train``) or to ``(args, env)``. Returns
    ``{tag: (final summary, rank 0's stdout of that run)}``; ``.stderr`` of the launch is under the key
    ``None``. One run's failure fails them all (the launch aborts)."""
    import json
    import tempfile
    spec = []
    for tag, run in runs.items():
        args, run_env = (run, None) if isinstance(run, list) else run
        spec.append({"tag": tag, "args": ["train", *map(str, args)], "env": run_env})
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        r = run_mpi(n, ["train_many.py", f.name], timeout=timeout, env=env, hosts=hosts)
    finally:
        os.unlink(f.name)
    out, tag, text = {None: r.stderr}, None, {}
    for line in r.stdout.splitlines():
        if line.startswith('{"run"'):
            tag = json.loads(line)["run"]
            text[tag] = []
        elif tag is not None:
            text[tag].append(line)
    for tag, lines in text.items():
        finals = [json.loads(x)["final"] for x in lines if x.startswith('{"final"')]
        assert len(finals) == 1, (tag, lines)
        out[tag] = (finals[0], "\n".join(lines))
    assert set(out) == set(runs) | {None}, (sorted(map(str, out)), r.stdout[-2000:])
    return out


def _users(request) -> list:
    """This session's selected tests that use the module fixture asking (``request``), in its module."""
    return [item for item in request.session.items
            if getattr(item, "module", None) is request.module and request.fixturename in item.fixturenames]


def _params(item) -> dict:
    return item.callspec.params if hasattr(item, "callspec") else {}


def selected(request) -> list:
    """The parameters (``{name: value}``) of this session's selected tests that use the fixture
    asking (``request``) in its module: a module fixture that runs every case in one launch runs
    only the cases selected (``-k``, ``-m openmpi``)."""
    return [_params(item) for item in _users(request)]


def run_many(n: int, runs: dict, env=None, timeout: float = 600) -> dict:
    """Several test programs in one launch of ``n`` ranks (``programs/many.py``): ``runs`` maps a tag
    to ``[program.py, args...]``. Returns ``{tag: the stdout of every rank of that run, rank 0
    first}``; the launch's stderr under the key ``None``. One run's failure fails them all."""
    import json
    import tempfile
    tags = list(runs)
    with tempfile.TemporaryDirectory(prefix="hpcps-many-") as d:
        spec = Path(d) / "runs.json"
        spec.write_text(json.dumps([{"tag": t, "argv": [str(PROGRAMS / str(runs[t][0])), *map(str, runs[t][1:])]}
                                    for t in tags]))
        r = run_mpi(n, ["many.py", spec, d], timeout=timeout, env=env)
        out = {None: r.stderr}
        for i, t in enumerate(tags):
            out[t] = "".join((Path(d) / f"{i}.{rank}").read_text() for rank in range(n))
    return out


def run_selected(request, launch: dict, root: Path, timeout: float = 900) -> dict:
    """For a module fixture (``request``): the programs of this session's selected tests in its
    module that use it, batched into one launch per (ranks, thread level) with ``run_many`` (each
    rank of a launch costs ~1.3 s of CPU to import torch). ``launch`` maps a test function's name
    to ``f(params, dir) -> [(ranks, MPI_THREAD_MULTIPLE?, [program.py, args...]), ...]``; each
    test has a directory of its own under ``root``. Returns ``{test name: ([stdout of each of its
    runs], its directory)}``."""
    groups, dirs = {}, {}
    for i, item in enumerate(_users(request)):
        dirs[item.name] = d = root / f"t{i}"
        d.mkdir()
        for j, (n, multiple, argv) in enumerate(launch[item.originalname](_params(item), d)):
            groups.setdefault((n, multiple), {})[(item.name, j)] = argv
    out = {}
    for (n, multiple), runs in groups.items():
        got = run_many(n, runs, env={"HPCPS_MPI_THREADS": "multiple"} if multiple else None, timeout=timeout)
        for name, j in runs:
            out.setdefault(name, ([], dirs[name]))[0].append(got[(name, j)])
    return out


def launch_mpi(n: int, argv, env=None, tag: str = "", hosts: str | None = None, ft: bool = False) -> subprocess.Popen:
    """Start ``mpiexec -n n python -m mpi4py argv...`` in its own process group (caller must reap it).
    ``tag`` marks every rank's environment so ``rank_pid`` can find them; ``ft``: see ``launcher``."""
    argv = [str(a) for a in argv]
    extra = dict(env or {})
    extra["HPCPS_TEST_TAG"] = tag = _auto_tag(tag)
    cmd = launcher(n, hosts, ft) + python(hosts) + ["-m", "mpi4py"] + argv
    started = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=mpi_env(extra), cwd=ROOT, start_new_session=True)
    proc.started_at, proc.tag = started, tag
    LAUNCHED.append(proc)
    return proc


LAUNCHED: list = []            # launch_mpi's launches; tests/conftest.py kills those a failed test left


def kill_leftovers() -> None:
    """SIGKILL the launches of ``launch_mpi`` still running (a test that failed before reaping)."""
    while LAUNCHED:
        proc = LAUNCHED.pop()
        if proc.poll() is None:
            kill_launch(proc)
            proc.communicate()


def rank_pid(tag: str, rank: int):
    """PID of world rank ``rank`` of the launch tagged ``tag`` (MPICH/Open MPI put the rank in the
    environment): the rank itself, not the zygote client that waits for it; or None."""
    pid = launched_pid(tag, rank)
    return None if pid is None else _forked(pid)


def launched_pid(tag: str, rank: int):
    """PID of the process the launcher started for world rank ``rank`` of the launch tagged ``tag``:
    the rank, or the zygote client that waits for it (``tests/zygote_client.py``); or None."""
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


def _forked(pid: int) -> int:
    """The rank that the zygote client ``pid`` waits for, or ``pid`` itself where it is the rank."""
    deadline = time.time() + 10
    while (dirs := zygotes.pids_dirs()) and time.time() < deadline:
        try:
            if b"zygote_client" not in open(f"/proc/{pid}/cmdline", "rb").read():
                return pid
            for d in dirs:
                if (d / str(pid)).exists():
                    return int((d / str(pid)).read_text())
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    return pid


_launches = 0                   # launches made by this process, for their default tags


def _auto_tag(tag: str) -> str:
    """``tag``, or a tag of this process's own for a launch that was given none."""
    global _launches
    _launches += 1
    return tag or f"launch-{os.getpid()}-{_launches}"


def _tagged_alive(tag: str) -> bool:
    """Whether any process runs with ``HPCPS_TEST_TAG=tag`` in its environment."""
    want = f"HPCPS_TEST_TAG={tag}".encode()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if want in open(f"/proc/{d}/environ", "rb").read().split(b"\0"):
                    return True
            except OSError:
                continue
    return False


def _mtime(path: Path) -> float:
    """``path``'s modification time; 0 when it is gone (the other pytest process may remove it)."""
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def clean_shm(since: float, wait: float = 5.0, tag: str | None = None) -> int:
    """Remove MPICH's and Open MPI's shared-memory segments (/dev/shm/mpich_shm_*, sm_segment.*) made
    since ``since`` that no live process maps: a job killed with -9 leaves its segments behind.
    First waits (up to ``wait`` seconds) until no process of the launch tagged ``tag`` lives (the ranks of a killed launch die
    a moment after their launcher: hydra puts each in a session of its own). A segment younger than
    a second is left alone: another test's launch may not have mapped it yet (tests run in two
    processes at once). Returns the count removed."""
    shm = Path("/dev/shm")
    deadline, removed = time.time() + wait, 0
    while tag and _tagged_alive(tag) and time.time() < deadline:
        time.sleep(0.1)
    while True:
        mine = [p for pattern in ("mpich_shm_*", "sm_segment.*") for p in shm.glob(pattern)
                if _mtime(p) >= since - 1]
        mapped = set()
        for maps in Path("/proc").glob("[0-9]*/maps"):
            try:
                mapped.update(line.split()[-1] for line in maps.read_text().splitlines() if "/dev/shm/" in line)
            except OSError:
                continue
        young = False
        for p in mine:
            if str(p) in mapped:
                continue
            try:
                age = time.time() - p.stat().st_mtime
            except OSError:
                continue
            if age >= 1.0:
                p.unlink(missing_ok=True)
                removed += 1
            else:
                young = True
        if not young or time.time() > deadline:
            return removed
        time.sleep(0.2)


def reap(proc: subprocess.Popen, timeout: float = 60):
    """Wait for a launch; kill its whole group if it overstays. Returns (returncode, stdout, stderr)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_launch(proc)
        out, err = proc.communicate()
    kill_launch(proc)
    if proc.returncode != 0 and hasattr(proc, "started_at"):
        clean_shm(proc.started_at, tag=proc.tag)
    return proc.returncode, out, err
