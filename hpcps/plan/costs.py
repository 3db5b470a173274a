"""Per-row and per-sample costs timed on this machine, one CPU: what the planner scales to a
cluster whose cores it assumes as fast as these. Local."""

import os
import tempfile
import time
from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["Costs", "measure"]


@dataclass(frozen=True)
class Costs:
    gather_s_per_byte: float     # a worker's gather of rows from a shard in its node's memory
    apply_s_per_row: float       # a PS's optimizer apply of one row (the config's optimizer and dim)
    write_bytes_s: float         # HDF5 write of one process to this machine's disk
    read_bytes_s: float          # and its read back
    dense_s_per_sample: float    # forward, backward and the dense optimizer's step, one thread, at the
    #                              config's batch (at most 1024)
    draw_s_per_sample: float = 0.0   # drawing a training batch from the data source, one thread (a worker
    #                              without a loader process draws its own, in the step)
    spread: float = 0.0          # the largest (median / fastest - 1) of the CPU timings: how busy the machine was

    def to_dict(self) -> dict:
        return asdict(self)


SPREADS: list = []     # (median / fastest - 1) of each timing of the running measure()


def _best(fn, repeat: int = 5, most: int = 40, stable: float = 0.05, clock=time.thread_time) -> float:
    """The fastest of at least ``repeat`` timed calls (the least disturbed by a busy machine), more
    until the fastest of the later half is within ``stable`` of the fastest overall (at most
    ``most`` calls, or 10 s); the spread (median / fastest - 1) goes to :data:`SPREADS`. ``clock``:
    this thread's CPU time for work on one thread (the time other processes hold the CPU is not
    counted: a dense step of ~1 s on a loaded node is preempted however often it is repeated), the
    wall clock for what waits on a disk."""
    fn()                             # untimed: first touches of its memory, the kernels' first calls
    out, t_end = [], time.perf_counter() + 10.0
    while len(out) < most:
        t = clock()
        fn()
        out.append(clock() - t)
        if len(out) >= repeat and (min(out[len(out) // 2:]) <= (1 + stable) * min(out) or time.perf_counter() > t_end):
            break
    SPREADS.append(float(np.median(out)) / min(out) - 1)
    return min(out)


def _gather(dim: int, rows: int = 1 << 20, batch: int = 4096) -> float:
    table = np.random.default_rng(0).random((rows, dim), dtype=np.float32)
    ids = np.random.default_rng(1).integers(0, rows, batch)
    return _best(lambda: table.take(ids, axis=0), 20) / (batch * dim * 4)


def _apply(cfg, dim: int, rows: int = 1 << 20, batch: int = 4096) -> float:
    import torch

    from ..core.optimizers import new_state
    from ..train.tables import part_optimizer
    opt = part_optimizer(cfg, "deep", 10)
    w = torch.zeros((rows, dim))
    state = {k: torch.from_numpy(v) for k, v in new_state(opt, rows, dim).items()}
    ids = torch.from_numpy(np.unique(np.random.default_rng(2).integers(0, rows, batch)))
    g = torch.full((ids.numel(), dim), 1e-3)
    step = iter(range(1, 1 << 20))
    # 300 calls of ~2 ms at least, over many of the scheduler's slices: the fastest is one where no
    # other process was using the memory bandwidth (a memory-bound apply slows 2-4x then)
    return _best(lambda: opt.apply(w, state, ids, g, next(step), 1), 300, most=400) / ids.numel()


def _hdf5(nbytes: int = 64 << 20) -> tuple[float, float]:
    import h5py
    a = np.random.default_rng(3).random(nbytes // 4, dtype=np.float32)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "x.h5")

        def write():
            with h5py.File(path, "w") as f:
                f.create_dataset("rows", data=a)
                f.flush()
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)

        def read():
            with h5py.File(path, "r") as f:
                f["rows"][...]
        w = _best(write, 3, clock=time.perf_counter)
        r = _best(read, 3, clock=time.perf_counter)
    return nbytes / w, nbytes / r


def _dense(cfg, batch: int) -> float:
    """Forward, backward and the dense optimizer's step of a stand-in model, per sample (on the one
    thread :func:`measure` sets)."""
    import torch

    from ..train.build import dense_optimizer
    from .workload import standin_model, table_rows
    rows, _ = table_rows(cfg)
    model, _ = standin_model(cfg, 64)
    opt = dense_optimizer(cfg.optimizer.dense, model.parameters())
    dense = torch.randn(batch, cfg.data.num_dense)
    sparse = [torch.randint(0, 64, (batch,)) for _ in rows]
    y = torch.randint(0, 2, (batch,)).float()

    def step():
        opt.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(model(dense, sparse), y).backward()
        opt.step()
    for _ in range(3):           # the allocator's and the kernels' first calls are slower
        step()
    return _best(step, 7) / batch


def _draw(cfg) -> float:
    """A worker's drawing of its batch (every sample of ``cfg``'s batch: one worker), per sample."""
    from ..data import make_data
    src = make_data(cfg.data, cfg.job.seed, 1, 0)
    steps = iter(range(1 << 30))
    src.train_batch(next(steps))             # builds the id distributions once
    return _best(lambda: src.train_batch(next(steps)), 5) / cfg.data.batch_size


def measure(cfg) -> Costs:
    """Time the costs for ``cfg`` (its optimizer, dim and model) here, on one thread as the help
    says (torch's threads would time this machine's cores, not one): ~5-30 s. ``spread``: the
    largest timing's median over its fastest, less 1. Local."""
    import torch
    dim = cfg.model.dim
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        write, read = _hdf5()
        SPREADS.clear()              # the CPU timings' spread: a disk's fsync varies whatever the load
        # the dense part at the config's batch, up to 1024 (a worker's share; per sample, larger batches cost less)
        timed = (_gather(dim), _apply(cfg, dim), write, read, _dense(cfg, max(16, min(cfg.data.batch_size, 1024))),
                 _draw(cfg))
    finally:
        torch.set_num_threads(threads)
    return Costs(*timed, spread=round(max(SPREADS, default=0.0), 3))
