"""Sparse tables under a real mpiexec (oversubscribed), each launch under a timeout."""

import re
import time

import numpy as np
import pytest

from mpirun import run_mpi, run_selected

# The launches of most tests below, batched: what each test runs, from its parameters and a
# directory of its own -> [(ranks, MPI_THREAD_MULTIPLE?, [program.py, args...]), ...]
LAUNCH = {
    "test_pulls_equal_initial_rows": lambda p, d: [(p["n"], False, ["tables_basic.py", p["num_ps"], p["transport"],
                                                                    d / "rows.npy"])],
    "test_rows_identical_for_one_and_two_ps": lambda p, d: [(3, False, ["tables_basic.py", 1, "auto", d / "p1.npy"]),
                                                           (3, False, ["tables_basic.py", 2, "rma", d / "p2.npy"])],
    "test_concurrent_pushes_lose_no_update": lambda p, d: [(p["n"], False, ["concurrent_push.py", p["num_ps"],
                                                                            p["transport"], 150])],
    "test_staged_pushes_applied_by_ps_lose_no_update": lambda p, d: [(p["n"], False, [
        "concurrent_push.py", p["num_ps"], p["transport"], 150, "stateful",
        *([] if p["list_rows"] is None else [p["list_rows"]] + (["locked"] if p["transport"] == "rma" else []))])],
    "test_pull_and_push_complete_while_ps_is_busy": lambda p, d: [(2, False, ["busy_ps.py", p["transport"]])],
    # the prefetch runs on the communication thread: MPI_THREAD_MULTIPLE
    "test_prefetch_before_other_workers_pushes_is_refreshed_exactly": lambda p, d: [(p["n"], True, [
        "prefetch_refresh.py", p["num_ps"], p["transport"], p["opt"]])],
    "test_16_bit_pulls_are_the_rounded_rows_and_follow_updates": lambda p, d: [(p["n"], False, [
        "half_pull.py", p["num_ps"], p["transport"], p["dtype"], p["opt"]])],
    "test_16_bit_pushes_apply_the_rounded_row_sums": lambda p, d: [(p["n"], False, [
        "half_push.py", p["num_ps"], p["transport"], p["dtype"], *([p["slot"]] if p["slot"] else [])])],
    "test_another_placement_pulls_and_pushes_the_right_rows": lambda p, d: [(p["n"], False, [
        "placement.py", p["num_ps"], p["transport"], p["sharding"]])],
}


@pytest.fixture(scope="module")
def batched(request, tmp_path_factory):
    """The LAUNCH programs of the selected tests, batched (``mpirun.run_selected``)."""
    return run_selected(request, LAUNCH, tmp_path_factory.mktemp("tables"))




@pytest.mark.impi
@pytest.mark.openmpi
@pytest.mark.parametrize("n,num_ps,transport", [(2, 1, "auto"), (3, 1, "rma"), (4, 2, "auto"), (5, 2, "rma/messages")])
def test_pulls_equal_initial_rows(batched, request, n, num_ps, transport):
    assert batched[request.node.name][0][0].count("OK rank") == n


def test_rows_identical_for_one_and_two_ps(batched, request):
    d = batched[request.node.name][1]
    a, b = np.load(d / "p1.npy"), np.load(d / "p2.npy")
    assert a.shape == (1003, 8)
    np.testing.assert_array_equal(a, b)


@pytest.mark.impi
@pytest.mark.openmpi
@pytest.mark.parametrize("n,num_ps,transport", [(4, 1, "auto"), (4, 1, "rma"), (5, 2, "auto"), (5, 2, "rma")])
def test_concurrent_pushes_lose_no_update(batched, request, n, num_ps, transport):
    sums = re.findall(r"OK worker \d+ hot-row sum (\d+)", batched[request.node.name][0][0])
    assert len(sums) == n - num_ps and len(set(sums)) == 1
    assert int(sums[0]) > 150 * (n - num_ps) * 2          # every worker hit row 0 twice per round


@pytest.mark.parametrize("n,num_ps,transport,list_rows", [pytest.param(4, 1, "auto", None, marks=pytest.mark.openmpi),
                                                           (5, 2, "rma", None), (4, 1, "auto", 30),
                                                           pytest.param(5, 2, "rma", 12, marks=pytest.mark.openmpi)])
def test_staged_pushes_applied_by_ps_lose_no_update(batched, request, n, num_ps, transport, list_rows):
    """On the node, the PS finds staged rows on its staged-row list (as long as the shard: it never
    overflows). A list shorter than one push's rows (list_rows) overflows, and the PS scans its
    flags instead, at least after every first push since an apply. Over RMA pushes go to the PS's
    mailboxes; with list_rows they are turned off ("locked"), so the list and the scan are
    tested over RMA too. Whichever way, no update is lost."""
    out = batched[request.node.name][0][0]
    assert out.count("OK worker") == n - num_ps
    counts = [tuple(map(int, m)) for m in re.findall(
        r"OK PS applies listed (\d+) scanned (\d+) slab (\d+) mailbox (\d+)", out)]
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
def test_pull_and_push_complete_while_ps_is_busy(batched, request, transport):
    out = batched[request.node.name][0][0]
    assert "OK PS was busy" in out and "OK pull+push+pull" in out


def test_bad_input_raises_and_job_shuts_down_cleanly():
    r = run_mpi(3, ["bad_input.py"])
    assert r.stdout.count("OK worker") == 2


@pytest.mark.parametrize("via_mpi4py", [pytest.param(True, marks=pytest.mark.openmpi), False])
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
                                                     (4, 2, "rma/messages", "sgd"), (4, 2, "auto", "adagrad")])
def test_prefetch_before_other_workers_pushes_is_refreshed_exactly(batched, request, n, num_ps, transport, opt):
    assert batched[request.node.name][0][0].count("OK worker") == 2


@pytest.mark.parametrize("n,num_ps,transport,dtype,opt", [(3, 1, "auto", "bfloat16", "sgd"),
                                                          (3, 1, "rma", "float16", "adam"),
                                                          (4, 2, "rma/messages", "bfloat16", "adam"),
                                                          (4, 2, "auto", "float16", "sgd")])
def test_16_bit_pulls_are_the_rounded_rows_and_follow_updates(batched, request, n, num_ps, transport, dtype, opt):
    assert batched[request.node.name][0][0].count("OK worker") == 2


@pytest.mark.parametrize("n,num_ps,transport,dtype,slot", [(3, 1, "rma", "bfloat16", None),
                                                           (3, 1, "auto", "float16", None),
                                                           (4, 2, "rma", "float16", None),
                                                           (4, 2, "auto", "bfloat16", None),
                                                           (3, 1, "rma", "bfloat16", 50)])
def test_16_bit_pushes_apply_the_rounded_row_sums(batched, request, n, num_ps, transport, dtype, slot):
    out = batched[request.node.name][0][0]
    assert out.count("OK worker") == 2
    if slot:        # a 50-row mailbox slot cannot take a push of ~80 rows: those went as float32, still exact
        assert sum(int(line.split()[-1]) for line in out.splitlines() if "OK worker" in line) > 0


@pytest.mark.parametrize("n,num_ps,transport,sharding", [(4, 2, "auto", "range"), (5, 3, "rma", "range"),
                                                          (4, 2, "rma", "custom"), (3, 1, "auto", "custom")])
def test_another_placement_pulls_and_pushes_the_right_rows(batched, request, n, num_ps, transport, sharding):
    """Contiguous ranges, and a placement object of the program's own, on both push paths."""
    out = batched[request.node.name][0][0]
    assert out.count("OK worker") == n - num_ps and out.count("snapshot") == num_ps
