"""The training driver behind ``hpcps train``: ``driver`` (the job), ``tables`` (steps, tables and
memory from the config; no torch: a PS rank runs from it), ``build`` (a worker's model and dense
optimizer), ``worker`` (the worker's loop), ``evaluation`` (loss, eval, export), ``recovery``
(checkpoint triggers and resume), ``telemetry`` (what a worker measures). The names below are
imported on first use: importing ``hpcps.train`` imports no torch."""

import importlib

_LAZY = {"train": "driver", "total_steps": "tables", "table_specs": "tables", "table_parts": "tables",
         "fused_tables": "tables", "FUSED_TABLE": "tables", "make_tables": "tables", "dense_optimizer": "build",
         "dense_schedule": "build", "build_model": "build", "evaluate": "evaluation", "export_weights": "evaluation",
         "step_loss": "evaluation", "EXIT_CHECKPOINTED": "..runtime.stopping"}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        module = _LAZY[name]
        return getattr(importlib.import_module(module if module.startswith(".") else f".{module}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
