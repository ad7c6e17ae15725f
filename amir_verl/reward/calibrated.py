"""The calibrated math reward of the paper's section 3.2 (pure python + math-verify):

    R = w_corr * r_corr + w_fmt * r_fmt + w_calib * (1 - (a - q)^2)

r_corr in {0, 1} by the data source's rule, r_fmt in {0, 1} for the exact template layout, a = r_corr
and q the stated confidence; without a parseable confidence there is no calibration credit.
"""

from __future__ import annotations

from dataclasses import dataclass

from amir_verl.reward.answers import DEFAULT_MATH_TIMEOUT_S, choice_letter, is_correct, rule_for
from amir_verl.reward.template import parse_response


@dataclass(frozen=True)
class RewardWeights:
    """Default weights: correctness dominates; format + calibration stay below 0.5, so amir.delta_r=0.5
    makes a preference pair need a correctness difference (see amir_verl/config.py)."""

    w_corr: float = 1.0
    w_fmt: float = 0.1
    w_calib: float = 0.25
    math_timeout_s: float = DEFAULT_MATH_TIMEOUT_S  # one budget per response, however many golds it has
    math_workers: int | None = None  # math-verify helper processes; None: verl's reward threads, at most the cores

    def __post_init__(self):
        for name in ("w_corr", "w_fmt", "w_calib", "math_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"reward weight {name}={value!r} must be a number >= 0")
        if self.math_timeout_s <= 0 or self.math_timeout_s == float("inf"):
            raise ValueError(f"math_timeout_s={self.math_timeout_s!r} must be a finite number > 0")
        if self.math_workers is not None and (isinstance(self.math_workers, bool)
                                              or not isinstance(self.math_workers, int) or self.math_workers < 1):
            raise ValueError(f"math_workers={self.math_workers!r} must be an integer >= 1 (or null)")


def compute_score(data_source, solution_str, ground_truth, extra_info=None, w_corr: float = 1.0,
                  w_fmt: float = 0.1, w_calib: float = 0.25, math_timeout_s: float = DEFAULT_MATH_TIMEOUT_S,
                  math_workers: int | None = None, **kwargs) -> dict:
    """verl score function (``reward.custom_reward_function``); never raises on model output.

    Returns score, acc (r_corr), pred (the extracted answer, for verl's majority vote), format (r_fmt),
    data_source and problem_id (from data_prep's extra_info, so evaluation can align runs),
    format_problem, confidence (q, or -1 when missing), brier ((a - q)^2; 1, the worst, when q is missing,
    matching the zero calibration credit).
    """
    weights = RewardWeights(w_corr, w_fmt, w_calib, math_timeout_s, math_workers)
    parsed = parse_response(solution_str)
    acc = float(is_correct(str(data_source), parsed.answer, ground_truth, weights.math_timeout_s,
                           weights.math_workers))
    fmt = float(parsed.format_ok)
    if parsed.confidence is None:
        calibration, brier, confidence = 0.0, 1.0, -1.0
    else:
        brier = (acc - parsed.confidence) ** 2
        calibration, confidence = 1.0 - brier, parsed.confidence
    pred = parsed.answer or ""
    if rule_for(str(data_source)) == "choice":
        pred = choice_letter(pred) or pred
    problem_id = (extra_info or {}).get("id", (extra_info or {}).get("index")) if isinstance(extra_info, dict) else None
    return {
        "score": weights.w_corr * acc + weights.w_fmt * fmt + weights.w_calib * calibration,
        "acc": acc,
        "pred": pred[:200],
        "format": fmt,
        "format_problem": parsed.problem,
        "confidence": confidence,
        "brier": brier,
        # strings: verl's metrics skip them, its validation dump keeps them for amir-eval
        "data_source": str(data_source),
        "problem_id": "" if problem_id is None else str(problem_id),
    }
