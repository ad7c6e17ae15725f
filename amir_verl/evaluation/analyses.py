"""The paper's analyses of validation generations, each a table (pandas) and a plot (matplotlib).

- :func:`calibration`: Brier score, expected calibration error, reliability diagram.
- :func:`response_lengths`: length of correct versus incorrect responses.
- :func:`coverage`: solvable-set coverage across runs (a problem is solvable if any sample is correct),
  the paper's Table 2 form.
- :func:`preference_margin`: per problem, mean length-normalised log-prob of correct minus incorrect
  responses under a given model (transformers).
- :func:`self_perplexity`: perplexity of responses under the model that generated them, by problem
  stratum (all correct, mixed, none correct).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from amir_verl.evaluation.passk import DISPLAY_NAMES, EvaluationError, Sample


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _name(source: str) -> str:
    return DISPLAY_NAMES.get(source, source)


# ----------------------------------------------------------------------------------------- calibration


def calibration(samples: Sequence[Sample], bins: int = 10) -> tuple[pd.DataFrame, dict[str, float]]:
    """Per confidence bin: count, mean confidence, accuracy; summary: brier, ece, n, missing."""
    rated = [s for s in samples if s.confidence is not None]
    if not rated:
        raise EvaluationError("no sample states a confidence: calibration needs the confidence field")
    edges = [i / bins for i in range(bins + 1)]
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        members = [s for s in rated if lo <= s.confidence < hi or (hi == 1.0 and s.confidence == 1.0)]
        rows.append({
            "bin_lo": lo, "bin_hi": hi, "count": len(members),
            "mean_confidence": sum(s.confidence for s in members) / len(members) if members else math.nan,
            "accuracy": sum(s.correct for s in members) / len(members) if members else math.nan,
        })
    table = pd.DataFrame(rows)
    n = len(rated)
    filled = table[table["count"] > 0]
    ece = float((filled["count"] / n * (filled["accuracy"] - filled["mean_confidence"]).abs()).sum())
    brier = sum((float(s.correct) - s.confidence) ** 2 for s in rated) / n
    return table, {"brier": brier, "ece": ece, "n": n, "missing_confidence": len(samples) - n}


def plot_calibration(table: pd.DataFrame, summary: dict, title: str, path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 5))
    width = table["bin_hi"] - table["bin_lo"]
    ax.bar(table["bin_lo"], table["accuracy"].fillna(0), width=width, align="edge", edgecolor="black",
           alpha=0.7, label="accuracy")
    ax.plot([0, 1], [0, 1], "k--", label="perfect calibration")
    ax.set(xlabel="stated confidence", ylabel="accuracy", xlim=(0, 1), ylim=(0, 1),
           title=f"{title}\nBrier {summary['brier']:.3f}, ECE {summary['ece']:.3f}, n={summary['n']}")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------- lengths


def response_lengths(samples: Sequence[Sample], tokenizer=None) -> pd.DataFrame:
    """Per data source and correctness: count, mean and median length (tokens with ``tokenizer``,
    else whitespace-separated words)."""
    def length(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"]) if tokenizer else len(text.split())

    frame = pd.DataFrame([{"benchmark": _name(s.data_source), "correct": bool(s.correct), "length": length(s.response)}
                          for s in samples])
    return frame.groupby(["benchmark", "correct"])["length"].agg(["count", "mean", "median"]).reset_index()


def plot_lengths(table: pd.DataFrame, unit: str, path: Path) -> None:
    plt = _plt()
    pivot = table.pivot(index="benchmark", columns="correct", values="mean")
    ax = pivot.rename(columns={True: "correct", False: "incorrect"}).plot.bar(figsize=(7, 4), rot=30)
    ax.set(ylabel=f"mean response length ({unit})", title="Length of correct vs incorrect responses")
    ax.figure.tight_layout()
    ax.figure.savefig(path, dpi=120)
    plt.close(ax.figure)


# ----------------------------------------------------------------------------------------- coverage


def coverage(runs: dict[str, Sequence[Sample]]) -> pd.DataFrame:
    """Table 2 form: per benchmark, problems, problems solvable in each run, in all, in none, and in
    each run only. Runs must cover the same problems (checked)."""
    solvable: dict[str, dict[str, dict[str, bool]]] = {}
    for name, samples in runs.items():
        per_source: dict[str, dict[str, bool]] = defaultdict(dict)
        for s in samples:
            per_source[s.data_source][s.problem_id] = per_source[s.data_source].get(s.problem_id, False) or s.correct
        solvable[name] = per_source
    names = list(runs)
    rows = []
    for source in sorted({src for per in solvable.values() for src in per}):
        problem_sets = {name: set(solvable[name].get(source, {})) for name in names}
        first = problem_sets[names[0]]
        for name in names[1:]:
            if problem_sets[name] != first:
                raise EvaluationError(f"{_name(source)}: runs {names[0]!r} and {name!r} do not cover the same "
                                      f"problems ({len(first ^ problem_sets[name])} differ)")
        solved = {name: {p for p, ok in solvable[name][source].items() if ok} for name in names}
        row = {"benchmark": _name(source), "problems": len(first)}
        for name in names:
            row[f"solvable_{name}"] = len(solved[name])
        row["solvable_all"] = len(set.intersection(*solved.values()))
        row["solvable_none"] = len(first - set.union(*solved.values()))
        for name in names:
            others = set.union(set(), *(solved[o] for o in names if o != name))
            row[f"only_{name}"] = len(solved[name] - others)
        rows.append(row)
    return pd.DataFrame(rows)


def coverage_patterns(runs: dict[str, Sequence[Sample]]) -> pd.DataFrame:
    """The paper's Table 2: per benchmark, the share of each solved/unsolved pattern across the runs
    (in run order, "Y" solved, "N" not), over the problems at least one run solves."""
    import itertools

    names = list(runs)
    solved = {name: {(s.data_source, s.problem_id) for s in samples if s.correct} for name, samples in runs.items()}
    problems = {(s.data_source, s.problem_id) for samples in runs.values() for s in samples}
    rows = []
    for source in sorted({src for src, _ in problems}):
        union = {p for p in problems if p[0] == source and any(p in solved[n] for n in names)}
        for pattern in itertools.product((True, False), repeat=len(names)):
            count = sum(all((p in solved[n]) == flag for n, flag in zip(names, pattern)) for p in union)
            rows.append({"benchmark": _name(source), "pattern": "".join("Y" if f else "N" for f in pattern),
                         "runs": "/".join(names), "problems": count,
                         "percent_of_solvable": 100 * count / len(union) if union else math.nan})
    return pd.DataFrame(rows)


def plot_coverage(table: pd.DataFrame, names: list[str], path: Path) -> None:
    plt = _plt()
    frame = table.set_index("benchmark")[[f"solvable_{n}" for n in names]]
    frame = frame.div(table.set_index("benchmark")["problems"], axis=0) * 100
    ax = frame.rename(columns=lambda c: c.removeprefix("solvable_")).plot.bar(figsize=(7, 4), rot=30)
    ax.set(ylabel="solvable problems (%)", title="Solvable-set coverage (any sample correct)")
    ax.figure.tight_layout()
    ax.figure.savefig(path, dpi=120)
    plt.close(ax.figure)


# ----------------------------------------------------------------------------------------- log-probs


def load_model(path: str, device: str = "cpu", dtype: str = "float32"):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    return model, tokenizer


def response_log_probs(model, tokenizer, prompt: str, response: str, device: str = "cpu") -> tuple[float, int]:
    """(mean log-prob of the response tokens given the prompt, number of response tokens)."""
    import torch

    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    if not response_ids:
        return math.nan, 0
    if not prompt_ids:
        raise EvaluationError("a sample has no prompt text: log-prob analyses need the prompt (verl's 'input')")
    ids = torch.tensor([prompt_ids + response_ids], device=device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()
    token = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt_ids):, None]).squeeze(-1)
    return float(token.mean()), len(response_ids)


def _scored(samples, model, tokenizer, device, progress) -> list[tuple[Sample, float]]:
    scored = []
    for i, s in enumerate(samples):
        scored.append((s, response_log_probs(model, tokenizer, s.prompt, s.response, device)[0]))
        if progress and (i + 1) % 100 == 0:
            progress(f"scored {i + 1}/{len(samples)} responses")
    return [(s, lp) for s, lp in scored if not math.isnan(lp)]


def preference_margin(samples, model, tokenizer, device="cpu", progress=print) -> tuple[pd.DataFrame, dict]:
    """Per problem with both outcomes: mean l(correct) - mean l(incorrect); summary: mean margin."""
    groups: dict[tuple[str, str], list[tuple[bool, float]]] = defaultdict(list)
    for s, lp in _scored(samples, model, tokenizer, device, progress):
        groups[(s.data_source, s.problem_id)].append((s.correct, lp))
    rows = []
    for (source, problem), items in sorted(groups.items()):
        right = [lp for ok, lp in items if ok]
        wrong = [lp for ok, lp in items if not ok]
        if right and wrong:
            rows.append({"benchmark": _name(source), "problem_id": problem, "n_correct": len(right),
                         "n_incorrect": len(wrong), "margin": sum(right) / len(right) - sum(wrong) / len(wrong)})
    table = pd.DataFrame(rows, columns=["benchmark", "problem_id", "n_correct", "n_incorrect", "margin"])
    return table, {"problems_with_both": len(table), "mean_margin": float(table["margin"].mean()) if len(table) else math.nan}


def plot_margin(table: pd.DataFrame, summary: dict, title: str, path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.hist(table["margin"], bins=30, edgecolor="black")
    ax.axvline(0, color="k", linestyle="--")
    ax.set(xlabel="mean log-prob, correct minus incorrect", ylabel="problems",
           title=f"{title}: preference margin (mean {summary['mean_margin']:.3f})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def self_perplexity(samples, model, tokenizer, device="cpu", progress=print) -> pd.DataFrame:
    """Per response: perplexity exp(-mean log-prob), correctness, and the problem's stratum."""
    outcomes: dict[tuple[str, str], list[bool]] = defaultdict(list)
    for s in samples:
        outcomes[(s.data_source, s.problem_id)].append(s.correct)
    stratum = {key: "all correct" if all(v) else "none correct" if not any(v) else "mixed"
               for key, v in outcomes.items()}
    rows = [{"benchmark": _name(s.data_source), "problem_id": s.problem_id, "correct": s.correct,
             "stratum": stratum[(s.data_source, s.problem_id)], "perplexity": math.exp(-lp)}
            for s, lp in _scored(samples, model, tokenizer, device, progress)]
    return pd.DataFrame(rows, columns=["benchmark", "problem_id", "correct", "stratum", "perplexity"])


def plot_perplexity(table: pd.DataFrame, title: str, path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, group in table.groupby("stratum"):
        ax.hist(group["perplexity"], bins=30, alpha=0.5, label=f"{name} (n={len(group)})")
    ax.set(xlabel="self-perplexity", ylabel="responses", title=f"{title}: self-perplexity by problem stratum")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
