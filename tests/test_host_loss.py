"""scripts/bench_host_loss.py's 16-rank, 4-host run (pretend hosts of its own, scripts/cluster.sh):
a file of its own, placed in tests/conftest.py's order apart from test_hosts.py's three hosts."""

import json
import os
import subprocess
import sys

import pytest

from mpirun import ROOT, mpi_env

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="pretend hosts need root (network namespaces)")


def test_the_large_workload_on_16_ranks_and_4_hosts_survives_a_lost_host_bit_equal_and_reshards(tmp_path):
    """scripts/bench_host_loss.py at 16 ranks (4 PS + 12 workers, a PS on each of 4 hosts) on
    examples/large.toml's 26 tables at 1/1000 (204k rows): node-local, partner and filesystem
    checkpoints; every process of h3 killed and its /dev/shm deleted once a node-local step is
    whole on the others; the same 16 ranks on 3 hosts restart from that level (h3's PS's shard
    from its partner copy) and end with the straight run's bits; 3 PS + 9 workers then load the
    filesystem level resharded and export those very bits."""
    out = tmp_path / "bl.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_host_loss.py"), "--hosts", "4", "--ranks", "16",
                        "--num-ps", "4", "--reshard", "3+9", "--scale", "0.001", "--steps", "12", "--local-every", "3",
                        "--out", str(out)], capture_output=True, text=True, timeout=600,
                       env=mpi_env({"HPCPS_CLUSTER_BENCH": f"b{os.getpid() % 1000000}"}))
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert all(res["checks"].values()) and len(res["checks"]) == 5, res["checks"]
    assert res["restart"]["restored_from"] == "local" and res["restart"]["start_step"] >= 6
    assert res["reshard"]["num_ps"] == 3 and res["reshard"]["restored_from"] == "pfs"
    assert res["lost"]["processes_killed"] >= 4 and res["auc"] > 0.6
