"""The worker pipeline's local parts: the hot-row cache and the communication thread."""

import threading

import numpy as np
import pytest

from hpcps.sparse.pipeline import CommThread, RowCache


def test_cache_serves_rows_until_they_are_older_than_the_bound():
    c = RowCache(64, 3, staleness=2)
    ids = np.array([5, 9, 1000])
    rows = np.arange(9, dtype=np.float32).reshape(3, 3)
    hit, _ = c.lookup(ids, 10)
    assert not hit.any()
    c.insert(ids, rows, 10)
    for step, expect in ((10, True), (12, True), (13, False)):
        hit, got = c.lookup(ids, step)
        assert hit.all() == expect
        if expect:
            np.testing.assert_array_equal(got, rows)
    assert c.take_counts() == (12, 6) and c.take_counts() == (0, 0)


def test_cache_slot_collisions_keep_one_row_per_slot_and_never_mix_rows():
    c = RowCache(4, 2, staleness=5)
    ids = np.arange(0, 400, 7)
    rows = np.stack([ids, -ids], axis=1).astype(np.float32)
    c.insert(ids, rows, 0)
    hit, got = c.lookup(ids, 1)
    assert 1 <= hit.sum() <= 4                       # four slots
    np.testing.assert_array_equal(got, rows[hit])    # a hit is always the id's own row


def test_cache_rejects_bad_sizes():
    with pytest.raises(ValueError, match="capacity"):
        RowCache(0, 4, 1)


def test_comm_thread_runs_in_order_off_the_caller_and_reraises():
    comm = CommThread()
    seen = []
    comm.submit(lambda: seen.append(threading.current_thread().name))
    comm.submit(lambda: seen.append(2))
    comm.drain()
    assert seen[0].startswith("hpcps-comm") and seen[1] == 2
    comm.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        comm.drain()
    comm.close()
    inline = CommThread(enabled=False)
    f = inline.submit(lambda: threading.current_thread().name)
    assert f.result() == threading.current_thread().name
