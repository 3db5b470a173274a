"""DenseSync: keep a replicated torch module in step across the worker ranks.

Gradient hooks fill fixed-size buckets (parameters in reverse registration
order, roughly the order backward produces them); a full bucket starts a
non-blocking all-reduce at once, so communication overlaps the rest of
backward. ``synchronize()`` completes the remaining buckets and writes the
averaged gradients back. Initial parameters and buffers are broadcast from
worker 0. With one worker nothing is copied or reduced: ``synchronize()`` only
gives unused parameters a zero gradient, as it does with more workers.
"""

import time

import torch

from .backends import make_backend

__all__ = ["DenseSync"]


class _Bucket:
    def __init__(self, params, device, dtype):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.flat = torch.zeros(self.numel, device=device, dtype=dtype)
        self.ready = set()
        self.work = None


class DenseSync(torch.nn.Module):
    """Wrap ``module`` (on worker ranks). Collective over ``comm`` (the worker communicator).

    backend: ``"auto"`` (NCCL for CUDA modules; for CPU ones shared memory when every worker is
    on one node, else MPI), ``"shm"``, ``"mpi"`` or ``"nccl"`` (``hpcps.dense.backends``).
    bucket_mb: bucket size in MiB. nccl_host: the address worker 0 offers for the NCCL
    bootstrap (``nccl`` only). Call ``synchronize()`` after ``backward()``
    and before ``optimizer.step()``: gradients are then the average over workers.
    """

    def __init__(self, module: torch.nn.Module, comm, backend: str = "auto", bucket_mb: float = 4.0,
                 nccl_host: str | None = None):
        super().__init__()
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        self.module = module
        params = [p for p in module.parameters() if p.requires_grad]
        device = params[0].device if params else torch.device("cpu")
        self.size = comm.Get_size()
        self._buckets = []
        limit = int(bucket_mb * 2 ** 20)
        current, nbytes = [], 0
        for p in reversed(params):
            if current and (nbytes + p.numel() * p.element_size() > limit or p.dtype != current[0].dtype):
                self._buckets.append(_Bucket(current, device, current[0].dtype))
                current, nbytes = [], 0
            current.append(p)
            nbytes += p.numel() * p.element_size()
        if current:
            self._buckets.append(_Bucket(current, device, current[0].dtype))
        nbytes = sum(b.flat.numel() * b.flat.element_size() for b in self._buckets)
        self.backend = make_backend(backend, comm, device, nbytes=nbytes, nccl_host=nccl_host)
        # one worker: its gradients are the average already, so nothing is ever all-reduced
        self._solo = self.size == 1
        self.backend.prepare([] if self._solo else [b.flat for b in self._buckets])
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                self.backend.broadcast(t, root=0)
        self._bucket_of = {}
        for b in self._buckets:
            for p in b.params:
                self._bucket_of[p] = b
                if not self._solo:
                    p.register_post_accumulate_grad_hook(self._on_grad)
        self._next = 0                              # first bucket not yet started this step
        self.stats = {"allreduce_calls": 0, "bytes": 0, "wait_seconds": 0.0, "overlapped": 0}

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _start(self, b: _Bucket) -> None:
        off = 0
        with torch.no_grad():
            for p in b.params:
                n = p.numel()
                if p.grad is None:
                    b.flat[off:off + n].zero_()
                else:
                    b.flat[off:off + n].copy_(p.grad.reshape(-1))
                off += n
        b.work = self.backend.allreduce_async(b.flat)
        self.stats["allreduce_calls"] += 1
        self.stats["bytes"] += b.flat.numel() * b.flat.element_size()

    def _on_grad(self, p) -> None:
        b = self._bucket_of[p]
        b.ready.add(p)
        # Collectives must start in the same order on every worker: start buckets
        # strictly in index order, each once all its gradients are in.
        while self._next < len(self._buckets):
            nxt = self._buckets[self._next]
            if len(nxt.ready) < len(nxt.params):
                break
            self._start(nxt)
            self._next += 1
        for other in self._buckets[:self._next]:    # drive progress of started buckets
            other.work.test()

    def synchronize(self) -> None:
        """Finish every bucket and set each gradient to the average over workers. Local to the
        call site but pairs with the same call on every worker (collective over ``comm``)."""
        t0 = time.perf_counter()
        if self._solo:
            for b in self._buckets:
                for p in b.params:
                    if p.grad is None:               # unused this step: a zero gradient, as with more workers
                        p.grad = torch.zeros_like(p)
            self.stats["wait_seconds"] += time.perf_counter() - t0
            return
        self.stats["overlapped"] += self._next
        for b in self._buckets[self._next:]:        # not started in backward (unused params: zeros)
            self._start(b)
        self._next = 0
        for b in self._buckets:
            b.work.wait()
            off = 0
            with torch.no_grad():
                b.flat.div_(self.size)
                for p in b.params:
                    n = p.numel()
                    if p.grad is None:
                        p.grad = torch.empty_like(p)
                    p.grad.copy_(b.flat[off:off + n].view_as(p))
                    off += n
            b.work = None
            b.ready.clear()
        self.stats["wait_seconds"] += time.perf_counter() - t0

    def close(self) -> None:
        """Release the backend (NCCL process group, shared-memory window). Collective over ``comm``."""
        self.backend.close()
