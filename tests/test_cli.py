import json
import subprocess
import sys
from pathlib import Path

import pytest

from mpirun import run_mpi


def _demo_summary(stdout):
    lines = [json.loads(l) for l in stdout.splitlines() if l.startswith('{"demo"')]
    assert len(lines) == 1, stdout
    return lines[0]["demo"]


def test_help_lists_commands():
    out = subprocess.run([sys.executable, "-m", "hpcps", "--help"], capture_output=True, text=True, check=True).stdout
    assert "demo" in out and "mpiexec" in out
    out = subprocess.run([sys.executable, "-m", "hpcps", "demo", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for flag in ("--rows", "--dim", "--batch", "--steps", "--num-ps", "--transport", "--zipf"):
        assert flag in out


def test_bench_runs_each_benchmark_script_with_its_arguments():
    from hpcps.cli import BENCHES, SCRIPTS
    assert sorted(BENCHES) == sorted(f.stem[len("bench_"):] for f in SCRIPTS.glob("bench_*.py")
                                     if f.stem != "bench_sparse")      # that one runs under mpiexec
    for name in BENCHES:
        r = subprocess.run([sys.executable, "-m", "hpcps", "bench", name, "--help"], capture_output=True, text=True)
        assert r.returncode == 0 and "--out" in r.stdout, (name, r.stderr)
    r = subprocess.run([sys.executable, "-m", "hpcps", "bench", "nope"], capture_output=True, text=True)
    assert r.returncode == 2 and "invalid choice: 'nope'" in r.stderr


def test_console_script_installed():
    exe = Path(sys.executable).parent / "hpcps"
    assert exe.exists()
    assert "hpcps" in subprocess.run([str(exe), "--version"], capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("n,extra,num_ps,shm", [(4, [], 1, [0]), (5, ["--num-ps", "2", "--transport", "rma"], 2, [])])
def test_demo_verifies_every_update(n, extra, num_ps, shm):
    r = run_mpi(n, ["-m", "hpcps", "demo", "--rows", "20000", "--steps", "30", "--batch", "512"] + extra)
    s = _demo_summary(r.stdout)
    assert s["verified"] is True and s["max_abs_error"] < 0.5
    assert s["num_ps"] == num_ps and s["num_workers"] == n - num_ps
    assert s["pushes_applied"] == (n - num_ps) * 30 * 512
    assert s["shared_memory_ps"] == shm


def test_demo_bad_layout_one_clear_error():
    r = run_mpi(3, ["-m", "hpcps", "demo", "--num-ps", "3"], check=False, timeout=60)
    assert r.returncode != 0
    assert r.stderr.count("hpcps: error: num_ps=3 leaves no worker rank in a world of 3 ranks") == 1
    assert "Traceback" not in r.stderr
