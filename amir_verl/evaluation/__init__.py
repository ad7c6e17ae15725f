"""Evaluation of validation generations: unbiased pass@k and the paper's tables (``amir-eval``)."""
