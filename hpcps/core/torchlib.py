"""torch for the tables' applies, imported on first use: a program of tables that never applies
(and every test launch of one) does not pay its import. Local."""

__all__ = ["torch_module"]


def torch_module():
    """torch, imported now if it was not. Local."""
    import torch
    return torch
