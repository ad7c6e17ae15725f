"""Paired comparison of two methods over seeds: AMIR minus GRPO, seed by seed, with a Student-t confidence
interval for the mean difference (the paired t interval). Pure Python and scipy; no verl import.

With ``n`` seeds giving differences ``d_1..d_n`` (mean ``m``, sample standard deviation ``s``), the interval is
``m -/+ t_{(1+c)/2, n-1} * s / sqrt(n)``: it assumes the differences are independent draws from a normal
distribution, which a handful of seeds cannot check, so the table says how many seeds it rests on and how many
of them favour AMIR.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from scipy import stats

CONFIDENCE = 0.95


@dataclass(frozen=True)
class PairedDifference:
    """AMIR minus GRPO over the seeds where both runs have the figure."""

    seeds: int  # seeds with both values
    grpo_mean: float
    amir_mean: float
    mean: float  # mean of the per-seed differences (= amir_mean - grpo_mean)
    low: float  # the confidence interval of ``mean``; NaN with fewer than 2 seeds
    high: float
    amir_higher: int  # seeds where AMIR's value is higher
    amir_lower: int


def paired_difference(grpo: Sequence[float | None], amir: Sequence[float | None],
                      confidence: float = CONFIDENCE) -> PairedDifference:
    """The paired t interval of ``amir[i] - grpo[i]`` over the seeds ``i`` where neither value is missing
    (None or NaN). Fewer than 2 such seeds: the interval is NaN (no spread to estimate); none: every field NaN.
    Identical differences on every seed: a zero-width interval."""
    if len(grpo) != len(amir):
        raise ValueError(f"{len(grpo)} GRPO values against {len(amir)} AMIR values: pair them by seed")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence {confidence} is not in (0, 1)")
    both = [(g, a) for g, a in zip(grpo, amir) if not _missing(g) and not _missing(a)]
    n = len(both)
    if n == 0:
        return PairedDifference(0, *[math.nan] * 5, 0, 0)
    differences = [a - g for g, a in both]
    mean = sum(differences) / n
    low = high = math.nan
    if n >= 2:
        sd = math.sqrt(sum((d - mean) ** 2 for d in differences) / (n - 1))
        half = stats.t.ppf((1 + confidence) / 2, n - 1) * sd / math.sqrt(n)
        low, high = mean - half, mean + half
    return PairedDifference(
        seeds=n, grpo_mean=sum(g for g, _ in both) / n, amir_mean=sum(a for _, a in both) / n, mean=mean,
        low=low, high=high, amir_higher=sum(d > 0 for d in differences), amir_lower=sum(d < 0 for d in differences))


def _missing(value: float | None) -> bool:
    return value is None or math.isnan(value)
