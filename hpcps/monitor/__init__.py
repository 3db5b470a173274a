"""The job's monitor (``metrics.every``, ``[monitor]``): per-rank system figures on a one-sided
board (``board``, ``fields``), read by the first worker into one record per host and judged by the
alert rules (``rules``, ``monitor.Monitor``); ``probe`` reads the system, ``plots`` draws the
records for ``hpcps report``. Nothing is imported here: ``probe``, ``fields``, ``rules`` and ``plots``
are pure (no MPI), ``board`` and ``monitor`` start MPI."""
