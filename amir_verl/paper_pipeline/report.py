"""The CPU paper pipeline's summary: GRPO against AMIR-GRPO (and the GSPO pair) from verl's logged metrics and
the ``amir-eval`` outputs (``results/``)."""

from __future__ import annotations

import re
import statistics
from pathlib import Path

import pandas as pd

from amir_verl.metrics import LAMBDA, NUM_PAIRS, PREF_TERM, REWARD, STEP_TIME, format_value
from amir_verl.paper_pipeline import EVAL_BENCHMARKS, VARIANTS, experiment
from amir_verl.prompt_filter import PREFIX as FILTER_PREFIX

VAL_ACC = re.compile(r"^val-core/(?P<source>.+)/acc/mean@\d+$")
BRIER = re.compile(r"^(?P<run>\S+): Brier \(stated\) (?P<stated>\S+) over \d+\s+Brier \(missing as 1\) (?P<missing>\S+)",
                   re.M)
DROPPED = re.compile(re.escape(FILTER_PREFIX) + r": (?P<source>.+): dropped (?P<dropped>\d+) of (?P<total>\d+) prompts")
CAVEAT = (
    "One small run on generated one-step word problems, a 135M model and a handful of steps: it shows that "
    "every stage of the paper's pipeline runs as one piece on a real chat model and that AMIR acts (pairs are "
    "mined, a preference term enters the actor's loss, lambda moves). It does not show that AMIR-GRPO beats "
    "GRPO: at the recipe's LoRA learning rate a few steps move the policy little, and with 8 samples of one to "
    "four problems per benchmark a difference of one correct response is 3 to 12 points."
)


def validation_by_benchmark(steps: dict[int, dict[str, float]]) -> dict[str, tuple[float | None, float | None]]:
    """{data source: (accuracy before training, after the last validated step)} from ``val-core/*/acc``."""
    validated = sorted(s for s, m in steps.items() if any(VAL_ACC.match(k) for k in m))
    if not validated:
        return {}
    first, last = steps[validated[0]], steps[validated[-1]]
    sources = sorted({VAL_ACC.match(k)["source"] for k in (*first, *last) if VAL_ACC.match(k)})
    key = lambda m, s: next((v for k, v in m.items() if VAL_ACC.match(k) and VAL_ACC.match(k)["source"] == s), None)  # noqa: E731
    return {s: (key(first, s), key(last, s)) for s in sources}


def training_row(label: str, steps: dict[int, dict[str, float]]) -> dict[str, str]:
    trained = [m for s, m in sorted(steps.items()) if s > 0 and REWARD in m]
    pairs = [int(m[NUM_PAIRS]) for m in trained if NUM_PAIRS in m]
    times = [m[STEP_TIME] for m in trained if STEP_TIME in m]
    return {
        "run": label,
        "steps": str(len(trained)),
        "reward, first -> last step": f"{format_value(trained[0].get(REWARD))} -> {format_value(trained[-1].get(REWARD))}" if trained else "-",
        "pairs per step": " ".join(map(str, pairs)) or "-",
        "pref term, last": format_value(trained[-1].get(PREF_TERM), ".4f") if trained else "-",
        "lambda, last": format_value(trained[-1].get(LAMBDA), ".4f") if trained else "-",
        "step s, median": format_value(statistics.median(times), ".0f") if times else "-",
    }


def _markdown(rows: list[dict[str, str]]) -> str:
    head = list(rows[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(row[h] for h in head) + " |" for row in rows])


def dropped_prompts(log: Path, validation_sources: int) -> list[tuple[str, int, int]]:
    """(data source, dropped, total) of the validation files, from a run's log: the filter reports the train
    files first, then the validation files, whose ``validation_sources`` lines come last."""
    text = log.read_text(errors="replace") if log.exists() else ""
    found = [(m["source"], int(m["dropped"]), int(m["total"])) for m in DROPPED.finditer(text)]
    return found[-validation_sources:]


def mean_margins(results: Path, base_label: str, amir_label: str) -> dict[str, float]:
    path = results / f"margin_{base_label}_vs_{amir_label}.csv"
    if not path.exists():
        return {}
    table = pd.read_csv(path)
    return {run: float(group["margin"].mean()) for run, group in table.groupby("run")}


def summary(work: Path, pairs: list[tuple[str, str]], metrics: dict, outputs: dict[str, str], size) -> str:

    parts = [f"## CPU paper pipeline: SmolLM2-135M-Instruct, {size.steps} RL steps of "
             f"{size.prompts_per_step} prompts x 8, responses up to {size.response_tokens} tokens"]
    rows = [training_row(VARIANTS[v], metrics[v]) for pair in pairs for v in pair]
    parts += ["### Training (verl's metrics)", _markdown(rows)]
    for base, amir in pairs:
        labels = (VARIANTS[base], VARIANTS[amir])
        before_after = {label: validation_by_benchmark(metrics[v]) for label, v in zip(labels, (base, amir))}
        sources = sorted(set().union(*before_after.values()))
        table = [{"benchmark": source,
                  **{f"{label} acc, before -> after": " -> ".join(format_value(x) for x in before_after[label].get(source, (None, None)))
                     for label in labels}} for source in sources]
        if table:
            parts += [f"### Validation accuracy per benchmark (mean@8), {labels[0]} vs {labels[1]}", _markdown(table)]
        margins = mean_margins(work / "results", *labels)
        briers = {m["run"]: (m["stated"], m["missing"]) for m in BRIER.finditer(outputs.get(f"calibration_{base}", ""))}
        parts.append("\n".join(
            f"- {label}: preference margin (merged model, amir-eval margin) {format_value(margins.get(label), '+.4f')}; "
            f"Brier (stated) {briers.get(label, ('-', '-'))[0]}, (missing as 1) {briers.get(label, ('-', '-'))[1]}"
            for label in labels))
    base_log = work / "outputs" / experiment(pairs[0][0]) / "main_ppo.log"
    dropped = dropped_prompts(base_log, validation_sources=1 + len(EVAL_BENCHMARKS))  # GSM8K's test split too
    if dropped:
        parts.append("Validation prompts dropped by filter_overlong_prompts (max_prompt_length from the recipe): "
                     + ", ".join(f"{source} {d} of {t}" for source, d, t in dropped))
    parts.append(CAVEAT)
    return "\n\n".join(parts)
