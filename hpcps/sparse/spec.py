"""An embedding table's arguments: the checks that need no communication, and the agreement of
every rank on them (``EmbeddingTable`` calls both before it allocates anything)."""

import hashlib

import numpy as np

from ..core.ids import INITS, default_scale
from ..core.optimizers import SGD, SparseOptimizer
from ..core.settings import RMA_READS, ROW_DTYPES, TRANSPORTS
from ..core.wait import wait_request
from ..core.errors import RoleError

__all__ = ["check_segments", "check_init", "check_args", "agree"]


def check_segments(name: str, segments, num_rows: int):
    """``segments`` as a tuple of ``(name, rows)``, checked: distinct non-empty names, rows >= 1,
    summing to ``num_rows``; ``None`` stays ``None``. Local."""
    if segments is None:
        return None
    try:
        parts = tuple((n, r) for n, r in segments)
    except (TypeError, ValueError):
        raise ValueError(f"table {name!r}: segments must be [(name, rows), ...], got {segments!r}") from None
    for n, r in parts:
        if not isinstance(n, str) or not n or isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r < 1:
            raise ValueError(f"table {name!r}: each segment needs a non-empty name and rows >= 1, got {(n, r)!r}")
    if not parts or len({n for n, _ in parts}) != len(parts):
        raise ValueError(f"table {name!r}: segments need distinct names, got {[n for n, _ in parts]}")
    if sum(int(r) for _, r in parts) != num_rows:
        raise ValueError(f"table {name!r}: segments hold {sum(int(r) for _, r in parts)} rows, the table "
                         f"{num_rows}")
    return tuple((n, int(r)) for n, r in parts)


def check_init(name: str, init: str, init_scale, segments, dim: int) -> tuple:
    """The initialiser's kind and one scale per logical table (each segment, or the table):
    ``init_scale`` is None (``1/sqrt(dim)``), a number, or with segments a sequence of one number
    per segment. Local."""
    if init not in INITS:
        raise ValueError(f"table {name!r}: init must be one of {', '.join(INITS)}, got {init!r}")
    parts = len(segments) if segments else 1
    if init_scale is None:
        scales = (default_scale(dim),) * parts
    elif isinstance(init_scale, (int, float, np.integer, np.floating)) and not isinstance(init_scale, bool):
        scales = (float(init_scale),) * parts
    else:
        try:
            scales = tuple(float(x) for x in init_scale)
        except (TypeError, ValueError):
            raise ValueError(f"table {name!r}: init_scale must be a number or one per segment, "
                             f"got {init_scale!r}") from None
        if len(scales) != parts:
            raise ValueError(f"table {name!r}: init_scale has {len(scales)} values for {parts} segment(s)")
    if not all(np.isfinite(x) and x >= 0 for x in scales):
        raise ValueError(f"table {name!r}: init_scale must be finite and >= 0, got {init_scale!r}")
    return init, scales


def check_args(ctx, name, num_rows, dim, optimizer, transport, pull_dtype, push_dtype, rma_read):
    """The checks of :class:`EmbeddingTable` that need no communication; returns the optimizer,
    transport and remote read to use. Local."""
    ctx.check_open()
    if not isinstance(name, str) or not name:
        raise ValueError(f"table name must be a non-empty string, got {name!r}")
    for what, v in (("num_rows", num_rows), ("dim", dim)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"table {name!r}: {what} must be an integer >= 1, got {v!r}")
    if any(t.name == name for t in ctx.tables):
        raise ValueError(f"table {name!r} already exists in this context")
    optimizer = SGD() if optimizer is None else optimizer
    if not isinstance(optimizer, SparseOptimizer):
        raise ValueError(f"table {name!r}: optimizer must be an hpcps.optim optimizer, got {optimizer!r}")
    optimizer.check()
    transport = transport or ctx.transport
    if transport not in TRANSPORTS:
        raise ValueError(f"table {name!r}: transport must be 'auto' or 'rma', got {transport!r}")
    for what, v in (("pull_dtype", pull_dtype), ("push_dtype", push_dtype)):
        if v not in ROW_DTYPES:
            raise ValueError(f"table {name!r}: {what} must be one of {ROW_DTYPES}, got {v!r}")
    rma_read = rma_read or ctx.rma_read
    if rma_read == "auto":
        rma_read = ctx.resolve_rma_read(rma_read)
    if rma_read not in RMA_READS:
        raise ValueError(f"table {name!r}: rma_read must be one of {RMA_READS}, got {rma_read!r}")
    if rma_read == "messages" and ctx.pull_server is None:
        raise ValueError(f"table {name!r}: rma_read 'messages' needs a context made with rma_read = 'messages' "
                         f"(this one's is {ctx.rma_read!r}): its PS ranks serve pulls only then")
    return optimizer, transport, rma_read


def agree(ctx, name: str, spec: tuple) -> None:
    """Every rank of the world creates table ``name`` with the same ``spec``, or ``ValueError`` /
    ``RoleError`` on every rank that got here. Collective over the world, but never blocking for
    good: a rank that does not come (a table made on some ranks only, a PS already serving) ends
    in :class:`hpcps.core.errors.StalledError` within the progress timeout, and a worker first checks
    that no PS rank serves yet."""
    if ctx.is_worker:
        serving = ctx.control.ps_serving()
        if serving:
            raise RoleError(f"table {name!r}: PS world rank(s) {serving} called serve() already: create every "
                            f"table on every rank, PS ranks too, before the PS ranks call ctx.serve()")
    mine = np.frombuffer(hashlib.sha256(repr(spec).encode()).digest(), np.uint8)
    every = np.empty((ctx.world.Get_size(), mine.size), np.uint8)
    wait_request(ctx.world.Iallgather(mine, every),
                 f"table {name!r}: every rank to create it (a table made on some ranks only? create every table "
                 f"on every rank, PS ranks too, in the same order)")
    if (every != mine).any():                   # the same answer on every rank: all gather the specs
        specs = ctx.world.allgather(spec)
        ranks = [r for r, s in enumerate(specs) if s != specs[0]]
        raise ValueError(f"table {name!r} created differently on different ranks: world rank 0 has {specs[0]}, "
                         f"world rank(s) {ranks} have {specs[ranks[0]]}")
