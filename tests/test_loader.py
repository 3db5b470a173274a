"""The batch loader process (hpcps.data.loader): the same batches as drawing them in place, its
failures reported, its child always reaped."""

import os

import numpy as np
import pytest

from hpcps.data.base import Batch
from hpcps.data.loader import BatchAhead, placement, supported
from hpcps.data.synthetic import SyntheticCTR
from hpcps.nn import IdPlan

pytestmark = pytest.mark.skipif(not supported(), reason="the loader runs on Linux x86-64 only")


def _synthetic(workers=1, worker=0):
    return SyntheticCTR(3, 500, 4, 64, 100, 1.2, 7, workers, worker)


def _same(a: Batch, b: Batch):
    np.testing.assert_array_equal(a.dense, b.dense)
    np.testing.assert_array_equal(a.labels, b.labels)
    assert len(a.sparse) == len(b.sparse)
    for x, y in zip(a.sparse, b.sparse):
        assert x.dtype == y.dtype == np.int64
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(a.truth, b.truth)


def _gone(pid):
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


@pytest.mark.parametrize("defer", [False, True])
def test_same_batches_as_drawn_in_place(defer):
    data, ref = _synthetic(3, 1), _synthetic(3, 1)
    with BatchAhead(data, 5, 40, depth=2, defer=defer) as loader:
        pid = loader._pid
        assert pid and pid != os.getpid()
        for step in range(5, 40):
            _same(loader.train_batch(step), ref.train_batch(step))
            loader.release()
        assert loader.wait_s >= 0
    _gone(pid)


def test_a_step_out_of_order_is_drawn_here():
    data, ref = _synthetic(), _synthetic()
    with BatchAhead(data, 0, 10) as loader:
        _same(loader.train_batch(0), ref.train_batch(0))
        _same(loader.train_batch(7), ref.train_batch(7))       # not the next one: drawn in place
        _same(loader.train_batch(1), ref.train_batch(1))       # the loader's order goes on


class _Failing:
    def __init__(self, bad_step):
        self.inner, self.bad_step = _synthetic(), bad_step

    def train_batch(self, step):
        if step == self.bad_step:
            raise ValueError(f"corrupt record in batch {step}")
        return self.inner.train_batch(step)


def test_an_error_in_the_child_is_raised_with_its_message():
    loader = BatchAhead(_Failing(3), 0, 10)
    pid = loader._pid
    for step in range(3):
        loader.train_batch(step)
    with pytest.raises(RuntimeError, match=r"(?s)failed drawing batch 3.*ValueError: corrupt record in batch 3"):
        loader.train_batch(3)
    _gone(pid)


class _Shrinking:
    """Batches of 64 samples, then of 32 from step 4 on: the child stops, the worker draws them."""

    def __init__(self):
        self.inner = _synthetic()

    def train_batch(self, step):
        b = self.inner.train_batch(step)
        if step < 4:
            return b
        return Batch(b.dense[:32], [s[:32] for s in b.sparse], b.labels[:32], b.truth[:32])


def test_a_batch_of_another_shape_is_drawn_here():
    data, ref = _Shrinking(), _Shrinking()
    loader = BatchAhead(data, 0, 12)
    pid = loader._pid
    for step in range(12):
        got = loader.train_batch(step)
        _same(got, ref.train_batch(step))
        assert len(got) == (64 if step < 4 else 32)
    assert loader._pid is None
    _gone(pid)


def test_close_reaps_the_child_and_restores_the_affinity():
    before = os.sched_getaffinity(0)
    where = placement(0, 1)
    if len(before) >= 2:
        assert where is not None and where[0] in before and where[0] not in where[1] and where[1] <= before
    loader = BatchAhead(_synthetic(), 0, 1000, cpus=where)
    pid = loader._pid
    loader.train_batch(0)
    if where is not None:
        assert os.sched_getaffinity(0) == {where[0]}
    loader.close()
    loader.close()                                             # twice is fine
    _gone(pid)
    assert os.sched_getaffinity(0) == before


def test_the_child_leaves_stop_signals_to_its_worker():
    # Slurm signals every process of a job step; the worker checkpoints, then closes the child
    import signal
    import time
    data, ref = _synthetic(), _synthetic()
    with BatchAhead(data, 0, 20) as loader:
        loader.train_batch(0)
        time.sleep(0.2)                                        # the child has set its handlers
        os.kill(loader._pid, signal.SIGUSR1)
        os.kill(loader._pid, signal.SIGTERM)
        for step in range(1, 20):
            _same(loader.train_batch(step), ref.train_batch(step))
        pid = loader._pid
    _gone(pid)


def test_placement_needs_two_cpus():
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        assert placement(0, 1) is None
    finally:
        os.sched_setaffinity(0, before)


def test_bad_depth_is_refused():
    with pytest.raises(ValueError, match="depth must be >= 1"):
        BatchAhead(_synthetic(), 0, 10, depth=0)


class _Table:
    """What IdPlan reads of an EmbeddingTable: its logical tables (name, first row, rows) and size."""

    def __init__(self, *logical):
        self.logical, self.num_rows = list(logical), sum(r for *_, r in logical)


def _plan():
    # two tables of the synthetic source's three ids, one batched (two logical tables), one not
    return IdPlan([_Table(("f0", 0, 500), ("f1", 500, 500)), _Table(("f2", 0, 500))])


def _same_plan(got, want):
    assert len(got) == len(want) == 3
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    assert list(got[2]) == list(want[2])


def test_the_child_makes_each_batchs_id_plan():
    data, ref = _synthetic(), _synthetic()
    here = _plan()

    def annex(batch):
        return here.pack(batch.sparse)
    with BatchAhead(data, 0, 12, annex=annex) as loader:
        assert loader.train_batch(0) is not None and loader.annex_of(0) is None   # drawn here, no annex
        for step in range(1, 12):
            batch = loader.train_batch(step)
            _same(batch, ref.train_batch(step))
            assert loader.annex_of(step + 1) is None
            made = IdPlan.unpack(loader.annex_of(step))
            _same_plan(made, _plan().plan(batch.sparse))
            uniq, index, cut = made
            assert len(cut) == 3 and cut[0] == 0 and cut[-1] == uniq.size
            keys = np.stack(batch.sparse).T + np.array([0, 500, 0])
            bag = np.array([0, 0, 1000])
            np.testing.assert_array_equal(uniq[index], keys + bag)      # the key of each sample's id


def test_ids_that_fail_the_checks_give_no_plan():
    plan = _plan()
    good = [np.array([1, 2, 499]), np.array([0, 0, 3]), np.array([7, 7, 7])]
    _same_plan(IdPlan.unpack(dict(plan.pack(good))), plan.plan(good))
    bad = [np.array([1, 2, 500]), good[1], good[2]]
    assert IdPlan.unpack(dict(plan.pack(bad))) is None          # the worker's own plan names the table
    with pytest.raises(ValueError, match="table 'f0': id 500 out of range"):
        plan.plan(bad)
    fields = dict(plan.pack(bad))
    assert {k: v.shape for k, v in fields.items()} == {k: v.shape for k, v in plan.pack(good)}   # one layout
