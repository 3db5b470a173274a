"""What a rank sees of how it was started (tests/test_zygote.py): one JSON line a rank."""

import json
import os
import signal
import socket
import sys
import time

import numpy as np

preloaded = "torch" in sys.modules
from mpi4py import MPI  # noqa: E402

comm = MPI.COMM_WORLD
sys.stdout.write(json.dumps({"rank": comm.rank, "size": comm.size, "argv": sys.argv, "cwd": os.getcwd(), "main": __name__,
                  "path0": sys.path[0], "tag": os.environ.get("PROBE"), "preloaded": preloaded,
                  "random": float(np.random.random()), "ppid": os.getppid(),
                  "host": socket.gethostname(), "netns": os.stat("/proc/self/ns/net").st_ino}) + "\n")
sys.stdout.flush()
comm.Barrier()
if sys.argv[1:2] == ["wait"]:           # until SIGUSR1 comes (passed on by the rank's client)
    got = []
    signal.signal(signal.SIGUSR1, lambda sig, _frame: got.append(sig))
    open(os.environ["PROBE_READY"] + f".{comm.rank}", "w").close()
    deadline = time.time() + 60
    while not got and time.time() < deadline:
        time.sleep(0.05)
    sys.stdout.write(f"rank {comm.rank} got {got}\n")
    comm.Barrier()
if sys.argv[1:2] == ["sleep"]:          # until killed
    open(os.environ["PROBE_READY"] + f".{comm.rank}", "w").close()
    time.sleep(60)
sys.exit(int(sys.argv[2]) if sys.argv[1:2] == ["exit"] and comm.rank == 1 else 0)
