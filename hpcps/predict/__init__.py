"""Using a trained model: ``hpcps predict`` (score files with a checkpoint, as an MPI job,
:mod:`hpcps.predict.job`) and ``hpcps evaluate`` (metrics of checkpoints on labelled files,
:mod:`hpcps.predict.evaluate`). Importing this package starts nothing (``hpcps.predict.cli`` is read
before MPI starts)."""
