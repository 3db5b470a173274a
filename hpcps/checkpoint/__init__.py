"""HDF5 checkpoints: consistent cuts at step boundaries, atomic commit, restart with resharding."""

import os

os.environ.setdefault("HDF5_USE_FILE_LOCKING", "FALSE")   # Lustre/NFS locking errors; must precede h5py

from .coordinator import Checkpointer, sharding_names
from .restore import load_dense_model, restore_dense, restore_tables
from . import local
from .levels import find_local
from .readback import CorruptFile
from .store import list_checkpoints, newest_verified, read_manifest, resolve, verify

__all__ = ["Checkpointer", "restore_tables", "restore_dense", "load_dense_model", "sharding_names", "find_local", "CorruptFile", "list_checkpoints", "newest_verified",
           "read_manifest", "resolve", "verify"]
