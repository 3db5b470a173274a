"""DenseSync (the dense all-reduce, every backend) under mpiexec (pytest-mpi), written once for any size."""

import pytest
import torch
from mpi4py import MPI

from hpcps.dense import DenseSync


def _net(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5),
                               torch.nn.ReLU(), torch.nn.Linear(5, 1))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("backend", ["mpi", "shm", "gloo"])
@pytest.mark.parametrize("bucket_mb", [1e-4, 4.0])          # many small buckets, or one
def test_dense_sync_equals_average(bucket_mb, backend):
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    net = _net(seed=100 + rank)                              # different on purpose
    ds = DenseSync(net, comm, backend=backend, bucket_mb=bucket_mb)
    assert ds.backend.name == backend
    w0 = comm.allgather([p.detach().clone() for p in net.parameters()])
    for mine, first in zip(w0[rank], w0[0]):
        assert torch.equal(mine, first)                      # broadcast from worker 0
    for step in range(5):                                    # buckets reset between steps; shm slots alternate
        x = torch.randn(16, 7, generator=torch.Generator().manual_seed(10 * step + rank))
        net.zero_grad()
        net(x).pow(2).mean().backward()
        local = [p.grad.clone() for p in net.parameters()]
        ds.synchronize()
        every = comm.allgather(local)
        for i, p in enumerate(net.parameters()):
            expected = sum(g[i] for g in every) / comm.Get_size()
            torch.testing.assert_close(p.grad, expected, rtol=1e-6, atol=1e-7)
        if backend == "shm":                                 # one order of summation: equal bits everywhere
            mine = [p.grad.clone() for p in net.parameters()]
            for other in comm.allgather(mine):
                assert all(torch.equal(a, b) for a, b in zip(mine, other))
    if bucket_mb < 1:
        assert len(ds._buckets) >= 3 and ds.stats["overlapped"] > 0   # started during backward
    ds.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("backend", ["mpi", "shm"])
def test_dense_sync_one_worker_leaves_gradients_alone(backend):
    # each rank alone (COMM_SELF): the average of one is the gradient itself, bit for bit, with
    # nothing copied or reduced; an unused parameter still gets a zero gradient
    net = torch.nn.ModuleDict({"used": torch.nn.Linear(3, 2), "unused": torch.nn.Linear(3, 1)})
    ds = DenseSync(net, MPI.COMM_SELF, backend=backend, bucket_mb=1e-5)
    for step in range(3):
        net.zero_grad(set_to_none=True)
        net["used"](torch.randn(4, 3, generator=torch.Generator().manual_seed(step))).pow(2).sum().backward()
        local = [p.grad.clone() for p in net["used"].parameters()]
        ds.synchronize()
        assert all(torch.equal(p.grad, g) for p, g in zip(net["used"].parameters(), local))
        assert all(p.grad is not None and torch.count_nonzero(p.grad) == 0 for p in net["unused"].parameters())
    assert ds.stats["allreduce_calls"] == 0 and ds.stats["bytes"] == 0
    ds.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("backend", ["mpi", "shm", "gloo"])
def test_dense_sync_unused_parameter_contributes_zero(backend):
    comm = MPI.COMM_WORLD
    net = torch.nn.ModuleDict({"used": torch.nn.Linear(3, 1), "unused": torch.nn.Linear(3, 1)})
    ds = DenseSync(net, comm, backend=backend, bucket_mb=1e-5)
    net["used"](torch.ones(2, 3)).sum().backward()
    ds.synchronize()
    assert torch.count_nonzero(net["unused"].weight.grad) == 0
    torch.testing.assert_close(net["used"].weight.grad, torch.full((1, 3), 2.0))
    ds.close()


@pytest.mark.mpi(min_size=1)
def test_dense_backend_auto_on_one_node_is_shared_memory():
    """Every rank of this suite runs on one node: ``auto`` picks the shared-memory all-reduce for
    CPU modules, unless its 2 x workers copies of the buckets would exceed SHM_MAX_BYTES."""
    from hpcps.dense import backends
    comm = MPI.COMM_WORLD
    ds = DenseSync(_net(seed=1), comm, backend="auto")
    assert ds.backend.name == "shm"
    ds.close()
    big = backends.make_backend("auto", comm, "cpu", nbytes=backends.SHM_MAX_BYTES)
    assert big.name == "mpi"
    with pytest.raises(ValueError, match="not given to prepare"):
        small = backends.make_backend("shm", comm, "cpu")
        small.prepare([])
        small.allreduce_async(torch.zeros(3))


@pytest.mark.mpi(min_size=1)
@pytest.mark.skipif(torch.cuda.device_count() < 1 or MPI.COMM_WORLD.Get_size() > torch.cuda.device_count(),
                    reason="NCCL needs one GPU per rank (run scripts/gpu_check.sh on a GPU node)")
def test_dense_sync_nccl_equals_average():
    comm = MPI.COMM_WORLD
    torch.cuda.set_device(comm.Get_rank() % torch.cuda.device_count())
    net = _net(seed=comm.Get_rank()).cuda()
    ds = DenseSync(net, comm, backend="auto", bucket_mb=1e-3)
    assert ds.backend.name == "nccl"
    net(torch.ones(4, 7, device="cuda")).sum().backward()
    local = [p.grad.cpu() for p in net.parameters()]
    ds.synchronize()
    every = comm.allgather(local)
    for i, p in enumerate(net.parameters()):
        torch.testing.assert_close(p.grad.cpu(), sum(g[i] for g in every) / comm.Get_size())
    ds.close()
