"""Names and values that the config, the role split, the tables and the trainer agree on.
Pure: imports no MPI, so ``hpcps.config`` validates with it before MPI starts. Local."""

__all__ = ["F32_MAX", "parse_mode", "TRANSPORTS", "ROW_DTYPES", "RMA_READS", "WAIT_POLICIES", "THREAD_LEVELS",
           "SHARDINGS"]

TRANSPORTS = ("auto", "rma")        # auto: shared memory on the node, RMA across nodes; rma: RMA everywhere
ROW_DTYPES = ("float32", "bfloat16", "float16")     # what rows (pull_dtype) and gradients (push_dtype) travel as
RMA_READS = ("auto", "get_accumulate", "get")       # how a remote pull reads (get: faster, not atomic per element)
WAIT_POLICIES = ("auto", "yield", "sleep")          # how a waiting rank waits (hpcps.core.wait)
THREAD_LEVELS = ("single", "funneled", "serialized", "multiple")    # MPI thread level asked for at start
SHARDINGS = ("modulo", "range")                     # row placements by name (hpcps.core.sharding)
F32_MAX = 3.4028234663852886e38                     # the largest float32: rows, lrs and updates stay below it


def parse_mode(mode: str) -> tuple[str, int]:
    """A consistency mode ``"sync" | "async" | "ssp:S"`` as ``(kind, S)``; ``ValueError`` otherwise. Local."""
    if mode in ("sync", "async"):
        return mode, 0
    if isinstance(mode, str) and mode.startswith("ssp:"):
        s = mode[4:]
        if s.isdigit():
            return "ssp", int(s)
    raise ValueError(f"mode must be 'sync', 'async' or 'ssp:S' with an integer S >= 0, got {mode!r}")
