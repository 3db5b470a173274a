"""Sparse tables under a real mpiexec (oversubscribed), each launch under a timeout."""

import re
import time

import numpy as np
import pytest

from mpirun import run_mpi


@pytest.mark.impi
@pytest.mark.openmpi
@pytest.mark.parametrize("n,num_ps,transport", [(2, 1, "auto"), (3, 1, "rma"), (4, 2, "auto"), (5, 2, "rma")])
def test_pulls_equal_initial_rows(tmp_path, n, num_ps, transport):
    r = run_mpi(n, ["tables_basic.py", num_ps, transport, tmp_path / "rows.npy"])
    assert r.stdout.count("OK rank") == n


def test_rows_identical_for_one_and_two_ps(tmp_path):
    run_mpi(3, ["tables_basic.py", 1, "auto", tmp_path / "p1.npy"])
    run_mpi(3, ["tables_basic.py", 2, "rma", tmp_path / "p2.npy"])
    a, b = np.load(tmp_path / "p1.npy"), np.load(tmp_path / "p2.npy")
    assert a.shape == (1003, 8)
    np.testing.assert_array_equal(a, b)


@pytest.mark.impi
@pytest.mark.openmpi
@pytest.mark.parametrize("n,num_ps,transport", [(4, 1, "auto"), (4, 1, "rma"), (5, 2, "auto"), (5, 2, "rma")])
def test_concurrent_pushes_lose_no_update(n, num_ps, transport):
    r = run_mpi(n, ["concurrent_push.py", num_ps, transport, 150], timeout=180)
    sums = re.findall(r"OK worker \d+ hot-row sum (\d+)", r.stdout)
    assert len(sums) == n - num_ps and len(set(sums)) == 1
    assert int(sums[0]) > 150 * (n - num_ps) * 2          # every worker hit row 0 twice per round


@pytest.mark.openmpi
@pytest.mark.parametrize("n,num_ps,transport,list_rows", [(4, 1, "auto", None), (5, 2, "rma", None),
                                                           (4, 1, "auto", 30), (5, 2, "rma", 12)])
def test_staged_pushes_applied_by_ps_lose_no_update(n, num_ps, transport, list_rows):
    """On the node, the PS finds staged rows on its staged-row list (as long as the shard: it never
    overflows). A list shorter than one push's rows (list_rows) overflows, and the PS scans its
    flags instead, at least after every first push since an apply. Over RMA pushes go to the PS's
    mailboxes; with list_rows they are turned off ("locked"), so the list and the scan are
    tested over RMA too. Whichever way, no update is lost."""
    extra = [] if list_rows is None else [list_rows] + (["locked"] if transport == "rma" else [])
    r = run_mpi(n, ["concurrent_push.py", num_ps, transport, 150, "stateful", *extra], timeout=180)
    assert r.stdout.count("OK worker") == n - num_ps
    counts = [tuple(map(int, m)) for m in re.findall(
        r"OK PS applies listed (\d+) scanned (\d+) slab (\d+) mailbox (\d+)", r.stdout)]
    assert len(counts) == num_ps
    if list_rows is not None:
        assert all(scanned > 0 and mailbox == 0 for _, scanned, _, mailbox in counts)
    elif transport == "rma":             # every push went to a mailbox: no list, no slab
        assert all(mailbox > 0 and scanned == 0 and slab == 0 for _, scanned, slab, mailbox in counts)
    else:
        assert all(listed > 0 and scanned == 0 and mailbox == 0 for listed, scanned, _, mailbox in counts)
    # distinct pushes to a PS on the node go through its hand-off slab (over RMA there is none), and
    # some of them (a push alone since the last apply) are applied from it directly
    if transport == "auto":
        assert all(slab > 0 for _, _, slab, _ in counts)
    else:
        assert all(slab == 0 for _, _, slab, _ in counts)


@pytest.mark.openmpi
@pytest.mark.parametrize("transport", ["auto", "rma"])
def test_pull_and_push_complete_while_ps_is_busy(transport):
    r = run_mpi(2, ["busy_ps.py", transport])
    assert "OK PS was busy" in r.stdout and "OK pull+push+pull" in r.stdout


def test_bad_input_raises_and_job_shuts_down_cleanly():
    r = run_mpi(3, ["bad_input.py"])
    assert r.stdout.count("OK worker") == 2


@pytest.mark.openmpi
@pytest.mark.parametrize("via_mpi4py", [True, False])
def test_failing_rank_ends_the_job_promptly(via_mpi4py):
    start = time.monotonic()
    r = run_mpi(4, ["fail_rank.py"], timeout=60, mpi4py_run=via_mpi4py, check=False)
    assert r.returncode != 0
    assert "worker 1 fails on purpose" in r.stderr
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("arg,n,msg", [
    ("0", 3, "num_ps must be >= 1, got 0"),
    ("3", 3, "num_ps=3 leaves no worker rank in a world of 3 ranks"),
    ("-2", 2, "num_ps must be >= 1"),
    ("mismatch", 3, "ranks disagree on (num_ps, transport, mode, ps_layout, deterministic)"),
])
def test_impossible_layout_fails_on_every_rank(arg, n, msg):
    r = run_mpi(n, ["init_errors.py", arg], timeout=60)
    ranks = re.findall(r"rank (\d+): ValueError: ", r.stdout)      # ranks' lines may interleave
    assert sorted(map(int, ranks)) == list(range(n)), r.stdout
    assert r.stdout.count(msg) == n, r.stdout


def test_num_ps_from_environment():
    r = run_mpi(3, ["init_errors.py", "env"], env={"HPCPS_NUM_PS": "3"}, timeout=60)
    assert r.stdout.count("num_ps=3 leaves no worker") == 3
    r = run_mpi(3, ["init_errors.py", "env"], env={"HPCPS_NUM_PS": "2"}, timeout=60)
    assert r.stdout.count("no error") == 3


@pytest.mark.parametrize("n,num_ps,transport,opt", [(3, 1, "auto", "sgd"), (3, 1, "rma", "adagrad"),
                                                     (4, 2, "rma", "sgd"), (4, 2, "auto", "adagrad")])
def test_prefetch_before_other_workers_pushes_is_refreshed_exactly(n, num_ps, transport, opt):
    # the prefetch runs on the communication thread: MPI_THREAD_MULTIPLE
    r = run_mpi(n, ["prefetch_refresh.py", num_ps, transport, opt], timeout=120, env={"HPCPS_MPI_THREADS": "multiple"})
    assert r.stdout.count("OK worker") == 2


@pytest.mark.parametrize("n,num_ps,transport,dtype,opt", [(3, 1, "auto", "bfloat16", "sgd"),
                                                          (3, 1, "rma", "float16", "adam"),
                                                          (4, 2, "rma", "bfloat16", "adam"),
                                                          (4, 2, "auto", "float16", "sgd")])
def test_16_bit_pulls_are_the_rounded_rows_and_follow_updates(n, num_ps, transport, dtype, opt):
    r = run_mpi(n, ["half_pull.py", num_ps, transport, dtype, opt], timeout=120)
    assert r.stdout.count("OK worker") == 2


@pytest.mark.parametrize("n,num_ps,transport,dtype,slot", [(3, 1, "rma", "bfloat16", None),
                                                           (3, 1, "auto", "float16", None),
                                                           (4, 2, "rma", "float16", None),
                                                           (4, 2, "auto", "bfloat16", None),
                                                           (3, 1, "rma", "bfloat16", 50)])
def test_16_bit_pushes_apply_the_rounded_row_sums(n, num_ps, transport, dtype, slot):
    r = run_mpi(n, ["half_push.py", num_ps, transport, dtype] + ([slot] if slot else []), timeout=120)
    assert r.stdout.count("OK worker") == 2
    if slot:        # a 50-row mailbox slot cannot take a push of ~80 rows: those went as float32, still exact
        assert sum(int(line.split()[-1]) for line in r.stdout.splitlines() if "OK worker" in line) > 0


@pytest.mark.parametrize("n,num_ps,transport,sharding", [(4, 2, "auto", "range"), (5, 3, "rma", "range"),
                                                          (4, 2, "rma", "custom"), (3, 1, "auto", "custom")])
def test_another_placement_pulls_and_pushes_the_right_rows(n, num_ps, transport, sharding):
    """Contiguous ranges, and a placement object of the program's own, on both push paths."""
    r = run_mpi(n, ["placement.py", num_ps, transport, sharding], timeout=120)
    assert r.stdout.count("OK worker") == n - num_ps and r.stdout.count("snapshot") == num_ps
