"""Names and values that the config, the role split, the tables and the trainer agree on.
Pure: imports no MPI, so ``hpcps.config`` validates with it before MPI starts. Local."""

__all__ = ["F32_MAX", "parse_mode", "TRANSPORTS", "ROW_DTYPES", "RMA_READS", "WAIT_POLICIES", "THREAD_LEVELS",
           "SHARDINGS", "MAILBOX_BYTES", "MIN_SLOT_ROWS", "MAILBOX_HEAD", "mailbox_slot_rows", "mailbox_slot_bytes"]

TRANSPORTS = ("auto", "rma")        # auto: shared memory on the node, RMA across nodes; rma: RMA everywhere
ROW_DTYPES = ("float32", "bfloat16", "float16")     # what rows (pull_dtype) and gradients (push_dtype) travel as
RMA_READS = ("auto", "get_accumulate", "get", "messages")   # how a remote pull reads (get: faster, not atomic per
                                                            # element; messages: two-sided, hpcps.sparse.pull_server)
WAIT_POLICIES = ("auto", "yield", "sleep")          # how a waiting rank waits (hpcps.core.wait)
THREAD_LEVELS = ("single", "funneled", "serialized", "multiple")    # MPI thread level asked for at start
SHARDINGS = ("modulo", "range")                     # row placements by name (hpcps.core.sharding)
F32_MAX = 3.4028234663852886e38                     # the largest float32: rows, lrs and updates stay below it
MAILBOX_BYTES = 64 << 20    # push mailboxes (hpcps.sparse.mailbox), per table and PS: every slot together at most this
MIN_SLOT_ROWS = 256         # a slot of fewer rows than this (and than the shard) is not made
MAILBOX_HEAD = 32           # a slot's header: [seq, rows, taken, 0] (int64)


def parse_mode(mode: str) -> tuple[str, int]:
    """A consistency mode ``"sync" | "async" | "ssp:S"`` as ``(kind, S)``; ``ValueError`` otherwise. Local."""
    if mode in ("sync", "async"):
        return mode, 0
    if isinstance(mode, str) and mode.startswith("ssp:"):
        s = mode[4:]
        if s.isdigit():
            return "ssp", int(s)
    raise ValueError(f"mode must be 'sync', 'async' or 'ssp:S' with an integer S >= 0, got {mode!r}")


def mailbox_slot_rows(shard_rows: int, slots: int, row_bytes: int, budget: int = MAILBOX_BYTES,
                      min_rows: int = MIN_SLOT_ROWS, ordered: bool = False) -> int:
    """Rows of each of a PS's ``slots`` push-mailbox slots for one stateful table (one slot per
    worker on another node; with ``ordered``, deterministic sync, one per worker), every slot
    together within ``budget`` bytes (``row_bytes``: an id and a gradient row). 0: no mailbox,
    where the shard is empty or, unless ``ordered`` (then pushes go in pieces of at least a row),
    a slot would hold fewer than ``min_rows`` rows and than the shard (pushes then take the shard
    lock). What :class:`hpcps.sparse.mailbox.Mailbox` makes and ``hpcps plan`` counts. Local, pure."""
    shard_rows = int(shard_rows)
    if slots <= 0 or shard_rows <= 0:
        return 0
    cap = min(shard_rows, budget // (slots * row_bytes))
    if ordered:
        return max(cap, 1)
    return 0 if cap < min(min_rows, shard_rows) else cap


def mailbox_slot_bytes(rows: int, dim: int, esize: int = 4) -> int:
    """Bytes of one mailbox slot of ``rows`` rows: the header, the int64 ids, the gradients
    (``esize`` bytes each, padded to 8). Local, pure."""
    return MAILBOX_HEAD + 8 * rows + -(-rows * dim * esize // 8) * 8
