"""The paper's pipeline at miniature on a CPU (:mod:`amir_verl.paper_pipeline.pipeline`): data, SmolLM2-135M,
a cold start, ``recipes/paper/run.sh`` on the CPU backend, verl's merger and ``amir-eval``. It drives the
repository's recipe and data scripts, so it runs from a clone (``pip install -e .``).

- :mod:`~amir_verl.paper_pipeline.data`: the small raw-schema datasets it generates;
- :mod:`~amir_verl.paper_pipeline.cold_start`: the short SFT that teaches the answer template;
- :mod:`~amir_verl.paper_pipeline.report`: the summary of the compared runs.

Here: the names its stages share.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the clone whose recipes/ and data_prep/ the pipeline runs
MODEL_NAME = "smollm2-135m"  # run.sh's MODEL argument; the path comes through MODEL_PATH
VARIANTS = {"grpo": "GRPO", "amir_grpo": "AMIR-GRPO", "gspo": "GSPO", "amir_gspo": "AMIR-GSPO"}  # run.sh's -> label
EVAL_BENCHMARKS = ("aime25", "olympiadbench", "amc23", "minerva", "aqua_rat", "livemathbench")


def experiment(variant: str) -> str:
    """A run's experiment name, as run.sh derives it (its AMIR_EXPERIMENT)."""
    return f"{MODEL_NAME}_{variant}"
