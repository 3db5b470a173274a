"""Dynamic embedding tables under a real mpiexec (oversubscribed), each launch under a timeout."""

import json
import re
import subprocess
import sys

import h5py
import numpy as np

import pytest

from mpirun import run_mpi, run_selected


# the launches of the two tests below, batched by rank count (mpirun.run_selected)
LAUNCH = {"test_sync_mode_equals_a_one_process_reference_for_any_int64_id":
          lambda p, d: [(p["n"], False, ["dynamic_sync.py", p["num_ps"], p["opt"], 12])],
          "test_admission_eviction_and_stats_over_mpi_in_async_mode": lambda p, d: [(3, False, ["dynamic_misc.py"])]}


@pytest.fixture(scope="module")
def batched(request, tmp_path_factory):
    return run_selected(request, LAUNCH, tmp_path_factory.mktemp("dynamic"), timeout=400)


@pytest.mark.parametrize("n,num_ps,opt", [(3, 1, "adagrad"), (4, 2, "adam"), (5, 2, "sgd")])
def test_sync_mode_equals_a_one_process_reference_for_any_int64_id(batched, request, n, num_ps, opt):
    out = batched[request.node.name][0][0]
    got = re.findall(r"OK worker \d+ size (\d+) checksum ([0-9.]+)", out)
    assert len(got) == n - num_ps and len(set(got)) == 1, out
    assert int(got[0][0]) > 300                           # most of the 508 ids were seen and stored


def test_admission_eviction_and_stats_over_mpi_in_async_mode(batched, request):
    assert "OK dynamic misc" in batched[request.node.name][0][0]


def _shards(tmp_path, pattern: str) -> dict:
    """The PS ranks' saved shards of one run, joined and sorted by id."""
    files = [np.load(f) for f in sorted(tmp_path.glob(pattern))]
    assert files, pattern
    ids = np.concatenate([f["ids"] for f in files])
    order = np.argsort(ids)
    keys = [k for k in files[0].files if k not in ("counters", "applies")]
    out = {k: np.concatenate([f[k] for f in files])[order] for k in keys}
    out["counters"] = sum(f["counters"] for f in files)
    return out


def _equal(a: dict, b: dict, keys=None) -> None:
    for k in keys or a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _ckpt_run(tmp, n, num_ps, mode, opt, cap, admit, init, start, stop, ckpts, tag):
    r = run_mpi(n, ["dynamic_ckpt.py", num_ps, mode, opt, cap, admit, init, tmp, start, stop, ckpts, tag], timeout=180)
    assert r.stdout.count("OK worker") == n - num_ps, r.stdout


def test_a_checkpoint_chain_with_evictions_restores_onto_any_ps_count(tmp_path):
    """Full at step 3, a delta at 7 (rows changed, ids evicted since 3): restored onto 3 PS and 1
    PS (a larger capacity there), the union of the shards is the 2-PS table's, bit for bit, with
    its counters."""
    _ckpt_run(tmp_path, 4, 2, "sync", "adagrad", 300, 1, "uniform", 0, 7, "3,7", "a")
    written = _shards(tmp_path, "a-end-ps*.npz")
    assert written["counters"][1] > 0                      # evictions happened, some between 3 and 7
    assert json.loads((tmp_path / "step-000000007" / "manifest.json").read_text())["kind"] == "delta"
    for n, num_ps in ((5, 3), (3, 1)):
        _ckpt_run(tmp_path, n, num_ps, "sync", "adagrad", 600, 1, "uniform", 7, 7, "", f"r{num_ps}")
        _equal(written, _shards(tmp_path, f"r{num_ps}-restored-ps*.npz"))


def test_a_resumed_run_equals_an_uninterrupted_one_bit_for_bit(tmp_path):
    """Same PS count, admission at 2 (the sketch is restored too), Adam, evictions: 12 steps in one
    run, or 8 (checkpoints at 4 and 8, a delta) and then 4 more from the checkpoint."""
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    _ckpt_run(one, 4, 2, "sync", "adam", 300, 2, "uniform", 0, 12, "", "b")
    _ckpt_run(two, 4, 2, "sync", "adam", 300, 2, "uniform", 0, 8, "4,8", "c")
    _ckpt_run(two, 4, 2, "sync", "adam", 300, 2, "uniform", 8, 12, "", "d")
    whole, resumed = _shards(one, "b-end-ps*.npz"), _shards(two, "d-end-ps*.npz")
    assert whole["counters"][1] > 0 and whole["counters"][2] > 0     # evictions and rejected pushes
    _equal(whole, resumed)


def test_async_checkpoints_and_finalize_hold_every_push_of_their_steps(tmp_path):
    """Async mode, exact sums: the end state (every push applied before finalize) and the
    checkpoint at step 4 (every push of steps < 4; read through ``hpcps ckpt export``) equal
    sync mode's."""
    sync, asyn = tmp_path / "sync", tmp_path / "async"
    sync.mkdir(), asyn.mkdir()
    _ckpt_run(sync, 4, 2, "sync", "sgd", 2000, 1, "zeros", 0, 8, "4", "s")
    _ckpt_run(asyn, 4, 2, "async", "sgd", 2000, 1, "zeros", 0, 8, "4", "e")
    _equal(_shards(sync, "s-end-ps*.npz"), _shards(asyn, "e-end-ps*.npz"), ["ids", "weights", "counters"])
    exports = []
    for d in (sync, asyn):                  # `hpcps ckpt export` of each step-4 checkpoint: ids and rows
        out = d / "export.h5"
        subprocess.run([sys.executable, "-m", "hpcps", "ckpt", "export", str(d / "step-000000004"), "--out", str(out)],
                       check=True, capture_output=True, text=True, timeout=120)
        with h5py.File(out, "r") as f:
            exports.append((f["tables/emb/ids"][...], f["tables/emb/weights"][...]))
    (ids, rows), (ids2, rows2) = exports
    assert ids.size > 100 and np.all(np.diff(ids) > 0) and np.abs(rows).sum() > 0
    np.testing.assert_array_equal(ids, ids2)
    np.testing.assert_array_equal(rows, rows2)


def test_a_sync_step_needing_more_rows_than_a_shard_has_stops_the_job_with_the_reason():
    r = run_mpi(3, ["dynamic_overflow.py"], timeout=120, check=False)
    assert r.returncode != 0 and "the step was applied" not in r.stdout
    assert "8 distinct ids in one step, more than this shard's capacity of 6 rows (raise capacity)" in r.stderr, \
        r.stderr[-2000:]
