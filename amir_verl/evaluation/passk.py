"""Unbiased pass@k (Chen et al. 2021) and its tables: the paper's Table 1 form for two runs (pure python).

    pass@k = mean over problems of [1 - C(n - c, k) / C(n, k)]

with n samples per problem of which c are correct.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k), as a stable product; needs 0 <= c <= n and 1 <= k <= n."""
    if not (0 <= c <= n) or not (1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


@dataclass(frozen=True)
class Sample:
    """One graded response."""

    problem_id: str
    data_source: str
    correct: bool
    response: str = ""
    confidence: float | None = None
    prompt: str = ""


class EvaluationError(ValueError):
    """Bad evaluation input, with the problem named."""


class NothingToMeasure(EvaluationError):
    """Well-formed input on which an analysis has nothing to measure (for example no problem with both a
    correct and an incorrect response): an outcome of the data, not a mistake. ``amir-eval`` exits 3 for it
    (2 for other errors) and writes no file, so that a pipeline can report the analysis as not measured."""


NOTHING_TO_MEASURE = 3  # amir-eval's exit status for NothingToMeasure; its stderr line starts with:
NOTHING_TO_MEASURE_PREFIX = "amir-eval: nothing to measure: "


def benchmark_pass_at_k(samples: Iterable[Sample], ks: Iterable[int]) -> dict[str, dict[int, float]]:
    """{data_source: {k: pass@k}} over the problems of each data source."""
    by_problem: dict[tuple[str, str], list[bool]] = defaultdict(list)
    for sample in samples:
        by_problem[(sample.data_source, sample.problem_id)].append(bool(sample.correct))
    ks = sorted(set(ks))
    if not ks or ks[0] < 1:
        raise EvaluationError(f"k must be at least 1, got {ks[0] if ks else 'none'}")
    result: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for (source, problem), outcomes in sorted(by_problem.items()):
        n, c = len(outcomes), sum(outcomes)
        for k in ks:
            if n < k:
                raise EvaluationError(
                    f"problem {problem!r} of {source} has {n} sample(s), fewer than k={k}: pass@{k} needs "
                    f"1 <= k <= n "
                    f"(sample more, or drop k={k})"
                )
            result[source][k].append(pass_at_k(n, c, k))
    return {source: {k: sum(v) / len(v) for k, v in per_k.items()} for source, per_k in result.items()}


def align_runs(runs: dict[str, list[Sample]], keep_unshared: bool = False) -> tuple[dict[str, list[Sample]], list[str]]:
    """The runs restricted to the problems every run has, and notes saying what was left out and which
    run lacked it. A benchmark missing from a run is named. ``keep_unshared`` keeps every problem (each
    run is then measured over its own problems) and says so."""
    problems = {name: {(s.data_source, s.problem_id) for s in samples} for name, samples in runs.items()}
    if len(runs) < 2:
        return runs, []
    shared = set.intersection(*problems.values())
    notes = []
    for source in sorted({src for per in problems.values() for src, _ in per}, key=benchmark_sort_key):
        per_run = {name: {p for src, p in per if src == source} for name, per in problems.items()}
        lacking = [name for name, own in per_run.items() if not own]
        if lacking:
            notes.append(f"benchmark {DISPLAY_NAMES.get(source, source)} missing from run(s) {', '.join(lacking)}")
            continue
        union = set.union(*per_run.values())
        unshared = union - set.intersection(*per_run.values())
        if unshared:
            lacked = ", ".join(f"{len(union - own)} lacked by {name}" for name, own in per_run.items() if union - own)
            notes.append(f"{DISPLAY_NAMES.get(source, source)}: {len(unshared)} of {len(union)} problem(s) not in "
                         f"every run ({lacked})")
    if notes:
        if keep_unshared:
            notes.append("kept (--all-problems): each run is measured over its own problems")
        else:
            notes.append(f"compared over the {len(shared)} problem(s) all runs share; --all-problems keeps the others")
    if keep_unshared:
        return runs, notes
    if not shared:
        raise EvaluationError("the runs share no problem (" + "; ".join(notes[:-1]) + "); without problem_id in "
                              "the dumps problems are told apart by verl's per-run uid and cannot be matched "
                              "across runs: use --all-problems")
    return {name: [s for s in samples if (s.data_source, s.problem_id) in shared]
            for name, samples in runs.items()}, notes


DISPLAY_NAMES = {
    "openai/gsm8k": "GSM8K",
    "math-ai/aime25": "AIME 2025",
    "Hothan/OlympiadBench": "OlympiadBench",
    "math-ai/amc23": "AMC23",
    "math-ai/minervamath": "Minerva",
    "deepmind/aqua_rat": "AQUA-RAT",
    "opencompass/LiveMathBench": "LiveMathBench",
}


def benchmark_sort_key(benchmark: str) -> tuple[int, str]:
    """The paper's benchmark order (by data source or display name), then the others by name."""
    for order in (list(DISPLAY_NAMES), list(DISPLAY_NAMES.values())):
        if benchmark in order:
            return order.index(benchmark), ""
    return len(DISPLAY_NAMES), benchmark


def comparison_rows(results: dict[str, dict[str, dict[int, float]]], ks: list[int]) -> list[tuple[str, int, list[float]]]:
    """Rows (benchmark, k, [pass@k in % of each run, in the order of ``results``]) for the benchmarks every
    run has, in the paper's order; ``results`` is {run: {data_source: {k: pass@k}}}."""
    shared = set.intersection(*(set(per_source) for per_source in results.values()))
    return [(DISPLAY_NAMES.get(source, source), k, [100 * per_source[source][k] for per_source in results.values()])
            for source in sorted(shared, key=benchmark_sort_key) for k in ks]


def _cells(percents: list[float]) -> str:
    """One k's cell(s) of a row, the first run the baseline: one run "12.5"; two the paper's
    "12.5 -> 37.5 (+25.0)"; more one cell per run, "12.5 | 37.5 (+25.0) | 75.0 (+62.5)"."""
    base, others = percents[0], percents[1:]
    if len(others) == 1:
        return f"{base:.1f} -> {others[0]:.1f} ({others[0] - base:+.1f})"
    return " | ".join([f"{base:.1f}"] + [f"{other:.1f} ({other - base:+.1f})" for other in others])


def passk_markdown(rows, ks: list[int], names: list[str]) -> str:
    """One row per benchmark of ``comparison_rows``. One run: a column per k. Two: the paper's Table 1
    layout, a column per k with cells "base -> other (+gain)". More: a column group per k with a column
    per run, each run after the first with its gain in points over the first."""
    if len(names) <= 2:
        first, columns = f"Benchmark ({' -> '.join(names)})", [f"pass@{k}" for k in ks]
    else:
        first, columns = f"Benchmark (gain over {names[0]}, points)", [f"{name} pass@{k}" for k in ks for name in names]
    lines = [f"| {first} | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    cells: dict[str, dict[int, str]] = defaultdict(dict)
    for benchmark, k, percents in rows:
        cells[benchmark][k] = _cells(percents)
    for benchmark, per_k in cells.items():
        lines.append(f"| {benchmark} | " + " | ".join(per_k[k] for k in ks) + " |")
    return "\n".join(lines)


def passk_csv_rows(rows, names: list[str]) -> list[list[str]]:
    """Header and one line per (benchmark, k) of ``comparison_rows``: every run's pass@k in %, then the gain
    in points of each run after the first over the first."""
    base = names[0]
    header = (["benchmark", "k"] + [f"{name}_pass_at_k_pct" for name in names]
              + [f"{name}_gain_over_{base}_pts" for name in names[1:]])
    return [header] + [[benchmark, str(k)] + [f"{p:.4f}" for p in percents]
                       + [f"{p - percents[0]:+.4f}" for p in percents[1:]] for benchmark, k, percents in rows]
