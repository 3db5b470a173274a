"""``hpcps plan``: an alpha-beta model of a job's step, checkpoint and restore time on a cluster
that is not here, from the config's tables and model and per-row costs timed on this machine
(``workload``, ``costs``, ``model``, ``cli``). Local; no MPI launch needed."""
