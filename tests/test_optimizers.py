"""Each sparse optimizer's row update equals torch.optim (or FBGEMM's row-wise Adagrad) for the same gradients."""

import math

import numpy as np
import pytest
import torch

from hpcps.core.optimizers import FTRL, Adagrad, Adam, LRSchedule, SGD, make_optimizer, new_state

ROWS, DIM, STEPS = 6, 5, 25


def _run_ours(opt, w0, grads, touched):
    w = torch.from_numpy(w0.copy())
    state = {k: torch.from_numpy(v) for k, v in new_state(opt, ROWS, DIM).items()}
    for step, (g, rows) in enumerate(zip(grads, touched)):
        opt.apply(w, state, torch.from_numpy(rows), torch.from_numpy(g[rows]), step, step + 1)
    return w.numpy()


def _run_torch(make, w0, grads, touched, sparse):
    p = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    o = make([p])
    for g, rows in zip(grads, touched):
        if sparse:
            p.grad = torch.sparse_coo_tensor(torch.from_numpy(rows)[None], torch.from_numpy(g[rows]), (ROWS, DIM),
                                             check_invariants=True)
        else:
            p.grad = torch.from_numpy(g.copy())
        o.step()
    return p.detach().numpy()


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(ROWS, DIM)).astype(np.float32)
    grads = [rng.normal(size=(ROWS, DIM)).astype(np.float32) for _ in range(STEPS)]
    every = [np.arange(ROWS) for _ in range(STEPS)]
    some = [np.sort(rng.choice(ROWS, 3, replace=False)) for _ in range(STEPS)]
    return w0, grads, every, some


CASES = [
    (SGD(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1), True),
    (SGD(lr=0.1, momentum=0.9), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), False),
    (SGD(lr=0.1, weight_decay=0.01), lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.01), False),
    (SGD(lr=0.05, momentum=0.5, weight_decay=0.1),
     lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.5, weight_decay=0.1), False),
    (Adagrad(lr=0.1), lambda p: torch.optim.Adagrad(p, lr=0.1), True),
    (Adagrad(lr=0.1, initial_accumulator_value=0.5),
     lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.5), True),
    (Adam(lr=0.01), lambda p: torch.optim.SparseAdam(p, lr=0.01), True),
    (Adam(lr=0.01, betas=(0.8, 0.99), eps=1e-6), lambda p: torch.optim.SparseAdam(p, lr=0.01, betas=(0.8, 0.99),
                                                                                  eps=1e-6), True),
]


@pytest.mark.parametrize("ours,make,sparse", CASES, ids=lambda c: repr(c)[:40] if not callable(c) else "")
def test_rows_touched_every_step_match_torch(data, ours, make, sparse):
    w0, grads, every, _ = data
    np.testing.assert_allclose(_run_ours(ours, w0, grads, every), _run_torch(make, w0, grads, every, sparse),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("ours,make", [(c[0], c[1]) for c in CASES if c[2]])
def test_lazy_rows_match_torch_sparse(data, ours, make):
    # torch's sparse optimizers are lazy too: untouched rows and their state do not move
    w0, grads, _, some = data
    np.testing.assert_allclose(_run_ours(ours, w0, grads, some), _run_torch(make, w0, grads, some, True),
                               rtol=1e-5, atol=1e-6)


def test_lazy_momentum_leaves_untouched_rows(data):
    w0, grads, _, some = data
    w = _run_ours(SGD(lr=0.1, momentum=0.9), w0, grads, [some[0]] + [np.array([], np.int64)] * 3)
    untouched = np.setdiff1d(np.arange(ROWS), some[0])
    np.testing.assert_array_equal(w[untouched], w0[untouched])


def test_rowwise_adagrad_fbgemm_formula(data):
    w0, grads, _, some = data
    w, acc = w0.astype(np.float64).copy(), np.zeros(ROWS)
    for g, rows in zip(grads, some):
        acc[rows] += (g[rows].astype(np.float64) ** 2).mean(axis=1)
        w[rows] -= 0.1 * g[rows] / (np.sqrt(acc[rows])[:, None] + 1e-10)
    np.testing.assert_allclose(_run_ours(Adagrad(lr=0.1, rowwise=True), w0, grads, some), w, rtol=1e-5, atol=1e-6)


def _ftrl_paper(w0, grads, touched, alpha, beta, l1, l2):
    """McMahan et al. 2013, Algorithm 1, per coordinate in float64; z starts where it gives back w0."""
    w = w0.astype(np.float64).copy()
    z, n = np.zeros_like(w), np.zeros_like(w)
    seen = np.zeros(ROWS, bool)
    for g, rows in zip(grads, touched):
        for r in rows:
            if not seen[r]:
                seen[r] = True
                for j in range(DIM):
                    sign = math.copysign(1.0, w[r, j]) if w[r, j] else 0.0
                    z[r, j] = -w[r, j] * ((beta + math.sqrt(n[r, j])) / alpha + l2) - sign * l1
            for j in range(DIM):
                gi = float(g[r, j])
                sigma = (math.sqrt(n[r, j] + gi * gi) - math.sqrt(n[r, j])) / alpha
                z[r, j] += gi - sigma * w[r, j]
                n[r, j] += gi * gi
                if abs(z[r, j]) <= l1:
                    w[r, j] = 0.0
                else:
                    w[r, j] = -(z[r, j] - math.copysign(l1, z[r, j])) / ((beta + math.sqrt(n[r, j])) / alpha + l2)
    return w


@pytest.mark.parametrize("l1,l2,zero_start", [(0.0, 0.0, True), (0.5, 0.1, True), (0.0, 0.0, False),
                                               (0.3, 1.0, False)])
def test_ftrl_matches_the_papers_algorithm(data, l1, l2, zero_start):
    w0, grads, _, some = data
    w0 = np.zeros_like(w0) if zero_start else w0
    got = _run_ours(FTRL(lr=0.1, beta=1.0, l1=l1, l2=l2), w0, grads, some)
    want = _ftrl_paper(w0, grads, some, 0.1, 1.0, l1, l2)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if l1 and zero_start:
        assert (got == 0).any()                             # L1 makes exact zeros
    untouched = np.setdiff1d(np.arange(ROWS), np.concatenate(some))
    np.testing.assert_array_equal(got[untouched], w0[untouched])


def test_ftrl_starts_rows_where_their_initialiser_put_them(data):
    # a tiny gradient moves a row a little, not to ~0 as FTRL from zero weights would
    w0, grads, every, _ = data
    got = _run_ours(FTRL(lr=0.1), w0, [g * 1e-4 for g in grads[:1]], every[:1])
    assert np.abs(got - w0).max() < 1e-3


def test_clip_norm_per_row(data):
    w0, grads, every, _ = data
    g = [x * 100 for x in grads[:1]]
    w = _run_ours(SGD(lr=1.0, clip_norm=0.5), w0, g, every[:1])
    step = np.linalg.norm(w0 - w, axis=1)
    np.testing.assert_allclose(step, 0.5, rtol=1e-5)


@pytest.mark.parametrize("sched,expected", [
    (LRSchedule(), [1, 1, 1, 1]),
    (LRSchedule(warmup_steps=4), [0.25, 0.5, 0.75, 1.0]),
    (LRSchedule(kind="step", step_size=2, gamma=0.5), [1, 1, 0.5, 0.5]),
    (LRSchedule(kind="cosine", total_steps=4), [1, 0.5 + 0.5 * math.cos(math.pi / 4), 0.5,
                                                0.5 + 0.5 * math.cos(3 * math.pi / 4)]),
])
def test_schedules(sched, expected):
    np.testing.assert_allclose([sched.factor(s) for s in range(4)], expected, rtol=1e-9)


def test_plain_sgd_is_stateless_others_are_not():
    assert not SGD(lr=0.1).stateful
    assert SGD(lr=0.1, momentum=0.9).stateful and SGD(lr=0.1, weight_decay=1e-4).stateful
    assert SGD(lr=0.1, schedule=LRSchedule(kind="cosine", total_steps=10)).stateful
    assert Adagrad().stateful and Adam().stateful


@pytest.mark.parametrize("name,kw,msg", [
    ("sgd", {"lr": -1}, "lr must be"),
    ("adam", {"betas": (1.0, 0.9)}, "betas"),
    ("nope", {}, "unknown sparse optimizer 'nope'"),
    ("sgd", {"momentum": 1.5}, "momentum"),
    ("adagrad", {"eps": 0}, "eps"),
    ("ftrl", {"beta": 0.0}, "divide by 0"),
    ("ftrl", {"l1": -1}, "l1"),
])
def test_bad_hyperparameters(name, kw, msg):
    with pytest.raises(ValueError, match=msg):
        make_optimizer(name, **kw)


def test_make_optimizer_names():
    assert make_optimizer("rowwise_adagrad", lr=0.1).rowwise
    assert make_optimizer("momentum", lr=0.1).momentum == 0.9
