"""A fork server for the ranks of test launches under MPICH and Open MPI (one per pytest process,
and one in each pretend host its launches use: ``tests/zygotes.py``): it imports torch, numpy,
h5py and hpcps's MPI-free modules once, and forks a rank for each
``tests/zygote_client.py`` that asks, instead of each rank paying ~1.3 s of CPU to import torch
(~700 ranks a suite). The forked rank runs ``python ARGV...`` as a fresh interpreter would: the
client's argv, environment, working directory, stdin/stdout/stderr and hydra's PMI socket (Open
MPI's ranks find their PMIx server by the names in the environment), a
fresh ``__main__``, its own random seeds. A launch it cannot run so (another netns, an
environment that a loaded library has already read, interpreter options) runs for real: it
answers ``no`` and the client execs python.

Lifetimes: the client waits for its rank and ends as it ended; a client gone (killed) takes its
rank with it (SIGKILL from here); the zygote ends when its stdin closes (its pytest process is
gone), killing what it forked. ``pids/CLIENT`` holds the rank's pid while it runs
(``mpirun.rank_pid``). Not a part of hpcps: launches by users, Slurm and Intel MPI start their
interpreters as usual."""

import array
import json
import os
import random
import selectors
import signal
import socket
import struct
import sys
import types

# variables read once at start by the interpreter, glibc, or a library the zygote has loaded
# (OpenMP, BLAS, torch's CPU dispatch, HDF5), and hpcps's heap restart: a launch whose values
# differ is run for real. Prefixes.
FIXED = ("PYTHON", "OMP_", "GOMP_", "OPENBLAS", "MKL_", "KMP_", "LD_", "GLIBC_TUNABLES", "MALLOC_",
         "ATEN_CPU_CAPABILITY", "TORCH_CPP_LOG", "HDF5_", "HPCPS_MALLOC")


def fixed(env: dict) -> dict:
    out = {k: v for k, v in env.items() if k.startswith(FIXED)}
    if "LD_LIBRARY_PATH" in out:
        # the directories the loader searches, in order: Open MPI's prted on another pretend host
        # gives its ranks the launch's lib directory 4 times and a trailing ':' (the working
        # directory, the repository's root here, which holds no library)
        dirs = out["LD_LIBRARY_PATH"].split(":")
        out["LD_LIBRARY_PATH"] = ":".join(d for i, d in enumerate(dirs) if d and d not in dirs[:i])
    return out


def _receive(conn):
    fds = array.array("i")
    head, anc, _flags, _addr = conn.recvmsg(4, socket.CMSG_SPACE(16 * fds.itemsize))
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    if len(head) < 4:
        raise ConnectionError("short request")
    size, body = struct.unpack("!I", head)[0], b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ConnectionError("short request")
        body += chunk
    return json.loads(body), list(fds)


def _why_not(req) -> str:
    """Why the zygote cannot run this request as a fresh interpreter would ("" where it can)."""
    argv = req["argv"]
    if not (len(argv) >= 2 and argv[0] == "-m" or (argv and not argv[0].startswith("-"))):
        return f"interpreter options {argv[:1]}"
    if req["executable"] != sys.executable:
        return f"another interpreter {req['executable']}"
    if req["netns"] != os.stat("/proc/self/ns/net").st_ino:
        return "another network namespace"
    theirs, mine = fixed(req["env"]), fixed(os.environ)
    differ = sorted(k for k in set(theirs) | set(mine) if theirs.get(k) != mine.get(k))
    return f"environment read at start differs: {', '.join(differ)}" if differ else ""


class Zygote:
    def __init__(self, directory: str):
        self.dir, self.pid = directory, os.getpid()
        os.makedirs(os.path.join(directory, "pids"), exist_ok=True)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(os.path.join(directory, "sock"))
        self.sock.listen(64)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.sock, selectors.EVENT_READ, "accept")
        self.sel.register(sys.stdin, selectors.EVENT_READ, "stdin")
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.wake_w.setblocking(False)
        signal.set_wakeup_fd(self.wake_w.fileno())
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.sel.register(self.wake_r, selectors.EVENT_READ, "child")
        self.ranks = {}                     # rank pid -> (client connection, client pid)

    def serve(self):
        """Returns only in a forked rank: (request, fds, connection to close)."""
        while True:
            for key, _ in self.sel.select():
                if key.data == "stdin":
                    if not os.read(sys.stdin.fileno(), 4096):
                        self.close()
                        sys.exit(0)
                elif key.data == "accept":
                    conn, _ = self.sock.accept()
                    forked = self.start(conn)
                    if forked:
                        return forked
                elif key.data == "child":
                    try:
                        self.wake_r.recv(4096)
                    except BlockingIOError:
                        pass
                    self.reap()
                else:                       # a client's connection: readable only when it is gone
                    self.client_gone(key.fileobj, key.data)

    def start(self, conn):
        try:
            req, fds = _receive(conn)
        except (OSError, ValueError):
            conn.close()
            return None
        why = _why_not(req)
        with open(os.path.join(self.dir, "log"), "a") as f:        # tests/test_zygote.py reads it
            f.write(f"{why or 'forked'}: {' '.join(req['argv'][:4])}\n")
        if why:
            for fd in fds:
                os.close(fd)
            try:
                conn.sendall(b"no\n")
            except OSError:                 # the client is gone
                pass
            conn.close()
            return None
        client = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
        pid = os.fork()
        if pid == 0:
            return req, fds, conn
        for fd in fds:
            os.close(fd)
        self.ranks[pid] = (conn, client)
        with open(os.path.join(self.dir, "pids", str(client)), "w") as f:
            f.write(str(pid))
        try:
            conn.sendall(b"pid %d\n" % pid)
        except OSError:                     # the client was killed before its answer (a killed launch):
            os.kill(pid, signal.SIGKILL)    # so is its rank; reap() closes the connection
            return None
        self.sel.register(conn, selectors.EVENT_READ, pid)
        return None

    def reap(self):
        while self.ranks:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn, client = self.ranks.pop(pid, (None, None))
            if conn is None:
                continue
            try:
                self.sel.unregister(conn)
                conn.sendall(b"status %d\n" % status)
            except (KeyError, OSError):      # the client is gone (client_gone)
                pass
            conn.close()
            try:
                os.unlink(os.path.join(self.dir, "pids", str(client)))
            except OSError:
                pass

    def client_gone(self, conn, pid):
        if conn.fileno() < 0:            # its rank was reaped earlier in the same round of select()
            return
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.sel.unregister(conn)        # reap() sends nothing to it then, and closes it

    def close(self):
        signal.set_wakeup_fd(-1)            # the SIGCHLDs of the kills below come while the sockets close
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for pid in list(self.ranks):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.unlink(os.path.join(self.dir, "sock"))
        except OSError:
            pass


def become(zygote: Zygote, req: dict, fds: list, conn) -> None:
    """In the forked rank: the zygote's state gone, the client's put in place; killed if the
    zygote ends first (no rank outlives its pytest process)."""
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)        # PR_SET_PDEATHSIG
    if os.getppid() != zygote.pid:
        os._exit(1)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    zygote.sel.close()
    for s in (zygote.sock, zygote.wake_r, zygote.wake_w, conn, *(c for c, _ in zygote.ranks.values())):
        s.close()
    high = [_dup_high(fd) for fd in fds]
    for fd in fds:
        os.close(fd)
    for fd, target in zip(high, req["fds"]):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    random.seed()
    import numpy
    numpy.random.seed()


def _dup_high(fd):
    import fcntl
    return fcntl.fcntl(fd, fcntl.F_DUPFD, 1000)


def run(req: dict) -> None:
    """``python ARGV...`` in this process: ``-m MODULE ARGS`` or ``SCRIPT ARGS``."""
    import runpy
    argv = req["argv"]
    sys.orig_argv = [sys.executable, *argv]
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    # the rest of sys.path is the zygote's: its PYTHONPATH is the launch's (_why_not)
    if argv[0] == "-m":
        sys.path[0] = req["cwd"]
        sys.argv = ["-m", *argv[2:]]
        runpy._run_module_as_main(argv[1], alter_argv=True)
    else:
        script = os.path.abspath(argv[0])
        sys.path[0] = os.path.dirname(script)
        sys.argv = list(argv)
        runpy.run_path(script, run_name="__main__")


# hpcps's modules that start no MPI, imported here too: the command line (its parser imports the
# tune, plan and predict commands), the config and its TOML parser, data, models (~0.25 s of CPU a
# rank on 2 cores). None may import mpi4py.MPI: MPI would start in the zygote (checked in main).
PRELOAD = ("tomllib", "hpcps.cli", "hpcps.config", "hpcps.data", "hpcps.models", "hpcps.tune.cli",
           "hpcps.plan.cli", "hpcps.predict.cli", "hpcps.core.process")


def preload():
    import importlib
    for name in PRELOAD:
        importlib.import_module(name)
    if "mpi4py.MPI" in sys.modules:
        sys.exit(f"tests/zygote.py: a module of PRELOAD imported mpi4py.MPI: {PRELOAD}")


def main(directory):
    import h5py  # noqa: F401
    import numpy  # noqa: F401
    import torch  # noqa: F401
    preload()
    zygote = Zygote(directory)
    print("ready", flush=True)
    req, fds, conn = zygote.serve()
    become(zygote, req, fds, conn)
    del zygote
    run(req)


if __name__ == "__main__":
    main(sys.argv[1])
