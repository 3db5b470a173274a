"""A test launch's rank, started by MPICH's hydra as ``python -S zygote_client.py ARGV...`` in place
of ``python ARGV...``: it asks the zygote of this pytest process (``tests/zygote.py``, torch
already imported), or of its pretend host (``tests/zygotes.py``), to fork the rank, hands it its
stdin, stdout, stderr and PMI socket (MPICH's hydra; Open MPI's ranks find their PMIx server by
name), passes on the signals it is sent, and ends as the rank ends (its exit status, or killed by the same signal).
Where the zygote cannot serve the launch as a fresh interpreter would run it, it runs
``python ARGV...`` itself (exec: the same process). Standard library only (``-S``)."""

import array
import json
import os
import signal
import socket
import struct
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT,
             signal.SIGALRM, signal.SIGCONT)


def run_here(argv):
    os.execv(sys.executable, [sys.executable, *argv])


def main(argv):
    netns = os.stat("/proc/self/ns/net").st_ino
    path, pmi = os.environ.get("HPCPS_TEST_ZYGOTE", ""), os.environ.get("PMI_FD", "")
    on_host = os.path.join(os.environ.get("HPCPS_TEST_ZYGOTE_HOSTS", "/nonexistent"), str(netns), "sock")
    if os.path.exists(on_host):                     # a pretend host's (tests/zygotes.py)
        path = on_host
    pmix = "PMIX_RANK" in os.environ                # Open MPI: the rank finds its PMIx server by name
    if not path or not (pmi.isdigit() or pmix) or os.environ.get("I_MPI_ROOT"):
        run_here(argv)
    child, pending = [None], []

    def forward(sig, _frame):
        if child[0] is None:
            pending.append(sig)
        else:
            os.kill(child[0], sig)
    for sig in FORWARDED:
        signal.signal(sig, forward)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:
        run_here(argv)
    fds = [0, 1, 2] + ([int(pmi)] if pmi.isdigit() else [])
    request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "fds": fds,
                          "executable": sys.executable, "netns": netns}).encode()
    conn.sendmsg([struct.pack("!I", len(request)), request],
                 [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    reader = conn.makefile("rb")
    try:
        answer = reader.readline().split()
    except OSError:                             # the zygote died first: a rank it forked dies with it
        answer = []
    if not answer or answer[0] != b"pid":
        conn.close()
        run_here(argv)                          # the zygote declined: run as a fresh interpreter
    child[0] = int(answer[1])
    # the rank holds the only copies now: hydra sees its output and PMI socket close as it ends
    null = os.open(os.devnull, os.O_RDWR)
    for fd in fds:
        os.dup2(null, fd)
    for sig in pending:
        os.kill(child[0], sig)
    try:
        line = reader.readline().split()
    except OSError:
        line = []
    if not line:                                # the zygote died: the rank goes with it
        try:
            os.kill(child[0], signal.SIGKILL)
        except ProcessLookupError:
            pass
        os._exit(1)
    status = int(line[1])
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig != signal.SIGKILL:
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


if __name__ == "__main__":
    main(sys.argv[1:])
