"""A dynamic table in async mode: admission, rejected pushes, lru eviction and stats over MPI.
Usage: dynamic_misc.py"""
import numpy as np

import hpcps

hpcps.prepare_process()

D = 4
ctx = hpcps.init(num_ps=1, mode="async")
t = hpcps.DynamicEmbeddingTable(ctx, "d", D, 4, optimizer=hpcps.optim.SGD(lr=1.0), seed=3, admit_min_count=2)
if ctx.is_ps:
    ctx.serve()
elif ctx.worker_rank == 0:
    def init(ids):
        return hpcps.initial_rows(3, "d", np.asarray(ids, np.int64), D)

    def step(i, ids, grads=None):
        ctx.step_begin(i)
        rows = t.pull(np.asarray(ids, np.int64))
        if grads is not None:
            t.push(np.asarray(ids, np.int64), grads)
            t.stats()       # a request after the push: the PS applied it (async; a same-host pull reads the window)
        ctx.step_end(i)
        return rows

    np.testing.assert_array_equal(step(0, [5], np.ones((1, D), np.float32)), init([5]))
    s = t.stats()
    assert s["size"] == 0 and s["rejected"] == 1, s               # seen once: not stored, push dropped
    step(1, [5], np.ones((1, D), np.float32))                      # second sighting: admitted
    np.testing.assert_array_equal(step(2, [5]), init([5]) - 1)     # that push applied
    s = t.stats()
    assert s["size"] == 1 and s["inserts"] == 1 and s["rejected"] == 1, s
    zeros = np.zeros((3, D), np.float32)                           # a push stores an admitted id
    for i, ids in enumerate(([10, 11, 12], [10, 11, 12], [5]), start=3):
        step(i, ids, zeros[:len(ids)])                             # 10-12 admitted at 4: full; 5 touched last
    step(6, [20], zeros[:1])
    assert t.stats()["size"] == 4                                  # a pull stores nothing
    step(7, [20], zeros[:1])                                       # 20 admitted: the oldest, 10, evicted
    s = t.stats()
    assert s["size"] == 4 and s["evictions"] == 1 and s["inserts"] == 5 and s["rejected"] == 5, s
    np.testing.assert_array_equal(step(8, [5, 11, 12, 20]), np.concatenate([init([5]) - 1, init([11, 12, 20])]))
    try:
        t.pull(np.arange(5, dtype=np.int64))                       # 5 distinct ids, 4 rows
        raise AssertionError("a pull of more distinct ids than the capacity must be refused")
    except ValueError as e:
        assert "5 distinct ids of PS 0 in one pull, more than its 4 rows" in str(e), e
    try:
        t.push(np.arange(5, dtype=np.int64), np.zeros((5, D), np.float32))
        raise AssertionError("a push of more distinct ids than the capacity must be refused")
    except ValueError as e:
        assert "5 distinct ids of PS 0 in one push, more than its 4 rows" in str(e), e
    assert t.stats() == s                                          # nothing changed
    print("OK dynamic misc", flush=True)
ctx.finalize()
