"""The MPI job a process belongs to: ``topology`` (the world split into PS and worker groups, the
nodes, how waiting ranks wait), ``context`` (``hpcps.init`` and :class:`Context`: the split plus the
step protocol and the shard locks of the tables), ``stopping`` (stop requests by signal or file, and
the exit codes). This face imports nothing, so ``hpcps.runtime.stopping`` starts no MPI.
"""
