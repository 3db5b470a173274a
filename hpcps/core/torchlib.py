"""torch for the tables' applies, imported on first use (a program of tables that never applies,
and a PS of plain SGD tables, never pays its import), with the thread count this process set
(:func:`set_threads`: a PS applies scattered rows a step at a time on one thread; more, spun idle
on a busy node, made its adds 3x as long across pretend hosts sharing CPUs). Local."""

import sys

__all__ = ["torch_module", "set_threads"]

_threads = 0
_applied = False


def torch_module():
    """torch, imported now if it was not (by this or any other path), with :func:`set_threads`'s
    count applied once. Every apply of a table takes torch from here. Local."""
    global _applied
    import torch
    if _threads and not _applied:
        torch.set_num_threads(_threads)
        _applied = True
    return torch


def set_threads(n: int) -> None:
    """torch's intra-op threads in this process: now if torch is imported, else at the first
    :func:`torch_module`. Local."""
    global _threads, _applied
    _threads, _applied = n, False
    if "torch" in sys.modules:
        torch_module()
