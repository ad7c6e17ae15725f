"""The figures of one finished run that the demo and the paper pipeline write to ``summary.json`` and the study
(:mod:`amir_verl.study`) compares across seeds: the public contract of that file, defined once.

``summary.json`` is ``{"task", "runs": {label: {figure: value or null}}, "definitions", "not_measured"}``.
:data:`DEFINITIONS` says what each figure is; a program's ``"definitions"`` say how it measured them (the demo
reads them off the training rollouts, the pipeline off the validation dumps and the merged models). A figure a
task cannot have (the toy task states no confidence, so it has no Brier score) is null in every run, with the
reason under ``"not_measured"``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

REWARD = "reward"
VALIDATION_ACCURACY = "validation_accuracy"
MARGIN = "margin"
PAIR_ACCURACY = "pair_accuracy"
BRIER = "brier"
# in the order the study's table lists them; what each figure is, whoever measures it
DEFINITIONS = {
    REWARD: "training reward at the end",
    VALIDATION_ACCURACY: "validation pass@1 at the last validation",
    MARGIN: "preference margin, mean log-prob per token of correct minus incorrect responses",
    PAIR_ACCURACY: "pair accuracy, share of (correct, incorrect) pairs the policy ranks right",
    BRIER: "Brier score of the stated confidence (lower is better)",
}
FIGURES = tuple(DEFINITIONS)
SUMMARY_FILE = "summary.json"


def _clean(value: float | None) -> float | None:
    """JSON has no NaN: a figure with no value (None or NaN) is written as null."""
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


def write_summary(folder: Path, task: str, runs: dict[str, dict[str, float | None]], definitions: dict[str, str],
                  not_measured: dict[str, str] | None = None) -> Path:
    """``folder/summary.json`` for runs ``{label: {figure: value}}`` (every figure of :data:`FIGURES`)."""
    for label, figures in runs.items():
        if set(figures) != set(FIGURES):
            raise ValueError(f"{label}: figures {sorted(figures)} are not {sorted(FIGURES)}")
    path = Path(folder) / SUMMARY_FILE
    path.write_text(json.dumps({
        "task": task,
        "runs": {label: {f: _clean(figures[f]) for f in FIGURES} for label, figures in runs.items()},
        "definitions": definitions,
        "not_measured": dict(not_measured or {}),
    }, indent=2) + "\n")
    return path


def read_summary(folder: Path) -> dict:
    """The summary.json that :func:`write_summary` wrote in ``folder``."""
    return json.loads((Path(folder) / SUMMARY_FILE).read_text())
