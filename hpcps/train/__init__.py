"""The training driver behind ``hpcps train``: ``driver`` (the job), ``build`` (tables, model,
optimizers from the config), ``worker`` (the worker's loop), ``evaluation`` (loss, eval, export),
``recovery`` (checkpoint triggers and resume), ``telemetry`` (what a worker measures)."""

from ..runtime.stopping import EXIT_CHECKPOINTED
from .build import (FUSED_TABLE, build_model, dense_optimizer, dense_schedule, fused_tables, make_tables,
                    table_parts, table_specs, total_steps)
from .driver import train
from .evaluation import evaluate, export_weights, step_loss

__all__ = ["train", "total_steps", "table_specs", "table_parts", "fused_tables", "FUSED_TABLE", "dense_optimizer", "dense_schedule",
           "build_model", "make_tables", "evaluate", "export_weights", "step_loss", "EXIT_CHECKPOINTED"]
