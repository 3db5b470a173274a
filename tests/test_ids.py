import numpy as np

import pytest

from hpcps.core.ids import default_scale, initial_rows


def test_depends_only_on_seed_name_id():
    a = initial_rows(0, "items", [5, 1, 5], 8)
    b = initial_rows(0, "items", [1], 8)
    np.testing.assert_array_equal(a[0], a[2])
    np.testing.assert_array_equal(a[1], b[0])
    assert not np.array_equal(initial_rows(1, "items", [5], 8), a[:1])
    assert not np.array_equal(initial_rows(0, "users", [5], 8), a[:1])


def test_chunking_does_not_change_values():
    ids = np.arange(1000)
    whole = initial_rows(3, "t", ids, 16)
    parts = np.concatenate([initial_rows(3, "t", ids[i:i + 77], 16) for i in range(0, 1000, 77)])
    np.testing.assert_array_equal(whole, parts)


def test_range_and_spread():
    x = initial_rows(0, "t", np.arange(20000), 16)
    s = default_scale(16)
    assert x.dtype == np.float32 and x.shape == (20000, 16)
    assert x.min() >= -s and x.max() < s
    assert abs(float(x.mean())) < 0.01 * s
    assert abs(float(x.std()) - s / np.sqrt(3)) < 0.01 * s     # uniform
    assert np.unique(x).size > 0.9 * x.size                    # no repeated pattern


def test_normal_and_zeros_initialisers():
    x = initial_rows(0, "t", np.arange(20000), 16, 0.1, kind="normal")
    assert x.dtype == np.float32 and np.isfinite(x).all()
    assert abs(float(x.mean())) < 0.002 and abs(float(x.std()) - 0.1) < 0.002
    assert abs(float(((x / 0.1) ** 4).mean()) - 3.0) < 0.1          # a normal's kurtosis, not a uniform's 1.8
    np.testing.assert_array_equal(x[7:9], initial_rows(0, "t", [7, 8], 16, 0.1, kind="normal"))
    assert not initial_rows(0, "t", np.arange(5), 3, 1.0, kind="zeros").any()
    with pytest.raises(ValueError, match="init must be one of uniform, normal, zeros, got 'he'"):
        initial_rows(0, "t", [1], 3, kind="he")


def test_scale_zero_gives_zeros():
    assert not initial_rows(0, "t", [1, 2], 4, scale=0.0).any()


def test_values_are_pinned():
    # Guards the formula itself: changing it silently breaks old checkpoints.
    x = initial_rows(0, "items", [0, 123456789], 4, scale=1.0)
    np.testing.assert_allclose(x, PINNED, rtol=0, atol=1e-7)


PINNED = np.array([[0.8687059879302979, 0.059241533279418945, -0.3292137384414673, -0.968201756477356],
                   [-0.45154058933258057, 0.6517921686172485, -0.7650408744812012, -0.26896095275878906]],
                  dtype=np.float32)
