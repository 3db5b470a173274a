"""torch for the tables' applies, imported on first use (a program of tables that never applies,
and a PS of plain SGD tables, never pays its import), with the thread count this process set
(:func:`set_threads`: a PS applies scattered rows a step at a time on one thread; more, spun idle
on a busy node, made its adds 3x as long across pretend hosts sharing CPUs). Local."""

import sys

__all__ = ["torch_module", "set_threads"]

_threads = 0


def torch_module():
    """torch, imported now if it was not; with :func:`set_threads`'s count. Local."""
    fresh = "torch" not in sys.modules
    import torch
    if fresh and _threads:
        torch.set_num_threads(_threads)
    return torch


def set_threads(n: int) -> None:
    """torch's intra-op threads in this process: now if torch is imported, else when it is. Local."""
    global _threads
    _threads = n
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(n)
