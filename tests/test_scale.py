"""Counting (issue 42, scripts/bench_scale.py): with HPCPS_COUNT_MPI=1 a run reports each rank's
one-sided operations, bytes and round trips by target, its dense all-reduces and a PS's rows
applied; the bench's growth fit."""

import json
import sys

import numpy as np
import pytest

from mpirun import ROOT, run_mpi

sys.path.insert(0, str(ROOT / "scripts"))
import bench_scale  # noqa: E402

TINY = ROOT / "tests" / "configs" / "tiny_ctr.toml"


def _final(stdout: str) -> dict:
    return json.loads([x for x in stdout.splitlines() if x.startswith('{"final"')][0])["final"]


def test_a_counted_run_reports_every_ranks_operations_by_target(tmp_path):
    """2 PS + 2 workers over RMA (job.transport=rma), 30 steps: each worker reads from and pushes
    to both PS every step and all-reduces the dense gradients once a step (their exact bytes);
    each PS applied rows; start-up is the process's age at its first step. Uncounted, the
    summary has no counts."""
    sets = ["job.num_ps=2", "job.transport=rma", "metrics.progress=false", f"job.export={tmp_path / 'w.npz'}"]
    f = _final(run_mpi(4, ["-m", "hpcps", "train", "--config", TINY, "--set", *sets],
                       env={"HPCPS_COUNT_MPI": "1"}, timeout=180).stdout)
    counts, steps = f["counts"], f["steps"]
    ps = [r for r, c in enumerate(counts) if c["ps"]]
    assert len(counts) == 4 and len(ps) == 2
    dense = np.load(tmp_path / "w.npz")
    dense_bytes = sum(dense[k].nbytes for k in dense.files if k.startswith("dense/"))
    for c in (c for c in counts if not c["ps"]):
        s = c["steps"]
        assert s["allreduce_calls"] == steps and s["allreduce_bytes"] == steps * dense_bytes
        for p in ps:                # a read and a push (a Put of rows and gradients at least) a step
            assert s["ops"][str(p)] >= 2 * steps and s["bytes"][str(p)] > 0 and s["round_trips"][str(p)] >= steps
        assert 0 < c["startup_s"] < 600 and c["steps_s"] > 0
        assert all(c["total"]["ops"][t] >= n for t, n in s["ops"].items())     # the steps are part of the run
    assert all(counts[p]["rows_applied"] > 0 for p in ps)
    plain = _final(run_mpi(3, ["-m", "hpcps", "train", "--config", TINY, "--set", "job.steps=2", "metrics.progress=false"],
                           timeout=120).stdout)
    assert "counts" not in plain


def test_the_growth_fit_finds_each_exponent_and_marks_what_grows_faster_than_its_data():
    xs = [2, 4, 8, 16]
    assert bench_scale.exponent(xs, [x ** 2 for x in xs]) == pytest.approx(2)
    assert bench_scale.exponent(xs, [5.0] * 4) == pytest.approx(0)
    assert bench_scale.exponent([4], [1.0]) is None
    runs = [{"W": w, **{q: 1.0 for q in bench_scale.EXPECTED}} for w in xs]
    for r in runs:
        r["ps_ops_received"] = r["W"]                  # its data: O(W)
        r["worker_ops_to_ps"] = r["W"] ** 0.5          # each worker's ops should not grow with W
    fit = bench_scale.fits(runs, "W")
    assert not fit["ps_ops_received"]["faster"] and fit["ps_ops_received"]["exponent"] == pytest.approx(1)
    assert fit["worker_ops_to_ps"]["faster"] and not fit["checkpoint_mb"]["faster"]
