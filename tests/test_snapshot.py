"""The chunked copy-on-write snapshot of a PS shard (hpcps/sparse/snapshot.py), without MPI."""

import numpy as np

from hpcps.sparse.snapshot import CHUNK_ROWS, ChunkedSnapshot


def test_rows_changed_while_copying_are_kept_as_they_were_at_the_cut():
    rng = np.random.default_rng(0)
    rows = 3 * CHUNK_ROWS + 123
    weights = rng.random((rows, 4), np.float32)
    acc = rng.random((rows, 4), np.float32)
    seen = rng.random(rows) < 0.5
    cut = (weights.copy(), acc.copy(), seen.copy())
    snap = ChunkedSnapshot({"weights": weights, "sum": acc, "_seen": seen}, {"ids": np.arange(rows), "applies": 7},
                           {"sum": "sum", "_seen": "momentum_seen"})
    steps = 0
    while True:
        # an apply between chunks: some rows behind the copy, some ahead, repeats, the last row
        touched = np.unique(np.concatenate([rng.integers(0, rows, 5000), [rows - 1]]))
        snap.before_apply(touched)
        weights[touched] += 1.0
        acc[touched] *= 2.0
        seen[touched] = ~seen[touched]
        steps += 1
        if snap.step():
            break
    assert steps == 4 and snap.done
    out = snap.result()
    np.testing.assert_array_equal(out["weights"], cut[0])
    np.testing.assert_array_equal(out["state"]["sum"], cut[1])
    assert out["state"]["momentum_seen"].dtype == np.uint8
    np.testing.assert_array_equal(out["state"]["momentum_seen"], cut[2].astype(np.uint8))
    assert out["applies"] == 7 and not np.array_equal(weights, cut[0])     # the live rows did change
