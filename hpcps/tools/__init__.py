"""Commands beside training, and a yardstick: ``demo`` (``hpcps demo``: pushes counted on random rows),
``baseline`` (``hpcps baseline``: hashed logistic regression by L-BFGS on the training split),
``report`` (``hpcps report``: plots and a summary from metrics files), ``reference`` (the same model
trained in one torch process, which the tests and benchmarks hold hpcps's sync mode against).
This face imports nothing.
"""
