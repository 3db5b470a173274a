"""Multi-host: the programs and the trainer on pretend hosts (``scripts/cluster.sh``). Each host has
its own network, hostname, IPC namespace and /dev/shm, so MPI sees separate nodes, and ranks on
different hosts reach each other over TCP only. Needs root (CI runs as root)."""

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from hpcps.checkpoint import store
from hpcps.config import load_config
from hpcps.tools.reference import train_reference
from hostkit import assert_ended_unfinished, host_local_dir, kill_all, parts_of, pids_on
from mpirun import CLUSTER, ROOT, launch_mpi, reap, run_mpi, selected, train_many

TINY = ROOT / "tests" / "configs" / "tiny_ctr.toml"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="pretend hosts need root (network namespaces)")


def _cluster(*args, check=True):
    return subprocess.run([str(CLUSTER), *args], capture_output=True, text=True, timeout=60, check=check)


@pytest.fixture(scope="module", autouse=True)
def cluster():
    """Three pretend hosts h0, h1, h2 for this module; nothing of them is left afterwards."""
    name = f"t{os.getpid() % 1000000}"
    old = os.environ.get("HPCPS_CLUSTER")
    os.environ["HPCPS_CLUSTER"] = name
    try:
        _cluster("up", "3")
        yield name
    finally:
        _cluster("down", "--force", check=False)
        if old is None:
            del os.environ["HPCPS_CLUSTER"]
        else:
            os.environ["HPCPS_CLUSTER"] = old
    assert not [n for n in os.listdir("/run/netns") if n.startswith(f"{name}-")]
    assert not Path(f"/sys/class/net/{name}br").exists()


def _final(stdout):
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith('{"final"')]
    assert len(lines) == 1, stdout
    return lines[0]["final"]


def _train(n, hosts, sets, timeout=240, **kw):
    return run_mpi(n, ["-m", "hpcps", "train", "--config", TINY, "--set", *sets], timeout=timeout,
                   hosts=hosts, **kw)


def _assert_close_to_reference(npz, sets):
    got = np.load(npz)
    ref = train_reference(load_config(TINY, sets, environ={}))
    assert set(got.files) == set(ref)
    for k, want in ref.items():
        np.testing.assert_allclose(got[k], want, rtol=1e-4, atol=5e-5, err_msg=k)


@pytest.mark.openmpi
def test_hosts_are_separate_nodes_to_mpi():
    r = run_mpi(3, ["-c", "from mpi4py import MPI; import socket, sys; c = MPI.COMM_WORLD; sys.stdout.write("
                    "f'RANK {c.rank} {socket.gethostname()} {c.Split_type(MPI.COMM_TYPE_SHARED).size}\\n')"],
                mpi4py_run=False, hosts="h0:1,h1:2")
    assert sorted(re.findall(r"RANK (\d) (h\d) (\d)", r.stdout)) == [("0", "h0", "1"), ("1", "h1", "2"),
                                                                     ("2", "h1", "2")]


def test_ranks_on_pretend_hosts_fork_from_their_own_hosts_fork_server():
    """tests/zygotes.py: a rank on a pretend host is forked (torch already imported) by a fork
    server started inside that host: its hostname and network namespace are the host's."""
    r = run_mpi(3, ["zygote_probe.py"], hosts="h0:1,h1:2")
    ranks = sorted((json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")), key=lambda x: x["rank"])
    assert [(x["rank"], x["host"], x["preloaded"]) for x in ranks] == [(0, "h0", True), (1, "h1", True),
                                                                       (2, "h1", True)], r.stdout
    own = os.stat("/proc/self/ns/net").st_ino
    assert ranks[1]["netns"] == ranks[2]["netns"] and len({own, ranks[0]["netns"], ranks[1]["netns"]}) == 3


@pytest.mark.parametrize("stateful", [False, pytest.param(True, marks=pytest.mark.openmpi)], ids=["plain", "staged"])
def test_concurrent_pushes_to_a_local_and_a_remote_ps_lose_no_update(stateful):
    # 2 PS spread over 2 hosts (ranks 2 on h0, 4 on h1): every worker has one PS on its host
    # (shared memory) and one on the other (RMA over TCP)
    r = run_mpi(5, ["concurrent_push.py", 2, "auto", 60] + (["stateful"] if stateful else []),
                hosts="h0:3,h1:2", timeout=240)
    sums = re.findall(r"OK worker \d+ hot-row sum (\d+)", r.stdout)
    assert len(sums) == 3 and len(set(sums)) == 1 and int(sums[0]) > 60 * 3 * 2, r.stdout


def test_a_dynamic_table_across_hosts_equals_a_one_process_reference():
    # 2 PS on 2 hosts: every worker resolves ids through a PS on its host and one on the other (TCP)
    r = run_mpi(5, ["dynamic_sync.py", 2, "adagrad", 8], hosts="h0:3,h1:2", timeout=240)
    got = re.findall(r"OK worker \d+ size (\d+) checksum ([0-9.]+)", r.stdout)
    assert len(got) == 3 and len(set(got)) == 1, r.stdout


OPTIMIZERS = [["optimizer.sparse.name=sgd", "optimizer.sparse.lr=0.2"],
              ["optimizer.sparse.name=momentum", "optimizer.sparse.lr=0.2", "job.rma_read=get"],
              ["optimizer.sparse.name=adagrad", "optimizer.sparse.eps=1e-3", "job.rma_read=get_accumulate"],
              ["optimizer.sparse.name=rowwise_adagrad", "optimizer.sparse.lr=0.2"],
              ["optimizer.sparse.name=adam", "optimizer.sparse.lr=0.05"]]


@pytest.fixture(scope="module")
def ps_on_another_host(request, tmp_path_factory):
    """Each selected optimizer of OPTIMIZERS trained with its PS on the other host, in one launch
    (tests/programs/train_many.py); ``(dir, finals)``, the exports as ``dir / f"{name}.npz"``."""
    d = tmp_path_factory.mktemp("across")
    chosen = [p["opt"] for p in selected(request)]
    runs = {o[0].split("=")[1]: ["--config", TINY, "--set", *o, "job.ps_layout=last",
                                 f"job.export={d / o[0].split('=')[1]}.npz"] for o in chosen}
    got = train_many(3, runs, hosts="h0:2,h1:1", timeout=400)
    return d, {name: got[name][0] for name in runs}


# the Open MPI leg: a stateless optimizer (workers add into the PS's rows over RMA) and a stateful one
@pytest.mark.parametrize("opt", [pytest.param(o, marks=[pytest.mark.openmpi] if o[0].endswith(("sgd", "adam")) else [])
                                 for o in OPTIMIZERS], ids=lambda o: o[0].split("=")[1])
def test_sync_with_the_ps_on_another_host_equals_one_process(ps_on_another_host, opt):
    d, finals = ps_on_another_host
    name = opt[0].split("=")[1]
    sets = opt + ["job.ps_layout=last"]
    f = finals[name]
    lay = f["layout"]
    assert lay["hosts"] == 2 and lay["ps_per_host"] == [0, 1] and lay["ranks_per_host"] == [2, 1]
    assert all(w["shm_ps"] == [] and w["rma_ps"] == [0] for w in lay["workers"])
    # no RDMA device here: pulls from the other host by messages (job.rma_read = auto), or by RMA
    assert lay["remote"] == ("RMA" if any(s.startswith("job.rma_read=get") for s in sets) else "messages")
    _assert_close_to_reference(d / f"{name}.npz", sets)


@pytest.mark.openmpi
def test_ps_and_workers_spread_over_hosts_with_the_dense_all_reduce_across_them(tmp_path):
    sets = ["optimizer.sparse.name=adam", "optimizer.sparse.lr=0.05", "job.num_ps=2",
            f"job.export={tmp_path / 'w.npz'}"]
    m = tmp_path / "m.jsonl"          # and the monitor: a record per host of each sample, each PS on its host
    r = _train(4, "h0:2,h1:2", sets + [f"metrics.path={m}", "metrics.every=0.1", "job.step_delay=0.01"])
    lay = _final(r.stdout)["layout"]
    assert lay["ps_per_host"] == [1, 1] and lay["dense"] == "mpi"      # workers on 2 hosts: not shm
    mon = [json.loads(x) for x in m.read_text().splitlines() if x.startswith('{"time"') and '"monitor"' in x]
    assert {x["host"] for x in mon} == {"h0", "h1"} and all(x["ranks"] == 2 for x in mon)
    assert [x["reported"] for x in mon[-2:]] == [2, 2]
    assert {(x["host"], p["ps"]) for x in mon for p in x["ps"]} == {("h0", 0), ("h1", 1)}
    assert all(x["workers"]["step_ms"] > 10 for x in mon if "workers" in x)
    assert [(w["host"], w["shm_ps"], w["rma_ps"]) for w in lay["workers"]] == [(0, [0], [1]), (1, [1], [0])]
    assert "layout: 2 hosts (h0: 2 ranks, 1 PS; h1: 2 ranks, 1 PS)" in r.stderr
    _assert_close_to_reference(tmp_path / "w.npz", sets)


def test_demo_verifies_every_update_across_hosts():
    r = run_mpi(5, ["-m", "hpcps", "demo", "--rows", "20000", "--batch", "512", "--steps", "20",
                    "--num-ps", "2"], hosts="h0:2,h1:2,h2:1")
    demo = json.loads([line for line in r.stdout.splitlines() if line.startswith('{"demo"')][0])["demo"]
    assert demo["verified"] and demo["pushes_applied"] == 3 * 20 * 512


@pytest.mark.openmpi
@pytest.mark.openmpi_only     # MPICH: test_the_large_workload_on_16_ranks_and_4_hosts_...
def test_a_host_lost_then_a_restart_on_fewer_hosts_equals_a_straight_run(tmp_path):
    """Checkpoints from 3 hosts go to one shared directory; every process of one host is killed
    (-9) mid-run; the same job restarted on 2 hosts, with another PS count, ends where a straight
    run does."""
    ck = tmp_path / "ck"
    sets = ["optimizer.sparse.name=adam", "optimizer.sparse.lr=0.05", f"checkpoint.dir={ck}",
            "checkpoint.every_steps=3", f"job.export={tmp_path / 'w.npz'}", "job.num_ps=2"]
    proc = launch_mpi(5, ["-m", "hpcps", "train", "--config", TINY, "--set", *sets],
                      env={"HPCPS_STEP_DELAY": "0.1"}, hosts="h0:2,h1:2,h2:1")
    deadline = time.time() + 120
    while time.time() < deadline and not store.list_checkpoints(ck) and proc.poll() is None:
        time.sleep(0.05)
    assert store.list_checkpoints(ck), "no checkpoint before the deadline"
    victims = pids_on("h1")
    assert victims
    kill_all(victims)
    code, out, err = reap(proc, timeout=120)
    assert_ended_unfinished(code, out + err, tmp_path / "w.npz")
    manifests = [store.read_manifest(c) for c in store.list_checkpoints(ck)]
    assert {m["num_ps"] for m in manifests} == {2}
    r = _train(3, "h0:1,h1:2", sets[:-1] + ["job.num_ps=1"])
    f = _final(r.stdout)
    assert 0 < f["start_step"] < 30 and f["layout"]["hosts"] == 2 and f["num_ps"] == 1
    _assert_close_to_reference(tmp_path / "w.npz", sets)


def _leftovers(name: str) -> list[str]:
    found = [f"/run/netns/{n}" for n in os.listdir("/run/netns") if n.startswith(f"{name}-")]
    found += [p for p in (f"/sys/class/net/{name}br", f"/run/hpcps-cluster/{name}") if Path(p).exists()]
    found += [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if f"hpcps-cluster/{name}" in line]
    return found


def test_cluster_tool_undoes_a_failed_up_and_refuses_down_while_processes_run():
    name = f"u{os.getpid() % 1000000}"
    env = dict(os.environ, HPCPS_CLUSTER=name)

    def tool(*args, net=None):
        e = dict(env, HPCPS_CLUSTER_NET=net) if net else env
        return subprocess.run([str(CLUSTER), *args], capture_output=True, text=True, timeout=60, env=e)

    bad = tool("up", "2", net="10.213.999")    # fails half-way: no such address
    assert bad.returncode != 0 and "undoing" in bad.stderr and not _leftovers(name), bad.stderr
    assert tool("up", "0").returncode == 2
    assert tool("up", "2", "--split-cpus").returncode == 0
    try:
        assert "already up" in tool("up", "2").stderr
        sleeper = subprocess.Popen([str(CLUSTER), "exec", "h1", "sleep", "60"], env=env)
        deadline = time.time() + 10
        while "processes=1" not in tool("status").stdout.splitlines()[1] and time.time() < deadline:
            time.sleep(0.1)
        refused = tool("down")
        assert refused.returncode == 2 and "h1:" in refused.stderr and _leftovers(name)
        assert tool("down", "--force").returncode == 0
        assert sleeper.wait(timeout=10) != 0
    finally:
        tool("down", "--force")
    assert not _leftovers(name)


@pytest.mark.openmpi
@pytest.mark.openmpi_only     # MPICH: test_the_large_workload_on_16_ranks_and_4_hosts_...
def test_a_host_lost_with_its_local_files_restarts_from_partner_copies_bit_equal(tmp_path):
    """Node-local checkpoints every 3 steps, each PS's shard copied to its partner on the other
    host; every process of h1 killed (-9) and h1's local directory deleted (a replaced node); the
    same command again rebuilds h1's files from h0's partner copies and ends with the very bits
    of an uninterrupted run."""
    name = f"hpcps-lv-{os.getpid()}"
    sets = ["optimizer.sparse.name=adam", "optimizer.sparse.lr=0.05", "job.num_ps=2", "checkpoint.every_steps=1000",
            "checkpoint.local_every=3", "checkpoint.local_full_every=10", f"checkpoint.local_dir=/dev/shm/{name}"]
    hosts = "h0:2,h1:2,h2:1"
    # the straight run shares the local directory (its own job directory there)
    _train(5, hosts, sets + [f"checkpoint.dir={tmp_path / 'straight'}", f"job.export={tmp_path / 'straight.npz'}"])
    ck, out = tmp_path / "ck", tmp_path / "w.npz"
    sets += [f"checkpoint.dir={ck}", f"job.export={out}"]
    proc = launch_mpi(5, ["-m", "hpcps", "train", "--config", TINY, "--set", *sets],
                      env={"HPCPS_STEP_DELAY": "0.1"}, hosts=hosts)
    deadline = time.time() + 120
    while time.time() < deadline and not parts_of(host_local_dir("h0", name, ck), ck, 6):   # its second or later
        time.sleep(0.05)
    kill_all(pids_on("h1"))
    code, so, _ = reap(proc, timeout=120)
    assert_ended_unfinished(code, so, out)
    shutil.rmtree(host_local_dir("h1", name))                   # h1's node-local files are gone
    held = {s for p in host_local_dir("h0", name, ck).glob("step-*.r*[0-9]") for s in store.read_manifest(p)["shards"]}
    assert held == {0, 1}                                        # its own shard and h1's PS's partner copy
    r = _train(5, hosts, sets)
    f = _final(r.stdout)
    assert f["restored_from"] == "local" and 3 <= f["start_step"] < 30, r.stderr[-2000:]
    assert "copied from other hosts" in r.stderr and "node-local level" in r.stderr
    assert list(host_local_dir("h1", name, ck).glob("step-*"))     # rebuilt there
    a, b = np.load(out), np.load(tmp_path / "straight.npz")
    for k in a.files:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _file_step(path) -> int:
    import h5py
    with h5py.File(path, "r") as f:
        return int(f.attrs["step"])


def test_kills_during_local_and_partner_writes_never_load_a_corrupt_part(tmp_path):
    """Every rank killed at random moments while node-local checkpoints (and their partner copies
    across hosts) are written every step, full ones and deltas: every committed part verifies, and
    a restart loads."""
    import random
    from hpcps.checkpoint import local
    name = f"hpcps-lk-{os.getpid()}"
    ck = tmp_path / "ck"
    argv = ["-m", "hpcps", "train", "--config", TINY, "--set", "job.num_ps=2", f"checkpoint.dir={ck}",
            "checkpoint.every_steps=100000", "checkpoint.local_every=1", f"checkpoint.local_dir=/dev/shm/{name}",
            "checkpoint.local_full_every=3",
            "job.steps=100000", "data.rows_per_table=100000"]
    rng = random.Random(2)
    for trial in range(2):
        before = set(host_local_dir("h1", name, ck).glob("step-*"))
        proc = launch_mpi(4, argv, hosts="h0:2,h1:2")
        t0 = time.time()
        while time.time() - t0 < 90 and not set(host_local_dir("h1", name, ck).glob("step-*")) - before:
            time.sleep(0.02)                                     # this launch writes local checkpoints
        time.sleep(rng.uniform(0.0, 1.5))
        for h in ("h0", "h1"):
            kill_all(pids_on(h))
        reap(proc)
        parts = [p for h in ("h0", "h1") for p in local.scan(host_local_dir(h, name, ck))]
        assert parts and all(p["ok"] for p in parts), [p["why"] for p in parts if not p["ok"]]
        misfiled = [f"{p['path'].name}/{f.name}" for p in parts for f in p["path"].glob("ps-*.h5")
                    if _file_step(f) != p["step"]]      # a partner copy of another step under this one
        assert not misfiled, misfiled
    r = _train(4, "h0:2,h1:2", argv[6:-2] + ["job.steps=1", "data.rows_per_table=100000", "checkpoint.local_every=0"],
               check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    f = _final(r.stdout)
    assert f["restored_from"] == "local" and f["start_step"] >= 1
