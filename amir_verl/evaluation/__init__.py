"""Evaluation of validation generations: unbiased pass@k and the paper's tables (``amir-eval``).

- :mod:`~amir_verl.evaluation.cli`: the ``amir-eval`` command;
- :mod:`~amir_verl.evaluation.records`: reading verl's dumps (or plain JSONL) into samples;
- :mod:`~amir_verl.evaluation.passk`: pass@k, run alignment, and the errors (``NothingToMeasure``: exit 3);
- :mod:`~amir_verl.evaluation.analyses`: calibration, lengths, coverage, margin, perplexity and their figures;
- :mod:`~amir_verl.evaluation.scores`: each response's mean log-prob under a model, and their cache.
"""
