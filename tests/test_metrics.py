import itertools

import numpy as np
import pytest

from hpcps.core.metrics import auc, logloss, mae, rmse


def _auc_brute(y, s):
    pos = [b for a, b in zip(y, s) if a == 1]
    neg = [b for a, b in zip(y, s) if a == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


@pytest.mark.parametrize("seed", range(5))
def test_auc_matches_pairwise_count_with_ties(seed):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, 60)
    s = rng.integers(0, 6, 60).astype(float)               # many ties
    assert auc(y, s) == pytest.approx(_auc_brute(y, s))


def test_auc_extremes():
    assert auc([0, 0, 1, 1], [0.1, 0.2, 0.3, 0.4]) == 1.0
    assert auc([1, 1, 0, 0], [0.1, 0.2, 0.3, 0.4]) == 0.0
    assert np.isnan(auc([1, 1], [0.1, 0.2]))


def test_logloss_rmse_mae():
    assert logloss([1, 0], [0.5, 0.5]) == pytest.approx(np.log(2))
    assert rmse([1, 2, 3], [1, 2, 5]) == pytest.approx(np.sqrt(4 / 3))
    assert mae([1, 2, 3], [1, 2, 5]) == pytest.approx(2 / 3)
