"""Keep the workers' heap from fragmenting step after step.

A training step allocates and frees torch tensors of a few hundred KB (the activations, the
pulled rows, their gradients). torch allocates them 64-byte aligned (``posix_memalign``), and
glibc cuts the few bytes before and after each aligned block off as tiny free chunks. Its
per-thread cache (tcache, up to 7 chunks of each small size) keeps such chunks "in use" as far
as merging goes, so a freed block could not grow back to the size the next aligned request asks
for (a little more than the block: the alignment's slack), and glibc took new memory from the top
of the heap instead. A worker of the main job at 1 PS + 1 worker grew ~0.8 MB per step (2.6 GB
after 3000 steps) and touched ~200 fresh pages per step, ~2 us each on the development VM:
about 0.4 ms of a ~3 ms step. The single process of the benchmarks, whose own small allocations
keep the cache drained, does not grow. With the cache off (glibc's tunable
``glibc.malloc.tcache_count=0``) the same worker takes no new pages and stays at ~380 MB.

glibc reads tunables only when a process starts. So ``hpcps train`` (``hpcps train ...``,
``python -m hpcps train ...``, ``python -m mpi4py -m hpcps train ...``) starts itself once more with the
tunable added to ``GLIBC_TUNABLES``, before MPI is initialised (:func:`restart_without_tcache`,
called by :func:`hpcps.core.process.prepare_process` where the command starts). A program of
your own that imports hpcps keeps its allocator unless it calls ``prepare_process`` first; or launch
it with ``GLIBC_TUNABLES=glibc.malloc.tcache_count=0`` (``mpiexec -genv`` / ``-x`` / ``srun
--export``); without it, the workers return the heap's free pages every ``TRIM_EVERY`` steps
(``malloc_trim(0)`` from :meth:`hpcps.Context.step_end`, 6-10 ms a trim), which keeps the
resident size near flat but not the pages fresh.

An earlier fix pinned glibc's mmap threshold at 128 KiB instead: every block from 128 KiB up
then got its own fresh mapping, and a worker ran its torch operators ~1.5x slower.

A freed block's pages: glibc returns the top of its heap to the system once more than
``M_TRIM_THRESHOLD`` is free there, and gives blocks from ``M_MMAP_THRESHOLD`` up a mapping of
their own. Both limits start at 128 KiB and rise only when a large mapped block is freed, so a
fresh program that pulled 4096 x 64 rows (a 1 MB result) got the result's pages new from the
kernel on every other pull, one fault per 4 KB page: a 1M-row pull at 0.18-0.20x a local numpy
gather, 0.13-0.16 ms a pull against 0.6 ms, until some larger block happened to raise the limits.
:func:`keep_pages` (from :func:`hpcps.core.process.prepare_process` and :func:`hpcps.init`) fixes
them at ``MMAP_THRESHOLD`` (glibc's own ceiling for the moving limit) and ``TRIM_THRESHOLD``: a
process then keeps up to that much free memory at the heap's top.

``job.malloc_tune = false`` (``HPCPS_MALLOC_TUNE=0``) leaves the allocator alone (no restart, no
trim, limits left moving). Local.
"""

import ctypes
import mmap
import os
import platform
import sys

import numpy as np

__all__ = ["TRIM_EVERY", "TUNABLE", "mode", "restart_without_tcache", "trim_heap", "tunables_with_tcache_off",
           "wants_restart", "set_tuning", "populated", "keep_pages", "MMAP_THRESHOLD", "TRIM_THRESHOLD",
           "map_pages"]

TRIM_EVERY = 100        # steps between two trims of a worker's heap, where the tcache is on
MMAP_THRESHOLD = 32 << 20   # blocks below it come from the heap (glibc's ceiling for its moving limit)
TRIM_THRESHOLD = 128 << 20  # free memory kept at the heap's top
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3   # mallopt's parameter numbers (malloc.h)
TUNABLE = "glibc.malloc.tcache_count=0"
_MARK = "HPCPS_MALLOC_RESTARTED"        # set in the restarted process: never restart twice

_libc = None
_tune = None            # set_tuning(); None: $HPCPS_MALLOC_TUNE (default on)


def set_tuning(on: bool) -> None:
    """Turn the restart and the trim on or off for this process (config key ``job.malloc_tune``). Local."""
    global _tune, _libc
    _tune, _libc = bool(on), None


def _enabled(environ=os.environ) -> bool:
    on = _tune if _tune is not None and environ is os.environ else environ.get("HPCPS_MALLOC_TUNE", "1") != "0"
    return on and platform.libc_ver()[0] == "glibc"


def _glibc():
    """glibc as a ctypes library, or False (another libc, or turned off)."""
    global _libc
    if _libc is None:
        _libc = False
        if _enabled():
            try:
                _libc = ctypes.CDLL("libc.so.6")
                _libc.malloc_trim.argtypes = [ctypes.c_size_t]
                _libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
            except (OSError, AttributeError):
                _libc = False
    return _libc


def tcache_off(environ=os.environ) -> bool:
    """Whether this process started with glibc's tcache off (``GLIBC_TUNABLES``). Local."""
    return any(t.strip() == TUNABLE for t in environ.get("GLIBC_TUNABLES", "").split(":"))


def tunables_with_tcache_off(environ=os.environ) -> str:
    """``environ``'s ``GLIBC_TUNABLES`` with the tcache's tunable added. Local."""
    return ":".join(t for t in (environ.get("GLIBC_TUNABLES", ""), TUNABLE) if t)


def mode() -> str:
    """How this process keeps its heap: ``"tcache_off"``, ``"trim"`` or ``"off"``. Local."""
    if not _enabled():
        return "off"
    return "tcache_off" if tcache_off() else "trim"


def _hpcps_args(argv):
    """The arguments of the ``hpcps`` command that ``argv`` (``sys.orig_argv``: the interpreter's own
    command line) runs, or None: ``-m hpcps ...``, ``-m mpi4py -m hpcps ...`` or the console script."""
    argv = list(argv)[1:]
    for i, a in enumerate(argv):
        if a == "-m":
            if argv[i + 1:i + 2] == ["hpcps"]:
                return argv[i + 2:]
            if argv[i + 1:i + 4] == ["mpi4py", "-m", "hpcps"]:
                return argv[i + 4:]
            return None
        if a == "-c":
            return None
        if not a.startswith("-"):
            return argv[i + 1:] if os.path.basename(a) == "hpcps" else None
    return None


def wants_restart(argv, environ, modules) -> bool:
    """Whether a process with command line ``argv``, environment ``environ`` and imported
    ``modules`` should start again with the tcache off: ``hpcps train`` on glibc, MPI not
    initialised yet, the tunable not set, not restarted already, not turned off. Local."""
    if not _enabled(environ) or _MARK in environ or tcache_off(environ) or "mpi4py.MPI" in modules:
        return False
    args = _hpcps_args(argv)
    return args is not None and "train" in args


def restart_without_tcache() -> None:
    """Replace this process by the same command with glibc's tcache off, where
    :func:`wants_restart` says so; else return. Local; before MPI is initialised."""
    argv = getattr(sys, "orig_argv", None)
    if not argv or not wants_restart(argv, os.environ, sys.modules):
        return
    env = dict(os.environ)
    env["GLIBC_TUNABLES"] = tunables_with_tcache_off(env)
    env[_MARK] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, argv, env)
    except OSError:             # could not start again: carry on with the trim
        pass


_kept = False


def keep_pages() -> bool:
    """Fix glibc's mmap and trim thresholds (module docstring), once per process, where the
    tuning is on and the libc is glibc. Local; True if they are set (now or before)."""
    global _kept
    libc = _glibc()
    if not libc:
        return False
    if not _kept:
        _kept = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                     and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _kept


def trim_heap() -> bool:
    """Return the heap's free pages to the system (``malloc_trim(0)``), where this process runs
    with the tcache on. Local; True if it ran."""
    libc = _glibc()
    if not libc or tcache_off():
        return False
    libc.malloc_trim(0)
    return True


_POPULATE_MIN = 16 << 20    # smaller arrays: np.empty (their faults cost little)


def populated(shape, dtype) -> np.ndarray:
    """A new array whose pages exist already: an anonymous mapping with ``MAP_POPULATE``, which
    the kernel fills in one go. A checkpoint's snapshot of a GB shard wrote into fresh pages one
    fault at a time at ~0.35 GB/s on the development VM; populated, ~1.9 GB/s (1 GB: 2.9 s against
    0.54 s, the fill included). Small arrays, or a system without ``MAP_POPULATE``: ``np.empty``.
    The mapping lives as long as the array. Local."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    flag = getattr(mmap, "MAP_POPULATE", 0)
    if nbytes < _POPULATE_MIN or not flag:
        return np.empty(shape, dtype)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | flag)
    return np.frombuffer(m, dtype).reshape(shape)


_MADV_POPULATE_READ = 22    # Linux 5.14 and newer (asm-generic/mman-common.h)
_MADV_POPULATE_WRITE = 23


def map_pages(a: np.ndarray, write: bool = False) -> bool:
    """Map the pages of ``a`` (a view of memory that exists already, such as another rank's shared
    window) into this process's page table now, with ``madvise(MADV_POPULATE_READ)``, so that its
    first reads do not fault page by page. A worker's first random pulls from a PS's 256 MB shard
    on its node faulted ~4400 times (the kernel maps 16 pages a fault): 83 ms for the first 40
    batches of 4096 rows, 28 ms once mapped; mapping it first took ~80 ms. Nothing is read or
    copied. ``write``: make the pages writable and present (``MADV_POPULATE_WRITE``): memory of this
    process's own about to be written whole, such as a PS's new shard before a restore (its pages
    then come in one go, not a fault at a time). Local; False where the kernel or libc cannot (the
    pages are then mapped as touched)."""
    libc = _libc_any()
    if libc is None or a.nbytes == 0:
        return False
    page = mmap.PAGESIZE
    start = a.ctypes.data // page * page
    advice = _MADV_POPULATE_WRITE if write else _MADV_POPULATE_READ
    return libc.madvise(ctypes.c_void_p(start), a.ctypes.data + a.nbytes - start, advice) == 0


_any_libc = None


def _libc_any():
    """The C library as ctypes (whatever the tuning), or None."""
    global _any_libc
    if _any_libc is None:
        try:
            _any_libc = ctypes.CDLL(None)
            _any_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError):
            _any_libc = False
    return _any_libc or None
