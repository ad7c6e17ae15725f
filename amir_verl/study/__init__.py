"""GRPO against AMIR-GRPO over seeds, with statistics (:mod:`amir_verl.study.study`, run as
``python -m amir_verl.study``): it trains pairs with the demo or the paper pipeline and compares the figures
they write (:mod:`amir_verl.run_figures`) seed by seed.

- :mod:`~amir_verl.study.statistics`: the paired differences and their t intervals (pure Python and scipy).
"""
