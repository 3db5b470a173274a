"""Dynamic embedding tables' PS-side core, in one process: placement of any int64 id, the hash
index against a dict, admission, eviction, and optimizer updates equal to a fixed table's."""

import numpy as np
import pytest
import torch

from hpcps.core.ids import initial_rows
from hpcps.core.optimizers import make_optimizer, new_state
from hpcps.core.dynshard import DynamicShard
from hpcps.core.hashindex import HashIndex, owner_of

EDGE = np.array([0, -1, 1, -(2 ** 63), 2 ** 63 - 1, 2 ** 62, 2 ** 62 + 1, -(2 ** 62)], np.int64)


def test_owners_are_a_pure_function_of_the_id_spread_over_the_ps_ranks():
    ids = np.concatenate([EDGE, np.random.default_rng(0).integers(-2 ** 63, 2 ** 63 - 1, 20_000, dtype=np.int64)])
    for n in (1, 3, 8):
        own = owner_of(ids, n)
        assert own.min() >= 0 and own.max() < n
        np.testing.assert_array_equal(own, owner_of(ids.copy(), n))          # no state: same every call
        if n > 1:
            assert np.bincount(own[len(EDGE):], minlength=n).min() > 0.8 * 20_000 / n
    np.testing.assert_array_equal(owner_of(np.arange(10, dtype=np.int64), 1), 0)
    with pytest.raises(TypeError, match="int64"):
        owner_of(np.array([1.5]), 2)
    with pytest.raises(ValueError, match="num_ps"):
        owner_of(EDGE, 0)


def test_the_index_agrees_with_a_dict_through_inserts_removals_and_rebuilds():
    rng = np.random.default_rng(1)
    idx, model = HashIndex(500), {}
    assert idx.mask + 1 == 1024
    pool = np.concatenate([EDGE, rng.integers(-2 ** 63, 2 ** 63 - 1, 3000, dtype=np.int64)])
    for _ in range(200):
        batch = np.unique(rng.choice(pool, 60))
        rows = idx.find(batch)
        np.testing.assert_array_equal(rows, [model.get(int(k), -1) for k in batch])
        new = batch[rows < 0]
        if new.size > idx.free:                         # free some rows: remove random live ones
            live = np.array(list(model.values()), np.int64)
            drop = rng.choice(live, new.size - idx.free + rng.integers(0, 20), replace=False)
            idx.remove(drop)
            model = {k: r for k, r in model.items() if r not in set(drop.tolist())}
        got = idx.insert(new)
        assert len(set(got.tolist()) | set(model.values())) == len(model) + new.size     # rows not shared
        model.update(zip(new.tolist(), got.tolist()))
        assert idx.size == len(model) and idx.free == 500 - len(model)
    keys, rows = idx.live()
    assert dict(zip(keys.tolist(), rows.tolist())) == model
    assert idx.gone < (idx.mask + 1) * 3 // 4
    with pytest.raises(ValueError, match="free rows"):
        idx.insert(rng.integers(0, 2 ** 40, idx.free + 1))
    with pytest.raises(ValueError, match="capacity"):
        HashIndex(0)


def _shard(opt="adagrad", capacity=100, **kw):
    return DynamicShard("emb", 4, capacity, make_optimizer(opt, lr=0.1), seed=3, **kw)


def test_a_new_ids_row_is_its_initial_row_and_any_int64_is_an_id():
    s = _shard()
    rows = s.resolve(np.concatenate([EDGE, EDGE[:3]]), step=0)
    assert (rows >= 0).all() and rows[len(EDGE):].tolist() == rows[:3].tolist()
    np.testing.assert_array_equal(s.pull(rows[:len(EDGE)], EDGE), initial_rows(3, "emb", EDGE, 4))
    assert s.stats() == {"size": len(EDGE), "capacity": 100, "inserts": len(EDGE), "evictions": 0, "rejected": 0}
    with pytest.raises(TypeError, match="int64"):
        s.resolve(np.array([1.0, 2.0]), step=1)


def test_ids_are_admitted_at_their_nth_sighting_and_pushes_before_it_are_dropped():
    s = _shard(admit_min_count=3)
    ids = np.array([7, 7, 9], np.int64)                 # 7 seen twice, 9 once
    rows = s.resolve(ids, step=0)
    assert (rows == -1).all() and s.stats()["size"] == 0
    np.testing.assert_array_equal(s.pull(rows, ids), initial_rows(3, "emb", ids, 4))
    s.push(np.array([-1, -1]), np.ones((2, 4), np.float32), step=0)
    assert s.stats()["rejected"] == 2
    rows = s.resolve(np.array([7, 9], np.int64), step=1)   # 7: third sighting; 9: second
    assert rows[0] >= 0 and rows[1] == -1 and s.stats()["inserts"] == 1


def test_place_with_the_steps_looked_up_rows_equals_place_without_them():
    a, b = _shard(), _shard()
    for s in (a, b):
        s.place(np.array([1, 2, 3], np.int64), step=0)
    seen = np.array([3, 3, 9, 2], np.int64)                # 9 absent; 1 pushed but not looked at
    known = a.look(seen, step=1)
    assert known[0].tolist() == [2, 3, 9] and known[1][2] == -1 and (known[1][:2] >= 0).all()
    b.observe(seen, step=1)
    push = np.array([1, 2, 9, 11], np.int64)
    np.testing.assert_array_equal(a.place(push, 1, known), b.place(push, 1))
    assert a.snapshot()["ids"].tolist() == b.snapshot()["ids"].tolist() and a.stats() == b.stats()
    np.testing.assert_array_equal(a.uses, b.uses)


@pytest.mark.parametrize("policy,batch,victim", [("lru", [5, 2], 1), ("lfu", [5, 4], 2)])
def test_a_full_shard_evicts_by_policy_never_a_row_of_the_step_and_drops_the_state(policy, batch, victim):
    s = _shard(opt="adam", capacity=4, evict=policy)
    s.resolve(np.array([1, 2, 3], np.int64), step=0)
    s.push(s.resolve(np.array([1, 2], np.int64), step=1), np.ones((2, 4), np.float32), step=1)
    s.resolve(np.array([1, 1, 1], np.int64), step=1)
    s.resolve(np.array([4, 3], np.int64), step=2)        # full. last: 1 2 -> 1, 3 4 -> 2; uses 1:5 2:2 3:2 4:1
    s.push(s.index.find(np.array([1, 2, 3, 4], np.int64)), np.ones((4, 4), np.float32), step=2)  # every row has state
    before = set(s.snapshot()["ids"].tolist())
    rows = s.resolve(np.array(batch, np.int64), step=3)  # unprotected, lru would take 2 and lfu 4
    assert before - set(s.snapshot()["ids"].tolist()) == {victim}
    assert s.stats()["evictions"] == 1 and (rows >= 0).all() and s.stats()["size"] == 4
    back = s.resolve(np.array([victim], np.int64), step=4)   # a returning id starts afresh
    np.testing.assert_array_equal(s.pull(back, [victim]), initial_rows(3, "emb", [victim], 4))
    assert all((v[back] == 0).all() for v in s.state.values())


def test_lru_and_lfu_choose_different_victims():
    picks = {}
    for policy in ("lru", "lfu"):
        s = _shard(capacity=3, evict=policy)
        s.resolve(np.array([1, 1, 1, 1, 2, 3], np.int64), step=0)    # 1: 4 uses, at step 0
        s.resolve(np.array([2, 3], np.int64), step=1)                # 2, 3: 2 uses, at step 1
        s.resolve(np.array([9], np.int64), step=2)
        picks[policy] = set(s.snapshot()["ids"].tolist())
    assert picks["lru"] == {2, 3, 9} and picks["lfu"] in ({1, 3, 9}, {1, 2, 9})


def test_a_step_with_more_distinct_ids_than_the_capacity_is_refused_before_any_change():
    s = _shard(capacity=4)
    s.resolve(np.array([1, 2], np.int64), step=0)
    snap = s.snapshot()
    with pytest.raises(ValueError, match="5 distinct ids in one step, more than this shard's capacity of 4"):
        s.resolve(np.arange(10, 15, dtype=np.int64), step=1)
    after = s.snapshot()
    np.testing.assert_array_equal(after["ids"], snap["ids"])
    assert after["counters"] == snap["counters"]
    s.resolve(np.array([1, 2, 3, 4], np.int64), step=1)  # another worker's ids of the same step:
    with pytest.raises(ValueError, match="step 1 needs 1 new rows; 0 are free and 0 not used in this step"):
        s.resolve(np.array([5], np.int64), step=1)       # every row is in use by step 1


@pytest.mark.parametrize("opt", ["sgd", "momentum", "adagrad", "rowwise_adagrad", "adam"])
def test_updates_equal_a_fixed_tables_over_the_same_ids(opt):
    """Admission 1, nothing evicted: every row after 20 steps equals the one a fixed table of the
    same ids (initial rows, state, optimizer) reaches, bit for bit."""
    rng = np.random.default_rng(5)
    universe = np.unique(np.concatenate([EDGE, rng.integers(-2 ** 63, 2 ** 63 - 1, 300, dtype=np.int64)]))
    kw = {"momentum": 0.9} if opt == "momentum" else {}
    name = "sgd" if opt == "momentum" else opt
    dyn = DynamicShard("emb", 4, 400, make_optimizer(name, lr=0.1, **kw), seed=3)
    ref_opt = make_optimizer(name, lr=0.1, **kw)
    w = torch.from_numpy(initial_rows(3, "emb", universe, 4))
    state = {k: torch.from_numpy(v) for k, v in new_state(ref_opt, universe.size, 4).items()}
    for step in range(20):
        ids = rng.choice(universe, 50)
        uniq = np.unique(ids)
        g = rng.standard_normal((uniq.size, 4)).astype(np.float32)
        rows = dyn.resolve(ids, step)
        np.testing.assert_array_equal(dyn.pull(rows, ids), w.numpy()[np.searchsorted(universe, ids)])
        dyn.push(dyn.resolve(uniq, step), g, step)
        ref_opt.apply(w, state, torch.from_numpy(np.searchsorted(universe, uniq)), torch.from_numpy(g), step, step + 1)
    snap = dyn.snapshot()
    np.testing.assert_array_equal(snap["weights"], w.numpy()[np.searchsorted(universe, snap["ids"])])
    assert dyn.stats()["evictions"] == 0


def test_a_levels_delta_holds_the_rows_changed_and_the_ids_evicted_since_its_last_cut():
    s = _shard(capacity=3)
    s.resolve(np.array([1, 2, 3], np.int64), step=0)
    assert s.take_dirty("pfs")[0].size == 3
    assert s.take_dirty("pfs")[0].size == 0 and s.take_dirty("local")[0].size == 3   # each level its own marks
    s.push(s.resolve(np.array([2], np.int64), step=1), np.ones((1, 4), np.float32), step=1)
    s.resolve(np.array([9], np.int64), step=2)                   # evicts 1 (the oldest)
    snap = s.snapshot(s.take_dirty("pfs"))
    assert sorted(snap["ids"].tolist()) == [2, 9] and snap["evicted"].tolist() == [1]
    assert s.snapshot(s.take_dirty("pfs"))["ids"].size == 0
    assert s.take_dirty("local")[1].tolist() == [1]


def test_a_load_beyond_the_capacity_keeps_the_rows_the_policy_would_and_counts_the_rest():
    src = _shard(opt="adagrad", capacity=5)
    for step, ids in enumerate(([1, 2], [3], [4, 5])):
        rows = src.resolve(np.array(ids, np.int64), step)
        src.push(rows, np.full((len(ids), 4), step + 1, np.float32), step)
    snap = src.snapshot()
    dst = _shard(opt="adagrad", capacity=3)
    dst.resolve(np.array([77], np.int64), step=0)               # emptied by the load
    assert dst.load(snap["ids"], snap["weights"], snap["state"], snap["last"], snap["uses"]) == 2
    got = dst.snapshot()
    assert sorted(got["ids"].tolist()) == [3, 4, 5] and got["counters"]["evictions"] == 2
    for i in (3, 4, 5):
        a, b = np.flatnonzero(got["ids"] == i)[0], np.flatnonzero(snap["ids"] == i)[0]
        np.testing.assert_array_equal(got["weights"][a], snap["weights"][b])
        np.testing.assert_array_equal(got["state"]["sum"][a], snap["state"]["sum"][b])
