"""GRPO against AMIR-GRPO over seeds, with statistics (:mod:`amir_verl.study.study`, run as
``python -m amir_verl.study``): it trains pairs with the demo or the paper pipeline and compares the figures
they write (:mod:`amir_verl.run_figures`) seed by seed.

- :mod:`~amir_verl.study.statistics`: the paired differences and their t intervals, per checkpoint and over
  a training curve, and the smallest difference a design detects (pure Python and scipy).
- :mod:`~amir_verl.study.probes`: a fixed probe set per task and a policy's score on it (probe margin,
  pair accuracy), for every checkpoint of a run (torch and transformers; no verl import).
"""
