"""The test launches' fork server (tests/zygote.py): a forked rank starts as a fresh interpreter
would, ends as it ends, and a launch it cannot run so runs for real."""

import json
import os
import signal
import socket
import struct
import sys
import time
from pathlib import Path

import pytest

from mpirun import PROGRAMS, launch_mpi, launched_pid, rank_pid, reap, run_mpi, zygote

pytestmark = [pytest.mark.openmpi,
              pytest.mark.skipif(not zygote(), reason="the fork server serves MPICH and Open MPI launches")]


def _ranks(out):
    return sorted((json.loads(line) for line in out.splitlines() if line.startswith("{")), key=lambda r: r["rank"])


def test_a_forked_rank_sees_its_own_argv_cwd_env_main_and_seeds():
    r = run_mpi(2, ["zygote_probe.py", "x", "y"], env={"PROBE": "p1"})
    ranks = _ranks(r.stdout)
    assert [x["rank"] for x in ranks] == [0, 1] and all(x["size"] == 2 for x in ranks)
    assert all(x["preloaded"] for x in ranks)                    # forked: torch was already there
    assert all(x["argv"][1:] == ["x", "y"] and x["argv"][0].endswith("zygote_probe.py") for x in ranks)
    assert all(x["main"] == "__main__" and x["tag"] == "p1" and x["path0"].endswith("programs") for x in ranks)
    assert ranks[0]["random"] != ranks[1]["random"]             # numpy reseeded in each rank


def test_an_environment_the_zygote_has_read_otherwise_runs_a_fresh_interpreter():
    ranks = _ranks(run_mpi(2, ["zygote_probe.py"], env={"OMP_NUM_THREADS": "2"}).stdout)
    assert len(ranks) == 2 and not any(x["preloaded"] for x in ranks)


def _client(tag, rank):
    """The zygote client that waits for world rank ``rank`` of the launch tagged ``tag``."""
    pid = launched_pid(tag, rank)
    assert b"zygote_client" in open(f"/proc/{pid}/cmdline", "rb").read()
    return pid


def _started(tmp_path, name, mode):
    ready = tmp_path / name
    proc = launch_mpi(2, [PROGRAMS / "zygote_probe.py", mode], tag=name, env={"PROBE_READY": str(ready)})
    deadline = time.time() + 60
    while not all(Path(f"{ready}.{r}").exists() for r in (0, 1)) and time.time() < deadline:     # handlers set
        time.sleep(0.1)
    return proc


def test_exit_status_and_signals_reach_the_launch(tmp_path):
    r = run_mpi(2, ["zygote_probe.py", "exit", "3"], check=False)
    assert r.returncode == 3
    proc = _started(tmp_path, "usr1", "wait")                    # a signal to the client reaches its rank
    for rank in (0, 1):
        os.kill(_client(proc.tag, rank), signal.SIGUSR1)
    rc, out, err = reap(proc, 60)
    assert rc == 0 and "rank 0 got [10]" in out and "rank 1 got [10]" in out, (out, err)
    proc = _started(tmp_path, "kill", "sleep")                    # a rank killed: the launch says so
    pid = rank_pid(proc.tag, 1)
    assert pid != _client(proc.tag, 1) and b"zygote_client" not in open(f"/proc/{pid}/cmdline", "rb").read()
    os.kill(pid, signal.SIGKILL)
    rc, _out, err = reap(proc, 60)
    assert rc in (9, 137), err                                  # hydra: 9; Open MPI's prterun: 128 + 9
    log = (Path(zygote()) / "log").read_text()
    assert "environment read at start differs: OMP_NUM_THREADS" in log and "forked: -m mpi4py" in log


def test_a_client_gone_before_its_answer_leaves_the_fork_server_serving():
    # a launch killed while its clients wait for their answers (test_checkpoint_mpi's kills): the
    # zygote's answer meets a closed connection, and must neither end the zygote nor leave a rank
    from mpirun import mpi_env
    sock = Path(zygote()) / "sock"
    for argv in (["-m", "mpi4py", str(PROGRAMS / "zygote_probe.py"), "sleep"], ["-X", "dev", "x.py"]):
        request = json.dumps({"argv": argv, "env": mpi_env(), "cwd": os.getcwd(), "fds": [],   # forked; declined
                              "executable": sys.executable, "netns": os.stat("/proc/self/ns/net").st_ino})
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(str(sock))
            conn.sendall(struct.pack("!I", len(request)) + request.encode())
    ranks = _ranks(run_mpi(2, ["zygote_probe.py"]).stdout)
    assert len(ranks) == 2 and all(x["preloaded"] for x in ranks)
    assert not list((Path(zygote()) / "pids").iterdir())         # the orphan rank was killed and reaped


def test_library_search_paths_that_find_the_same_directories_match():
    # Open MPI's prted gives a rank on another pretend host its lib directory 4 times and a
    # trailing ':': the zygote that holds it once forks that rank (tests/test_hosts.py's launches)
    import zygote as server
    lib = "/venv/mpi/openmpi/lib"
    assert server.fixed({"LD_LIBRARY_PATH": f"{lib}:{lib}:{lib}:{lib}:"}) == server.fixed({"LD_LIBRARY_PATH": lib})
    assert server.fixed({"LD_LIBRARY_PATH": f"/a:{lib}"}) != server.fixed({"LD_LIBRARY_PATH": f"{lib}:/a"})
    assert server.fixed({"LD_PRELOAD": "x", "HOME": "/root"}) == {"LD_PRELOAD": "x"}
