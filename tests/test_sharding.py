import numpy as np
import pytest

from hpcps.core.sharding import ModuloSharding, logical_tables


@pytest.mark.parametrize("num_rows,num_ps", [(1, 1), (10, 3), (1000, 2), (7, 7), (5, 8)])
def test_partition_is_a_bijection(num_rows, num_ps):
    s = ModuloSharding(num_rows, num_ps)
    ids = np.arange(num_rows)
    owner, local = s.owner(ids), s.local_row(ids)
    assert owner.min() >= 0 and owner.max() < num_ps
    for p in range(num_ps):
        mine = ids[owner == p]
        assert mine.size == s.shard_rows(p)
        np.testing.assert_array_equal(np.sort(local[owner == p]), np.arange(mine.size))
        np.testing.assert_array_equal(s.global_ids(p), mine)
    assert sum(s.shard_rows(p) for p in range(num_ps)) == num_rows


def test_global_ids_range():
    s = ModuloSharding(10, 3)
    np.testing.assert_array_equal(s.global_ids(1, 1, 3), [4, 7])
    np.testing.assert_array_equal(s.global_ids(2, 2, 99), [8])


def test_bad_sharding_args():
    with pytest.raises(ValueError):
        ModuloSharding(0, 1)
    with pytest.raises(ValueError):
        ModuloSharding(10, 2).shard_rows(2)


def test_logical_tables_lay_segments_back_to_back():
    assert logical_tables("t", 5) == [("t", 0, 5)]                      # no segments: the table itself
    assert logical_tables("e", 10, [("a", 3), ("b", 7)]) == [("a", 0, 3), ("b", 3, 7)]


@pytest.mark.parametrize("name", ["modulo", "range"])
def test_ids_of_some_rows_and_in_order(name):
    # a delta checkpoint's few rows: ids_of equals global_ids[rows] without building every id; a
    # shard's own file is "in order" only with every row where it belongs
    from hpcps.core.sharding import make_sharding
    s = make_sharding(name, 100_003, 3)
    rows = np.array([0, 5, 17, s.shard_rows(2) - 1])
    np.testing.assert_array_equal(s.ids_of(2, rows), s.global_ids(2)[rows])
    ids = s.global_ids(1)
    assert s.in_order(1, ids) and not s.in_order(0, ids) and not s.in_order(1, ids[:-1])
    swapped = ids.copy()
    swapped[[0, -1]] = swapped[[-1, 0]]
    assert not s.in_order(1, swapped)
