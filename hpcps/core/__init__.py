"""The low layer: what the sparse tables, the dense all-reduce and the data readers share.

MPI primitives (import ``mpi4py.MPI``): ``window`` (one RMA window, allocated and
freed collectively), ``locks`` (a lock and a counter per PS over MPI atomics).

Pure helpers (import no MPI, so configs and readers can use them before MPI starts):
``wait`` (how a rank waits: yields, sleeps, futex doorbells), ``malloc`` (glibc's
heap), ``ids`` (id hashing and initial rows), ``sharding`` (row placement),
``optimizers`` (sparse optimizer specs and their math), ``layout`` (which ranks are
PS), ``settings`` (the names and values every layer agrees on), ``process``
(thread level and allocator, set before MPI starts), ``errors`` (hpcps's exceptions), ``metrics``
(evaluation metrics and the JSONL metrics log).

Nothing here imports from the rest of hpcps; this package's face imports nothing, so
``import hpcps.core.ids`` starts no MPI.
"""
