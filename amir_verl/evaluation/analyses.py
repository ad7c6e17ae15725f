"""The paper's analyses of validation generations, each a table (pandas) and one comparison figure
(matplotlib) that draws every run on shared axes, one colour per run.

- :func:`calibration`: Brier score, expected calibration error, reliability diagram with bin counts.
- :func:`response_lengths`: length of correct and incorrect responses (the figure: incorrect ones).
- :func:`coverage` / :func:`coverage_patterns`: solvable sets across runs (a problem is solvable if any
  sample is correct), the paper's Table 2 pattern breakdown.
- :func:`preference_margin`: per problem, mean length-normalised log-prob of correct minus incorrect
  responses under a given model (:func:`mean_response_log_probs`, transformers), the paper's Figure 4.
- :func:`self_perplexity`: perplexity of responses under the model that generated them, by problem
  stratum over all compared runs (the paper's Figure 3 strata).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from amir_verl.evaluation.passk import DISPLAY_NAMES, EvaluationError, NothingToMeasure, Sample, benchmark_sort_key
from amir_verl.evaluation.scores import mean_token_log_probs


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _name(source: str) -> str:
    return DISPLAY_NAMES.get(source, source)


def run_colors(names: Sequence[str]) -> dict[str, str]:
    """One colour per run, by its position on the command line (the same in every figure)."""
    palette = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray"]
    return {name: palette[i % len(palette)] for i, name in enumerate(names)}


def _integer_ticks(axis) -> None:
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    _plt().close(fig)


# ----------------------------------------------------------------------------------------- calibration


def calibration(samples: Sequence[Sample], bins: int = 10) -> tuple[pd.DataFrame, dict[str, float]]:
    """Per confidence bin: count, mean confidence, accuracy (NaN for an empty bin); summary:

    - ``brier_stated``: mean (a - q)^2 over responses that state a confidence q;
    - ``brier_missing_as_1``: mean over all responses, a response without a confidence counting 1 (the
      worst score), as amir-verl's reward logs it (``brier`` in verl's validation metrics);
    - ``ece``: sum over bins of count / n_stated * |accuracy - mean confidence|;
    - ``n``, ``stated``, ``missing_confidence``.
    """
    if bins < 1:
        raise EvaluationError(f"--bins must be at least 1, got {bins}")
    rated = [s for s in samples if s.confidence is not None]
    if not rated:
        raise NothingToMeasure("no sample states a confidence: calibration needs the confidence field")
    edges = [i / bins for i in range(bins + 1)]
    rows = []
    for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        members = [s for s in rated if lo <= s.confidence < hi or (i == bins - 1 and s.confidence == 1.0)]
        rows.append({
            "bin_lo": lo, "bin_hi": hi, "count": len(members),
            "mean_confidence": sum(s.confidence for s in members) / len(members) if members else math.nan,
            "accuracy": sum(s.correct for s in members) / len(members) if members else math.nan,
        })
    table = pd.DataFrame(rows)
    stated = len(rated)
    filled = table[table["count"] > 0]
    ece = float((filled["count"] / stated * (filled["accuracy"] - filled["mean_confidence"]).abs()).sum())
    squared = sum((float(s.correct) - s.confidence) ** 2 for s in rated)
    missing = len(samples) - stated
    return table, {"brier_stated": squared / stated, "brier_missing_as_1": (squared + missing) / len(samples),
                   "ece": ece, "n": len(samples), "stated": stated, "missing_confidence": missing}


def plot_calibration(per_run: dict[str, tuple[pd.DataFrame, dict]], path: Path) -> None:
    """Reliability diagram: per run, accuracy against mean stated confidence of each bin (a gap where the
    run's bin is empty), and below it each bin's number of responses, written on the bars (bins empty in
    every run shaded)."""
    plt = _plt()
    colors = run_colors(list(per_run))
    fig, (ax, counts) = plt.subplots(2, 1, figsize=(6, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 1.6]})
    first = next(iter(per_run.values()))[0]
    width = float((first["bin_hi"] - first["bin_lo"]).iloc[0])
    empty = sum(table["count"] for table, _ in per_run.values()) == 0
    for lo in first["bin_lo"][empty]:
        for axis in (ax, counts):
            axis.axvspan(lo, lo + width, facecolor="0.92", hatch="//", edgecolor="0.7", linewidth=0, zorder=0)
    ax.plot([0, 1], [0, 1], "k--", linewidth=1, label="perfect calibration")
    bar_width = width / (len(per_run) + 1)
    for i, (name, (table, summary)) in enumerate(per_run.items()):
        # NaN for an empty bin breaks the line there instead of bridging it
        ax.plot(table["mean_confidence"], table["accuracy"], "o-", color=colors[name],
                label=f"{name}: Brier {summary['brier_stated']:.3f}, ECE {summary['ece']:.3f}")
        bars = counts.bar(table["bin_lo"] + (i + 0.5) * bar_width, table["count"], width=bar_width, align="edge",
                          color=colors[name])
        counts.bar_label(bars, labels=[str(int(c)) for c in table["count"]], fontsize=6, rotation=90, padding=2)
    if empty.any():
        ax.fill_between([], [], facecolor="0.92", hatch="//", edgecolor="0.7", label="no responses in bin")
    ax.set(ylabel="accuracy of the bin's responses", xlim=(0, 1), ylim=(-0.02, 1.02),
           title="Reliability diagram (Brier and ECE over responses\nthat state a confidence)")
    ax.legend(loc="upper left", fontsize=8)
    ax.tick_params(labelbottom=True)
    ax.set_xlabel("mean stated confidence in bin")
    counts.set(xlabel="stated confidence (bins)", ylabel="responses", xticks=first["bin_lo"].tolist() + [1.0],
               ylim=(0, max(1, max(int(t["count"].max()) for t, _ in per_run.values())) * 1.35))
    _integer_ticks(counts.yaxis)
    _save(fig, path)


# ----------------------------------------------------------------------------------------- lengths


def response_lengths(samples: Sequence[Sample], tokenizer=None) -> pd.DataFrame:
    """Per data source and correctness: count, mean and median length (tokens with ``tokenizer``,
    else whitespace-separated words)."""
    def length(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"]) if tokenizer else len(text.split())

    frame = pd.DataFrame([{"benchmark": _name(s.data_source), "correct": bool(s.correct), "length": length(s.response)}
                          for s in samples])
    table = frame.groupby(["benchmark", "correct"])["length"].agg(["count", "mean", "median"]).reset_index()
    return table.sort_values("benchmark", key=lambda col: col.map(benchmark_sort_key), kind="stable")


def plot_lengths(table: pd.DataFrame, unit: str, path: Path) -> None:
    """Mean length of incorrect responses per benchmark, the runs side by side (``table`` has a ``run``
    column, runs in order of appearance), each bar labelled with its number of responses."""
    plt = _plt()
    names = list(dict.fromkeys(table["run"]))
    colors = run_colors(names)
    wrong = table[~table["correct"]]
    benchmarks = list(dict.fromkeys(table["benchmark"]))
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(benchmarks) * max(1, len(names) / 2)), 4.2))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        own = wrong[wrong["run"] == name].set_index("benchmark")
        xs = [b + (i - (len(names) - 1) / 2) * width for b in range(len(benchmarks))]
        heights = [own["mean"].get(b, 0.0) for b in benchmarks]
        bars = ax.bar(xs, heights, width=width, color=colors[name], label=name)
        ax.bar_label(bars, labels=[f"n={int(own['count'][b])}" if b in own.index else "none" for b in benchmarks],
                     fontsize=7, padding=2)
    top = max(wrong["mean"].max() if len(wrong) else 1.0, 1.0)
    ax.set(xticks=range(len(benchmarks)), xticklabels=benchmarks, ylim=(0, top * 1.3),
           ylabel=f"mean length of incorrect responses ({unit})", title="Length of incorrect responses")
    ax.legend(loc="upper right", ncol=len(names), fontsize=8)
    _save(fig, path)


# ----------------------------------------------------------------------------------------- coverage


def _solved(runs: dict[str, Sequence[Sample]]) -> tuple[dict[str, set], set]:
    """Per run the (source, problem) pairs with a correct sample, and all pairs of any run."""
    solved = {name: {(s.data_source, s.problem_id) for s in samples if s.correct} for name, samples in runs.items()}
    return solved, {(s.data_source, s.problem_id) for samples in runs.values() for s in samples}


def coverage(runs: dict[str, Sequence[Sample]]) -> pd.DataFrame:
    """Per benchmark: problems (of any run), problems solvable in each run, in all, in none, and in each
    run only. A problem a run lacks counts as not solved by it (only with --all-problems)."""
    solved, problems = _solved(runs)
    names = list(runs)
    rows = []
    for source in sorted({src for src, _ in problems}, key=benchmark_sort_key):
        own = {p for p in problems if p[0] == source}
        per_run = {name: solved[name] & own for name in names}
        row = {"benchmark": _name(source), "problems": len(own)}
        row.update({f"solvable_{name}": len(per_run[name]) for name in names})
        row["solvable_all"] = len(set.intersection(*per_run.values()))
        row["solvable_none"] = len(own - set.union(*per_run.values()))
        for name in names:
            row[f"only_{name}"] = len(per_run[name] - set.union(set(), *(per_run[o] for o in names if o != name)))
        rows.append(row)
    return pd.DataFrame(rows)


def coverage_patterns(runs: dict[str, Sequence[Sample]]) -> pd.DataFrame:
    """The paper's Table 2: per benchmark, the share of each solved/unsolved pattern across the runs
    (in run order, "Y" solved, "N" not), over the problems at least one run solves; the all-"N" pattern
    is by definition empty and left out."""
    import itertools

    names = list(runs)
    solved, problems = _solved(runs)
    rows = []
    for source in sorted({src for src, _ in problems}, key=benchmark_sort_key):
        union = {p for p in problems if p[0] == source and any(p in solved[n] for n in names)}
        for pattern in itertools.product((True, False), repeat=len(names)):
            if not any(pattern):
                continue
            count = sum(all((p in solved[n]) == flag for n, flag in zip(names, pattern)) for p in union)
            rows.append({"benchmark": _name(source), "pattern": "".join("Y" if f else "N" for f in pattern),
                         "runs": "/".join(names), "problems": count, "solvable": len(union),
                         "percent_of_solvable": 100 * count / len(union) if union else math.nan})
    return pd.DataFrame(rows)


def plot_coverage(patterns: pd.DataFrame, names: list[str], path: Path) -> None:
    """Table 2 as grouped bars: per pattern, the share of solvable problems of each benchmark."""
    plt = _plt()
    order = list(dict.fromkeys(patterns["pattern"]))
    benchmarks = list(dict.fromkeys(patterns["benchmark"]))
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(order) * max(1, len(benchmarks) / 2)), 4.5))
    width = 0.8 / len(benchmarks)
    for i, benchmark in enumerate(benchmarks):
        own = patterns[patterns["benchmark"] == benchmark].set_index("pattern")
        xs = [p + (i - (len(benchmarks) - 1) / 2) * width for p in range(len(order))]
        solvable = int(own["solvable"].iloc[0])
        # benchmark colours from another palette than the runs' (the runs are the Y/N letters here)
        bars = ax.bar(xs, own["percent_of_solvable"].reindex(order).fillna(0), width=width,
                      label=f"{benchmark} ({solvable} solvable)", color=plt.get_cmap("Set2")(i % 8))
        ax.bar_label(bars, labels=[str(int(c)) for c in own["problems"].reindex(order)], fontsize=7, padding=1)
    top = float(patterns["percent_of_solvable"].max()) if patterns["percent_of_solvable"].notna().any() else 100.0
    ax.set(xticks=range(len(order)), xticklabels=order, ylim=(0, min(100.0, top) * 1.3 + 1),
           xlabel=f"pattern: solved (Y) or not (N) by {' / '.join(names)}",
           ylabel="% of problems some run solves", title="Coverage of solvable problems (bar labels: problems)")
    ax.legend(loc="upper right", fontsize=8)
    _save(fig, path)


# ----------------------------------------------------------------------------------------- log-probs


VERL_MERGER_ADAPTER = "lora_adapter"  # where `python -m verl.model_merger merge` puts a LoRA run's adapter


def load_model(path: str, device: str = "cpu", dtype: str = "float32"):
    """An HF model folder or hub id -> (model, tokenizer). For a LoRA run, verl's merger writes the base
    weights with the trained adapter beside them in ``<path>/lora_adapter``: that adapter is merged into the
    weights here, so that the folder scores as the policy that was trained, not as its base model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    adapter = Path(path) / VERL_MERGER_ADAPTER
    if (adapter / "adapter_config.json").is_file():
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    return model.to(device).eval(), tokenizer


SCORING_BATCH = 16  # responses per forward pass; sorted by length, so a prompt's samples mostly share one


def mean_response_log_probs(model, tokenizer, pairs: Sequence[tuple[str, str]], device: str = "cpu",
                            batch_size: int = SCORING_BATCH, progress=None) -> list[float]:
    """Mean log-prob of each (prompt, response)'s response tokens given its prompt; NaN for an empty response
    (``model`` is on ``device``; the batching is :func:`amir_verl.evaluation.scores.mean_token_log_probs`)."""
    encoded = []
    for prompt, response in pairs:
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
        if response_ids and not prompt_ids:
            raise EvaluationError("a sample has no prompt text: log-prob analyses need the prompt (verl's 'input')")
        encoded.append((prompt_ids, response_ids))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return mean_token_log_probs(model, encoded, batch_size, pad, progress)


def preference_margin(samples: Sequence[Sample], scores: Sequence[float]) -> tuple[pd.DataFrame, dict]:
    """Per problem with both outcomes: mean l(correct) - mean l(incorrect), and the pair accuracy, the share of
    its (correct, incorrect) response pairs with l(correct) > l(incorrect); ``scores[i]`` is sample i's mean
    response log-prob (:func:`mean_response_log_probs`; NaN, an empty response, is left out). Summary: the mean
    margin and pair accuracy over those problems, and their number."""
    groups: dict[tuple[str, str], list[tuple[bool, float]]] = defaultdict(list)
    for s, lp in zip(samples, scores, strict=True):
        if not math.isnan(lp):
            groups[(s.data_source, s.problem_id)].append((s.correct, lp))
    rows = []
    for (source, problem), items in sorted(groups.items()):
        right = [lp for ok, lp in items if ok]
        wrong = [lp for ok, lp in items if not ok]
        if right and wrong:
            ranked_right = sum(r > w for r in right for w in wrong)
            rows.append({"benchmark": _name(source), "problem_id": problem, "n_correct": len(right),
                         "n_incorrect": len(wrong), "margin": sum(right) / len(right) - sum(wrong) / len(wrong),
                         "pair_accuracy": ranked_right / (len(right) * len(wrong))})
    table = pd.DataFrame(rows, columns=["benchmark", "problem_id", "n_correct", "n_incorrect", "margin",
                                        "pair_accuracy"])
    means = {column: float(table[column].mean()) if len(table) else math.nan for column in ("margin", "pair_accuracy")}
    return table, {"problems_with_both": len(table), "mean_margin": means["margin"],
                   "mean_pair_accuracy": means["pair_accuracy"]}


def _shared_bins(values: pd.Series, bins: int, log: bool = False) -> list[float]:
    """``bins`` equal-width (log-width with ``log``) bins over all values, so that runs compare bin by bin."""
    lo, hi = float(values.min()), float(values.max())
    if log:
        lo, hi = math.log10(lo), math.log10(hi)
    if hi <= lo:
        lo, hi = lo - 0.5, hi + 0.5
    edges = [lo + (hi - lo) * i / bins for i in range(bins + 1)]
    return [10 ** e for e in edges] if log else edges


def plot_margin(per_run: dict[str, tuple[pd.DataFrame, dict]], path: Path, bins: int = 20) -> None:
    """The paper's Figure 4 comparison: per-problem margins of each run on shared bins, each run's mean
    a vertical line in its colour."""
    plt = _plt()
    colors = run_colors(list(per_run))
    values = pd.concat([table["margin"] for table, _ in per_run.values()])
    edges = _shared_bins(values, bins)
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for name, (table, summary) in per_run.items():
        ax.hist(table["margin"], bins=edges, histtype="stepfilled", alpha=0.3, color=colors[name])
        ax.hist(table["margin"], bins=edges, histtype="step", linewidth=1.5, color=colors[name],
                label=f"{name} ({summary['problems_with_both']} problems)")
        ax.axvline(summary["mean_margin"], color=colors[name], linestyle="--", linewidth=1.5,
                   label=f"{name} mean {summary['mean_margin']:.3f}")
    ax.axvline(0, color="k", linewidth=0.8)
    ax.set(xlabel="preference margin per problem (nats/token):\nmean log-prob of correct minus incorrect responses",
           ylabel="problems", title="Preference margin separation")
    _integer_ticks(ax.yaxis)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=2, fontsize=8)
    _save(fig, path)


STRATA = ("all correct in every run", "mixed", "none correct in any run")


def problem_strata(runs: dict[str, Sequence[Sample]]) -> dict[tuple[str, str], str]:
    """The paper's Figure 3 strata over all compared runs: problems every sample of every run solves,
    problems no sample of any run solves, and the rest."""
    outcomes: dict[tuple[str, str], list[bool]] = defaultdict(list)
    for samples in runs.values():
        for s in samples:
            outcomes[(s.data_source, s.problem_id)].append(s.correct)
    return {key: STRATA[0] if all(v) else STRATA[2] if not any(v) else STRATA[1] for key, v in outcomes.items()}


def self_perplexity(samples: Sequence[Sample], strata: dict[tuple[str, str], str],
                    scores: Sequence[float]) -> pd.DataFrame:
    """Per scored response (``scores`` as for :func:`preference_margin`, under the model that generated it):
    perplexity exp(-mean log-prob), correctness, and its problem's stratum from :func:`problem_strata`."""
    rows = [{"benchmark": _name(s.data_source), "problem_id": s.problem_id, "correct": s.correct,
             "stratum": strata[(s.data_source, s.problem_id)], "perplexity": math.exp(-lp)}
            for s, lp in zip(samples, scores, strict=True) if not math.isnan(lp)]
    return pd.DataFrame(rows, columns=["benchmark", "problem_id", "correct", "stratum", "perplexity"])


def plot_perplexity(table: pd.DataFrame, path: Path, bins: int = 20) -> None:
    """One panel per stratum, the runs' self-perplexities on the same bins (log-spaced where they span
    more than a factor 10; ``table`` has a ``run`` column), each run's median a dashed line."""
    from matplotlib.ticker import ScalarFormatter

    plt = _plt()
    names = list(dict.fromkeys(table["run"]))
    colors = run_colors(names)
    log = float(table["perplexity"].max()) > 10 * float(table["perplexity"].min())
    edges = _shared_bins(table["perplexity"], bins, log=log)
    strata = [s for s in STRATA if s in set(table["stratum"])]
    fig, axes = plt.subplots(len(strata), 1, figsize=(6.5, 1.4 + 2.2 * len(strata)), sharex=True, squeeze=False)
    for ax, stratum in zip(axes[:, 0], strata):
        medians = []
        for name in names:
            values = table[(table["run"] == name) & (table["stratum"] == stratum)]["perplexity"]
            if values.empty:
                continue
            ax.hist(values, bins=edges, histtype="stepfilled", alpha=0.25, color=colors[name])
            ax.hist(values, bins=edges, histtype="step", linewidth=1.5, color=colors[name])
            ax.axvline(values.median(), color=colors[name], linestyle="--", linewidth=1.2)
            medians.append(f"{name} {values.median():.1f}")
        n_problems = table[table["stratum"] == stratum].groupby(["benchmark", "problem_id"]).ngroups
        ax.set_title(f"{stratum}: {n_problems} problems; median {', '.join(medians)}", fontsize=9)
        ax.set(ylabel="responses", xscale="log" if log else "linear")
        _integer_ticks(ax.yaxis)
    if log:
        axes[-1, 0].xaxis.set_major_formatter(ScalarFormatter())
    axes[-1, 0].set_xlabel("self-perplexity under the generating model" + (" (log scale)" if log else ""))
    handles = [plt.Rectangle((0, 0), 1, 1, facecolor=colors[n], alpha=0.6) for n in names]
    fig.legend(handles, [f"{n} (dashed: median)" for n in names], loc="upper center", ncol=len(names), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
