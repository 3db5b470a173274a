"""What a rank can see of its process and its node, cheaply (a few ``/proc`` reads and a
``statvfs``, ~0.1 ms): CPU use of the process and of the node, resident memory, the node's
memory, a directory's free space. Linux; elsewhere the figures it cannot read are NaN. Local."""

import math
import os
import time

__all__ = ["meminfo", "mem_available", "rss", "disk_free", "memory_limit", "CpuMeter"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_CGROUP = "/sys/fs/cgroup"      # cgroup v2: a Slurm job's --mem is its memory.max


def meminfo() -> dict:
    """``/proc/meminfo``'s fields in bytes (``MemTotal``, ``MemAvailable``, ...); {} where unknown. Local."""
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    out[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except (OSError, ValueError):
        return {}
    return out


def mem_available() -> int | None:
    """This node's available memory in bytes, or None where unknown. Local."""
    return meminfo().get("MemAvailable")


def rss() -> float:
    """This process's resident set now, in bytes (NaN where unknown). Local."""
    try:
        with open("/proc/self/statm") as f:
            return float(int(f.read().split()[1]) * _PAGE)
    except (OSError, ValueError, IndexError):
        return math.nan


def _cgroup_value(name: str) -> float:
    try:
        with open(f"{_CGROUP}/{name}") as f:
            text = f.read().strip()
        return math.nan if text == "max" else float(text)
    except (OSError, ValueError):
        return math.nan


def memory_limit() -> tuple[float, float]:
    """``(bytes in use, bytes there are)`` for this process's ranks on the node: the cgroup's
    ``memory.current`` and ``memory.max`` where a limit is set (Slurm's ``--mem``), else the node's
    ``MemTotal - MemAvailable`` and ``MemTotal``. NaN where unknown. Local."""
    limit = _cgroup_value("memory.max")
    if math.isfinite(limit):
        return _cgroup_value("memory.current"), limit
    info = meminfo()
    total, avail = info.get("MemTotal"), info.get("MemAvailable")
    if total is None or avail is None:
        return math.nan, math.nan
    return float(total - avail), float(total)


def disk_free(path: str) -> float:
    """Bytes free to this user in the filesystem of ``path`` (its nearest existing parent); NaN
    for an empty path or where unknown. Local."""
    if not path:
        return math.nan
    p = os.path.abspath(path)
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    try:
        st = os.statvfs(p)
    except OSError:
        return math.nan
    return float(st.f_bavail * st.f_frsize)


def _node_cpu_ticks() -> tuple[float, float]:
    """``(busy, total)`` clock ticks of every CPU of the node since boot (``/proc/stat``). Local."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return math.nan, math.nan
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)      # idle + iowait
    return sum(fields) - idle, sum(fields)


class CpuMeter:
    """CPU use since the previous :meth:`take`: this process's, in CPUs (1.0 = one CPU all the
    time), and the node's, as the busy share of all its CPUs. Local."""

    def __init__(self):
        self._t, self._proc = time.monotonic(), time.process_time()
        self._busy, self._total = _node_cpu_ticks()

    def take(self) -> tuple[float, float]:
        t, proc = time.monotonic(), time.process_time()
        busy, total = _node_cpu_ticks()
        wall = max(t - self._t, 1e-9)
        mine = (proc - self._proc) / wall
        node = (busy - self._busy) / (total - self._total) if total > self._total else math.nan
        self._t, self._proc, self._busy, self._total = t, proc, busy, total
        return mine, node
