"""``hpcps train`` with ``model.dynamic_tables``: the DLRM on one dynamic table keyed by salted
64-bit feature keys, through checkpoints (node-local level, resharding) and ``hpcps ckpt export``."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np

from mpirun import run_mpi

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "configs" / "tiny_ctr.toml"
# 3 columns of 300 ids in 400 rows: evictions; admission at 2: rejected pushes
DYN = ["metrics.progress=false", "model.dynamic_tables=true", "model.dynamic_capacity=400", "model.admit_min_count=2",
       "optimizer.sparse.name=adam", "optimizer.sparse.lr=0.05"]


def _train(n, sets, **kw):
    r = run_mpi(n, ["-m", "hpcps", "train", "--config", TINY, "--set", *DYN, *sets], timeout=240, **kw)
    return r, [json.loads(l) for l in r.stdout.splitlines() if l.startswith('{"final"')][-1]["final"]


def _export(ckpt: Path, out: Path) -> dict:
    subprocess.run([sys.executable, "-m", "hpcps", "ckpt", "export", str(ckpt), "--out", str(out)],
                   check=True, capture_output=True, text=True, timeout=120)
    with h5py.File(out, "r") as f:
        got = {}
        f.visititems(lambda k, d: got.__setitem__(k, d[...]) if isinstance(d, h5py.Dataset) else None)
    return got


def test_a_dlrm_on_a_dynamic_table_restarts_bit_equal_from_the_node_local_level_and_reshards(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    _, straight = _train(4, [f"checkpoint.dir={one}"])
    st = straight["dynamic_table"]
    assert st["size"] == 400 and st["evictions"] > 0 and st["rejected"] > 0, st
    assert straight["auc"] > 0.55 and straight["sharding"] == "hash"
    lay = straight["layout"]        # one host: every worker reads the PS's window, pushes are messages
    assert lay["remote"] == "messages" and all(w["shm_ps"] == [0] for w in lay["workers"]), lay
    # node-local checkpoints every 4 steps (deltas on a full one); the filesystem's only at the end
    sets = [f"checkpoint.dir={two}", f"checkpoint.local_dir={tmp_path / 'local'}", "checkpoint.local_every=4",
            "checkpoint.local_full_every=10"]
    _, first = _train(4, sets)
    done = first["local_checkpoints"]
    assert first["checkpoints"] == [30] and len(done) >= 3, first
    shutil.rmtree(two / "step-000000030")
    r, again = _train(4, sets)
    assert again["restored_from"] == "local" and again["start_step"] == done[-1], r.stderr[-2000:]
    a, b = _export(one / "step-000000030", tmp_path / "a.h5"), _export(two / "step-000000030", tmp_path / "b.h5")
    assert set(a) == set(b) and "tables/embeddings/ids" in a and a["tables/embeddings/ids"].size == 400
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert again["auc"] == straight["auc"] and again["dynamic_table"] == st
    # onto 2 PS ranks with room for every row: the same rows and counters (nothing left to train)
    _, wide = _train(5, [f"checkpoint.dir={one}", "job.num_ps=2", "model.dynamic_capacity=800"])
    assert wide["start_step"] == 30 and wide["num_ps"] == 2
    assert wide["dynamic_table"] == {**st, "capacity": 800}
    assert wide["auc"] == straight["auc"]
    # a fixed-table job on those checkpoints: a clear error, the checkpoints untouched
    before = sorted((p.name, sorted(f.name for f in p.iterdir())) for p in one.glob("step-*"))
    r = run_mpi(4, ["-m", "hpcps", "train", "--config", TINY, "--set", *DYN, "model.dynamic_tables=false",
                    f"checkpoint.dir={one}"], timeout=240, check=False)
    assert r.returncode != 0 and "holds a model with model.dynamic_tables = True, this run has False" in r.stderr, \
        r.stderr[-2000:]
    assert sorted((p.name, sorted(f.name for f in p.iterdir())) for p in one.glob("step-*")) == before
