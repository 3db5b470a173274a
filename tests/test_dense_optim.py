"""The dense optimizer: torch's fused kernels without torch.optim's wrappers (hpcps/dense/optim.py)."""

import copy
import subprocess
import sys

import pytest
import torch

from hpcps.dense.optim import FusedOptimizer, make_dense_optimizer

CASES = [("sgd", torch.optim.SGD, dict(lr=0.1, momentum=0.0, weight_decay=0.0)),
         ("sgd", torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
         ("adagrad", torch.optim.Adagrad, dict(lr=0.1, weight_decay=0.01, eps=1e-10)),
         ("adam", torch.optim.Adam, dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01))]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 1))


@pytest.mark.parametrize("kind,cls,hyper", CASES, ids=["sgd", "momentum", "adagrad", "adam"])
def test_same_bits_as_torch_optim_fused_and_state_dicts_swap(kind, cls, hyper):
    a, b = _model(), _model()
    ours, theirs = FusedOptimizer(kind, a.parameters(), **hyper), cls(b.parameters(), fused=True, **hyper)
    x = torch.randn(64, 5)
    for step in range(6):
        for model, opt in ((a, ours), (b, theirs)):
            opt.zero_grad(set_to_none=step % 2 == 0)
            model(x).pow(2).mean().backward()
            opt.step()
        if step == 2:                   # a checkpoint written by either loads into the other
            mine, other = copy.deepcopy(ours.state_dict()), copy.deepcopy(theirs.state_dict())
            assert sorted(mine["param_groups"][0]) == sorted(other["param_groups"][0])
            assert {k: sorted(v) for k, v in mine["state"].items()} == {k: sorted(v) for k, v in other["state"].items()}
            ours.load_state_dict(other)
            theirs.load_state_dict(mine)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    assert any(not torch.equal(p, q) for p, q in zip(a.parameters(), _model().parameters()))     # it moved


@pytest.mark.parametrize("kind,cls,hyper", CASES, ids=["sgd", "momentum", "adagrad", "adam"])
def test_param_groups_of_their_own_lr_as_torch_optim_and_state_dicts_swap(kind, cls, hyper):
    # optimizer.dense.linear_lr: the first layer's parameters at 10x the rate, in a group of their own
    def groups(m):
        return [{"params": list(m[0].parameters()), "lr": hyper["lr"] * 10}, {"params": list(m[2].parameters())}]
    a, b = _model(), _model()
    ours, theirs = FusedOptimizer(kind, groups(a), **hyper), cls(groups(b), fused=True, **hyper)
    x = torch.randn(64, 5)
    for step in range(4):
        for model, opt in ((a, ours), (b, theirs)):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        if step == 1:
            mine, other = copy.deepcopy(ours.state_dict()), copy.deepcopy(theirs.state_dict())
            assert [g["params"] for g in mine["param_groups"]] == [g["params"] for g in other["param_groups"]]
            assert [g["lr"] for g in mine["param_groups"]] == [hyper["lr"] * 10, hyper["lr"]]
            ours.load_state_dict(other)
            theirs.load_state_dict(mine)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    one = FusedOptimizer(kind, _model().parameters(), **hyper)
    with pytest.raises(ValueError, match="in 1 group.s.; this model has 4 in 2"):
        ours.load_state_dict(one.state_dict())


def test_a_mismatched_state_is_refused_and_other_dtypes_get_torch_optim():
    opt = FusedOptimizer("sgd", _model().parameters(), lr=0.1, momentum=0.9, weight_decay=0.0)
    small = FusedOptimizer("sgd", [torch.zeros(3, requires_grad=True)], lr=0.1, momentum=0.9, weight_decay=0.0)
    with pytest.raises(ValueError, match="holds 1 parameter.s. in 1 group.s.; this model has 4 in 1"):
        opt.load_state_dict(small.state_dict())
    half = [torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)]
    assert isinstance(make_dense_optimizer("adam", half, lr=0.1, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0),
                      torch.optim.Adam)
    with pytest.raises(ValueError, match="kind must be one of"):
        FusedOptimizer("lamb", half)


def test_a_worker_never_imports_torch_dynamo():
    # torch.optim's wrappers import torch._dynamo (~1 s of a process's start): made and stepped here,
    # ours does not
    code = ("import sys, torch; from hpcps.train.build import dense_optimizer; from hpcps.config import load_config;"
            "m = torch.nn.Linear(3, 1); o = dense_optimizer(load_config(None, ['optimizer.dense.name=adam'], environ={})"
            ".optimizer.dense, m.parameters()); m(torch.ones(2, 3)).sum().backward(); o.step(); o.state_dict();"
            "print('torch._dynamo' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr
