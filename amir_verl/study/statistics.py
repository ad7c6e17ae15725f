"""Paired comparison of two methods over seeds: AMIR minus GRPO, seed by seed, with a Student-t confidence
interval for the mean difference (the paired t interval). Pure Python and scipy; no verl import.

With ``n`` seeds giving differences ``d_1..d_n`` (mean ``m``, sample standard deviation ``s``), the interval is
``m -/+ t_{(1+c)/2, n-1} * s / sqrt(n)``: it assumes the differences are independent draws from a normal
distribution, which a handful of seeds cannot check, so the table says how many seeds it rests on and how many
of them favour AMIR.

Over a training curve (a figure read at the same checkpoints of both runs, e.g. the probe margin of
:mod:`amir_verl.study.probes`):

- :func:`paired_curve`: the paired t interval at each checkpoint;
- :func:`paired_area`: the area under each seed's difference curve (the trapezoid rule over the steps, which
  is the area of AMIR's curve minus GRPO's), with the same paired t interval over the seeds' areas; with
  ``average=True`` the area divided by the steps spanned, the difference averaged over training;
- :func:`minimum_detectable_difference`: the smallest true mean difference the design detects with the given
  power by a two-sided paired t test at level alpha, ``(t_{1-alpha/2, n-1} + t_{power, n-1}) * sd / sqrt(n)``,
  ``sd`` the observed sd of the differences: the usual normal-theory approximation with t quantiles in place of
  normal ones; :func:`paired_t_power` gives the exact power (noncentral t) of a difference, and
  :func:`exact_detectable_difference` the difference at which it is ``power`` (the approximation's exact power
  is 0.73 at 2 seeds, 0.77 at 3, 0.80 at 8 and above: it over-promises a little at very few seeds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from scipy import stats

CONFIDENCE = 0.95
POWER = 0.8  # the power at which minimum_detectable_difference is stated


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
    sd: float = math.nan  # sample standard deviation of the differences; NaN with fewer than 2 seeds


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
    low = high = sd = math.nan
    if n >= 2:
        sd = math.sqrt(sum((d - mean) ** 2 for d in differences) / (n - 1))
        half = stats.t.ppf((1 + confidence) / 2, n - 1) * sd / math.sqrt(n)
        low, high = mean - half, mean + half
    return PairedDifference(
        seeds=n, grpo_mean=sum(g for g, _ in both) / n, amir_mean=sum(a for _, a in both) / n, mean=mean,
        low=low, high=high, amir_higher=sum(d > 0 for d in differences), amir_lower=sum(d < 0 for d in differences),
        sd=sd)


def mean_interval(values: Sequence[float | None], confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """(mean, low, high): the t interval of one run's mean over the seeds, ``mean -/+ t_{(1+c)/2, n-1} s / sqrt(n)``
    over the values not missing (a plot's band around a run's mean curve; the comparison of two runs is the
    paired interval). NaN interval with fewer than 2 values; all NaN with none."""
    d = paired_difference([0.0] * len(values), values, confidence)
    return d.mean, d.low, d.high


def _missing(value: float | None) -> bool:
    return value is None or math.isnan(value)


def paired_curve(grpo: Sequence[Sequence[float | None]], amir: Sequence[Sequence[float | None]],
                 confidence: float = CONFIDENCE) -> list[PairedDifference]:
    """The paired t interval of AMIR minus GRPO at each checkpoint: ``grpo[s][k]`` is seed ``s``'s GRPO value at
    checkpoint ``k`` (the same checkpoints for every seed and both runs; None or NaN where it is missing, which
    leaves that seed out at that checkpoint only)."""
    _check_curves(grpo, amir)
    checkpoints = len(grpo[0]) if grpo else 0
    return [paired_difference([curve[k] for curve in grpo], [curve[k] for curve in amir], confidence)
            for k in range(checkpoints)]


def trapezoid_area(steps: Sequence[float], values: Sequence[float | None], average: bool = False) -> float:
    """The area under ``values`` over ``steps`` by the trapezoid rule: sum of (s_{k+1} - s_k) (v_k + v_{k+1}) / 2;
    with ``average`` divided by s_last - s_first. NaN when a value is missing (a curve with a hole has no area
    comparable to the others') or with fewer than 2 steps."""
    if len(steps) != len(values):
        raise ValueError(f"{len(steps)} steps against {len(values)} values")
    if any(b <= a for a, b in zip(steps, steps[1:])):
        raise ValueError(f"steps {list(steps)} are not increasing")
    if len(steps) < 2 or any(_missing(v) for v in values):
        return math.nan
    area = sum((s1 - s0) * (v0 + v1) / 2 for s0, s1, v0, v1 in zip(steps, steps[1:], values, values[1:]))
    return area / (steps[-1] - steps[0]) if average else area


def paired_area(steps: Sequence[float], grpo: Sequence[Sequence[float | None]],
                amir: Sequence[Sequence[float | None]], confidence: float = CONFIDENCE,
                average: bool = False) -> PairedDifference:
    """The paired t interval of the area between the curves, AMIR minus GRPO, over the seeds: each seed's
    area of AMIR's curve minus that of GRPO's (:func:`trapezoid_area`, the area under the seed's difference
    curve), a seed with a missing checkpoint left out. ``grpo_mean`` / ``amir_mean`` are the mean areas."""
    _check_curves(grpo, amir)
    return paired_difference([trapezoid_area(steps, curve, average) for curve in grpo],
                             [trapezoid_area(steps, curve, average) for curve in amir], confidence)


def minimum_detectable_difference(sd: float, n: int, alpha: float = 1 - CONFIDENCE, power: float = POWER) -> float:
    """The smallest true mean difference a two-sided paired t test at level ``alpha`` over ``n`` seeds detects
    with probability ``power``, differences of standard deviation ``sd``:
    ``(t_{1-alpha/2, n-1} + t_{power, n-1}) * sd / sqrt(n)``. NaN with fewer than 2 seeds or no sd."""
    if not 0 < alpha < 1 or not 0 < power < 1:
        raise ValueError(f"alpha {alpha} and power {power} must be in (0, 1)")
    if n < 2 or _missing(sd):
        return math.nan
    return (stats.t.ppf(1 - alpha / 2, n - 1) + stats.t.ppf(power, n - 1)) * sd / math.sqrt(n)


def detectable_difference(d: PairedDifference, alpha: float = 1 - CONFIDENCE, power: float = POWER) -> float:
    """:func:`minimum_detectable_difference` at the spread and the seeds of an observed paired difference."""
    return minimum_detectable_difference(d.sd, d.seeds, alpha, power)


def paired_t_power(difference: float, sd: float, n: int, alpha: float = 1 - CONFIDENCE) -> float:
    """The exact power of the two-sided paired t test at level ``alpha`` over ``n`` seeds when the true mean
    difference is ``difference`` and the differences' sd is ``sd``: ``P(|T| > t_{1-alpha/2, n-1})`` with T
    noncentral t, n - 1 degrees of freedom, noncentrality difference * sqrt(n) / sd."""
    if n < 2 or not sd > 0:
        return math.nan
    critical = stats.t.ppf(1 - alpha / 2, n - 1)
    shift = difference * math.sqrt(n) / sd
    # P(T < -c | shift) as P(T > c | -shift): scipy's nct.cdf far in the lower tail returns NaN, its sf 0
    return float(stats.nct.sf(critical, n - 1, shift) + stats.nct.sf(critical, n - 1, -shift))


def exact_detectable_difference(sd: float, n: int, alpha: float = 1 - CONFIDENCE, power: float = POWER) -> float:
    """The difference at which :func:`paired_t_power` is exactly ``power`` (found by root-finding, between the
    approximation and 3 times it). NaN as :func:`minimum_detectable_difference`; 0 for sd 0."""
    from scipy.optimize import brentq

    approximate = minimum_detectable_difference(sd, n, alpha, power)
    if math.isnan(approximate) or approximate == 0:
        return approximate
    return float(brentq(lambda delta: paired_t_power(delta, sd, n, alpha) - power, approximate, 3 * approximate,
                        xtol=1e-12 * approximate))


@dataclass(frozen=True)
class CurveComparison:
    """AMIR minus GRPO over a training curve: per checkpoint and over the whole curve, each with its paired
    interval and the difference the design could detect (:func:`detectable_difference`, the textbook formula)."""

    steps: tuple[float, ...]
    per_checkpoint: tuple[PairedDifference, ...]
    detectable_per_checkpoint: tuple[float, ...]
    area: PairedDifference  # the difference averaged over training (area / steps spanned)
    detectable_area: float


def compare_curves(steps: Sequence[float], grpo: Sequence[Sequence[float | None]],
                   amir: Sequence[Sequence[float | None]], confidence: float = CONFIDENCE,
                   power: float = POWER) -> CurveComparison:
    """:func:`paired_curve` and :func:`paired_area` (``average=True``) of seed-by-checkpoint curves, with the
    detectable difference at the same level (1 - ``confidence``) and ``power``."""
    curve = paired_curve(grpo, amir, confidence)
    if len(curve) != len(steps):
        raise ValueError(f"{len(steps)} steps against curves of {len(curve)} checkpoints")
    area = paired_area(steps, grpo, amir, confidence, average=True)
    alpha = 1 - confidence
    return CurveComparison(tuple(steps), tuple(curve), tuple(detectable_difference(d, alpha, power) for d in curve),
                           area, detectable_difference(area, alpha, power))


def _check_curves(grpo: Sequence[Sequence[float | None]], amir: Sequence[Sequence[float | None]]) -> None:
    if len(grpo) != len(amir):
        raise ValueError(f"{len(grpo)} GRPO curves against {len(amir)} AMIR curves: pair them by seed")
    lengths = {len(curve) for curve in (*grpo, *amir)}
    if len(lengths) > 1:
        raise ValueError(f"curves of different lengths {sorted(lengths)}: read every run at the same checkpoints")
