import re

import numpy as np
import pytest
import torch

from hpcps.sparse.validate import as_grads, as_id_rows, as_ids


def test_ids_accepts_ints_lists_and_tensors():
    assert as_ids("t", [1, 2, 2], 3).dtype == np.int64
    np.testing.assert_array_equal(as_ids("t", torch.tensor([0, 2]), 3), [0, 2])
    np.testing.assert_array_equal(as_ids("t", np.array([1], dtype=np.uint32), 3), [1])
    assert as_ids("t", [], 3).shape == (0,)


@pytest.mark.parametrize("ids,msg", [
    ([1.0, 2.0], "table 'items': ids must be integers, got dtype float64"),
    (np.array([True]), "ids must be integers, got dtype bool"),
    (["a"], "ids must be integers"),
    ([-1, 2], "table 'items': id -1 out of range \\[0, 10\\)"),
    ([3, 10], "id 10 out of range \\[0, 10\\)"),
    ([[1, 2]], "ids must be 1-D, got shape \\(1, 2\\)"),
])
def test_bad_ids(ids, msg):
    with pytest.raises(ValueError, match=msg):
        as_ids("items", ids, 10)


def test_grads_ok():
    from hpcps.sparse.validate import grads_ok
    g = as_grads("t", np.ones((2, 4), np.float32), 2, 4)
    big = np.full((4096, 64), 1e18, np.float32)             # every square fits, their sum does not
    assert not grads_ok(big) and as_grads("t", big, 4096, 64) is not None
    assert g.flags.c_contiguous and g.shape == (2, 4)
    assert as_grads("t", torch.ones(3, 4), 3, 4).dtype == np.float32


@pytest.mark.parametrize("grads,msg", [
    (np.ones((2, 4), np.float64), "grads must be float32, got dtype float64"),
    (np.ones((3, 4), np.float32), "grads must have shape \\(2, 4\\) for 2 ids, got \\(3, 4\\)"),
    (np.ones((2, 5), np.float32), "shape"),
    (np.array([[1, 1, 1, 1], [1, np.nan, 1, 1]], np.float32), "NaN or Inf in 1 row\\(s\\), first at position 1"),
    (np.array([[np.inf, 1, 1, 1], [1, 1, 1, 1]], np.float32), "NaN or Inf"),
    # finite, but its square overflows the float32 state of Adagrad or Adam: the row would freeze
    (np.array([[1, 1, 1, 1], [1, 1, 1e38, 1]], np.float32), "magnitude 1e\\+38 in 1 row\\(s\\), first at position 1"),
])
def test_bad_grads(grads, msg):
    with pytest.raises(ValueError, match="table 't': " if "shape" not in msg else msg):
        as_grads("t", grads, 2, 4)
    with pytest.raises(ValueError, match=msg):
        as_grads("t", grads, 2, 4)


def test_id_rows_of_several_tables_fail_as_each_table_would():
    """as_id_rows (the collection's one check of all tables) raises what as_ids raises per table."""
    names, rows = ["a", "b"], np.array([5, 3])
    got = as_id_rows(names, [np.array([0, 4]), np.array([2, 1], np.uint8)], rows)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, [[0, 4], [2, 1]])
    for bad in ([np.array([0, 4]), np.array([2, 3])], [np.array([-1, 4]), np.array([2, 1])],
                [np.array([0, 4]), np.array([2.0, 1.0])]):
        with pytest.raises(ValueError) as per_table:
            for name, x, n in zip(names, bad, rows):
                as_ids(name, x, int(n))
        with pytest.raises(ValueError, match=re.escape(str(per_table.value))):
            as_id_rows(names, bad, rows)
    assert as_id_rows(names, [np.zeros(0, np.int64)] * 2, rows).shape == (2, 0)


@pytest.mark.parametrize("segments,msg", [
    ([("a", 3), ("b", 3)], "segments hold 6 rows, the table 5"),
    ([("a", 3), ("a", 2)], "distinct names"),
    ([("a", 0), ("b", 5)], "non-empty name and rows >= 1"),
    ([("", 5)], "non-empty name"),
    ([("a", 2.5), ("b", 2.5)], "rows >= 1"),
    ([], "distinct names"),
    ([5], "segments must be"),
    (["ab"], "rows >= 1"),
])
def test_table_segments_are_checked_before_any_communication(segments, msg):
    from hpcps.sparse.spec import check_segments
    with pytest.raises(ValueError, match=f"table 'emb': .*{re.escape(msg)}"):
        check_segments("emb", segments, 5)
    assert check_segments("emb", [("a", 2), ("b", np.int64(3))], 5) == (("a", 2), ("b", 3))
    assert check_segments("emb", None, 5) is None
