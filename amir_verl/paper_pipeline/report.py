"""The CPU paper pipeline's summary: GRPO against AMIR-GRPO (and the GSPO pair) from verl's logged metrics and
the ``amir-eval`` outputs (``results/``)."""

from __future__ import annotations

import json
import math
import re
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf

from amir_verl import run_figures
from amir_verl.cpu.progress import validation_accuracy
from amir_verl.metrics import LAMBDA, NUM_PAIRS, PREF_LOSS, PREF_TERM, REWARD, STEP_TIME, format_value
from amir_verl.paper_pipeline import EVAL_BENCHMARKS, VARIANTS, experiment
from amir_verl.prompt_filter import PREFIX as FILTER_PREFIX

VAL_ACC = re.compile(r"^val-core/(?P<source>.+)/acc/mean@\d+$")
BRIER = re.compile(r"^(?P<run>\S+): Brier \(stated\) (?P<stated>\S+) over \d+\s+Brier \(missing as 1\) (?P<missing>\S+)",
                   re.M)
DROPPED = re.compile(re.escape(FILTER_PREFIX) + r": (?P<source>.+): dropped (?P<dropped>\d+) of (?P<total>\d+) prompts")


@dataclass(frozen=True)
class Evaluated:
    """One amir-eval command's console output, and why it had nothing to measure if it had not (its exit 3)."""

    output: str
    not_measured: str | None = None


def validation_by_benchmark(steps: dict[int, dict[str, float]]) -> dict[str, dict[int, float]]:
    """{data source: {validated step: accuracy}} from ``val-core/*/acc``."""
    table: dict[str, dict[int, float]] = {}
    for step, m in sorted(steps.items()):
        for key, value in m.items():
            if VAL_ACC.match(key):
                table.setdefault(VAL_ACC.match(key)["source"], {})[step] = value
    return table


def read_dump(folder: Path, step: int) -> list[dict]:
    """verl's rollout or validation dump of one step (``<step>.jsonl``); [] if there is none."""
    path = folder / f"{step}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def identical_responses(a: list[dict], b: list[dict]) -> int:
    """How many responses of dump ``a`` have an identical counterpart, same prompt and same response text, in
    dump ``b`` (each counterpart used once). Per prompt, not per position: a group's samples arrive at the
    rollout in any order, so the same samples can be dumped in another order."""
    return sum((Counter((r["input"], r["output"]) for r in a) & Counter((r["input"], r["output"]) for r in b)).values())


def largest_weight_difference(a: Path, b: Path) -> tuple[float, int]:
    """max |w_a - w_b| over the effective weights of two merged models (the adapter merged in, as amir-eval
    scores them), and the number of tensors compared."""
    import torch

    from amir_verl.evaluation.analyses import load_model

    first, second = (load_model(str(path))[0].state_dict() for path in (a, b))
    if first.keys() != second.keys():
        raise ValueError(f"{a} and {b} do not have the same tensors")
    with torch.no_grad():
        return max(float((first[k].float() - second[k].float()).abs().max()) for k in first), len(first)


def composed(work: Path, variant: str, key: str):
    """The value of ``key`` in the config a run composed (hydra's record of it); None without the record."""
    config = work / "outputs" / experiment(variant) / "hydra" / ".hydra" / "config.yaml"
    return OmegaConf.select(OmegaConf.load(config), key) if config.exists() else None


def composed_adapter(work: Path, variant: str) -> str | None:
    """The ``lora_adapter_path`` a run composed."""
    return composed(work, variant, "actor_rollout_ref.model.lora_adapter_path")


ROLLOUT_ENGINES = {"hf": "the hf server (amir_verl.cpu.hf_rollout, transformers' generate)",
                   "vllm": "verl's own vllm rollout (vLLM's CPU build, the cpu-vllm extra)"}


def rollout_engines(work: Path, variants: list[str]) -> str:
    """Which rollout engine each run used, from the configs the runs composed: one line."""
    names = {v: composed(work, v, "actor_rollout_ref.rollout.name") for v in variants}
    described = {v: ROLLOUT_ENGINES.get(name, f"rollout.name={name}") for v, name in names.items()}
    if len(set(described.values())) == 1:
        return f"Rollout engine (every run): {next(iter(described.values()))}."
    return "Rollout engine: " + "; ".join(f"{VARIANTS[v]}: {d}" for v, d in described.items()) + "."


def pref_loss_shifts(steps: dict[int, dict[str, float]]) -> list[float | None]:
    """Per trained step, ``amir/pref_loss - log 2`` (0 while every pair's frozen scores are equal, as at the
    start, where the policy is its reference); None for a step without pairs."""
    return [m[PREF_LOSS] - math.log(2) if m.get(NUM_PAIRS) else None for s, m in sorted(steps.items()) if s > 0 and REWARD in m]


def _steps(first: int, last: int) -> str:
    return f"step {last}" if first == last else f"steps {first}-{last}"


def what_the_runs_did(work: Path, base: str, amir: str, metrics: dict, merged: dict[str, Path], size) -> list[str]:
    """Sentences on how the pair started and what AMIR changed, each figure computed from the runs' files.

    Whether the policy departed is judged on everything the two policies generated after the first update: the
    training rollouts of steps 2 to the last and the last validation. Step 1 is sampled before any update, from
    the shared start, so it tells whether the runs started alike, not whether AMIR changed the policy; and whether
    the two runs sample alike at all: where their step-1 rollouts differ (verl's vllm rollout seeds the engine,
    not each request), a later difference may be sampling alone, and the responses judge nothing."""
    labels = VARIANTS[base], VARIANTS[amir]
    folders = {v: work / "outputs" / experiment(v) for v in (base, amir)}
    rollouts = {step: [read_dump(folders[v] / "rollout", step) for v in (base, amir)] for step in range(1, size.steps + 1)}
    validation = [read_dump(folders[v] / "validation", size.steps) for v in (base, amir)]
    adapters = {composed_adapter(work, v) for v in (base, amir)}
    start = (f"the same initial adapter ({adapters.pop()})" if len(adapters) == 1 and None not in adapters
             else f"different initial adapters ({', '.join(map(str, sorted(adapters, key=str)))})")
    first = rollouts[1]
    first_same = identical_responses(*first)
    lines = [f"- Start: {labels[0]} and {labels[1]} loaded {start}; their step-1 rollouts are identical in "
             f"{first_same} of {len(first[1])} responses."]
    trained = [m for s, m in sorted(metrics[amir].items()) if s > 0 and REWARD in m]
    pairs = [int(m.get(NUM_PAIRS, 0)) for m in trained]
    shifts = pref_loss_shifts(metrics[amir])
    lines.append(f"- {labels[1]} mined {', '.join(map(str, pairs))} pairs at steps 1-{len(pairs)}; amir/pref_loss "
                 f"minus log 2 per step: {', '.join(format_value(x, '+.2e') for x in shifts)}.")
    difference, tensors = largest_weight_difference(merged[base], merged[amir])
    lines.append(f"- Merged models: the largest effective weight difference, {labels[1]} against {labels[0]}, is "
                 f"{difference:.2e} (over {tensors} tensors).")
    # (what was generated, identical responses, responses) after the first update
    later = [(f"step {step}", identical_responses(*dumps), len(dumps[1])) for step, dumps in rollouts.items() if step > 1]
    later.append((f"the step-{size.steps} validation", identical_responses(*validation), len(validation[1])))
    lines.append(f"- Identical responses, {labels[1]} against {labels[0]}: "
                 + "; ".join(f"{where}: {same} of {total}" for where, same, total in later) + ".")
    departed = [(where, total - same, total) for where, same, total in later if same < total]
    if not any(pairs):
        verdict = f"{labels[1]} mined no pair, so its preference term was zero and it trained as {labels[0]} did."
    elif first_same < len(first[1]):
        verdict = (f"The responses cannot tell whether {labels[1]} changed what the policy generates: their step-1 "
                   f"rollouts, sampled before any update, already differ in {len(first[1]) - first_same} of "
                   f"{len(first[1])}, so the two runs do not sample alike and a later difference may be sampling "
                   "alone (the merged models' weight difference above is the direct measure).")
    elif not departed:
        training = f"training {_steps(2, size.steps)} and of " if size.steps > 1 else ""
        verdict = (f"The preference term entered {labels[1]}'s loss, but within {size.steps} steps it did not change "
                   f"what the policy generates: every response of {training}the step-{size.steps} validation is "
                   f"{labels[0]}'s.")
    else:
        verdict = (f"{labels[1]}'s policy departed from {labels[0]}'s: "
                   + "; ".join(f"{differ} of {total} responses differ at {where}" for where, differ, total in departed) + ".")
    return lines + [f"- {verdict}"]


def resolution(work: Path, variant: str, step: int) -> str:
    """What one correct response more or less is worth, per benchmark, from a run's validation dump."""
    samples: dict[str, dict[str, int]] = {}
    for row in read_dump(work / "outputs" / experiment(variant) / "validation", step):
        problems = samples.setdefault(row["data_source"], {})
        problems[str(row["problem_id"])] = problems.get(str(row["problem_id"]), 0) + 1
    points = sorted(100 / sum(problems.values()) for problems in samples.values())
    if not points:
        return "No validation dump: no accuracy to read."
    spread = f"{points[0]:.1f}" if points[0] == points[-1] else f"{points[0]:.1f} to {points[-1]:.1f}"
    return (f"Resolution: with {min(len(p) for p in samples.values())} to {max(len(p) for p in samples.values())} "
            f"problems per benchmark, one correct response more or less moves a benchmark's accuracy by {spread} "
            "points; a smaller difference is no difference.")


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


def mean_margins(results: Path, base_label: str, amir_label: str) -> dict[str, dict[str, float]]:
    """{run: {"margin", "pair_accuracy"}}: amir-eval margin's per-problem figures averaged over the problems."""
    path = results / f"margin_{base_label}_vs_{amir_label}.csv"
    if not path.exists():
        return {}
    table = pd.read_csv(path)
    return {run: {column: float(group[column].mean()) for column in ("margin", "pair_accuracy")}
            for run, group in table.groupby("run")}


# how the pipeline measures the figures it writes to summary.json (amir_verl.run_figures)
FIGURE_DEFINITIONS = {
    run_figures.REWARD: "mean score of the last step's rollouts (verl's critic/score/mean)",
    run_figures.VALIDATION_ACCURACY: "verl's val-core acc/mean@8 after the last step, mean over the benchmarks",
    run_figures.MARGIN: "amir-eval margin on the last validation dump under the merged model, mean over problems "
                        "with both outcomes",
    run_figures.PAIR_ACCURACY: "amir-eval margin's pair accuracy on the same problems, mean over problems",
    run_figures.BRIER: "amir-eval calibration's Brier score over the responses that state a confidence",
}


def pair_figures(work: Path, base: str, amir: str, metrics: dict, outputs: dict[str, Evaluated],
                 size) -> dict[str, dict[str, float | None]]:
    """{label: the figures of :mod:`amir_verl.run_figures`} of one pair of runs, from verl's metrics and
    amir-eval's outputs (None where an analysis had nothing to measure)."""
    margin, calibration = outputs.get(f"margin_{base}"), outputs.get(f"calibration_{base}")
    margins = mean_margins(work / "results", VARIANTS[base], VARIANTS[amir]) if margin and not margin.not_measured else {}
    briers = {m["run"]: float(m["stated"]) for m in BRIER.finditer(calibration.output if calibration else "")}
    figures = {}
    for variant in (base, amir):
        label, trained = VARIANTS[variant], [m for s, m in sorted(metrics[variant].items()) if s > 0 and REWARD in m]
        figures[label] = {
            run_figures.REWARD: trained[-1][REWARD] if trained else None,
            run_figures.VALIDATION_ACCURACY: validation_accuracy(metrics[variant].get(size.steps, {})),
            run_figures.MARGIN: margins.get(label, {}).get("margin"),
            run_figures.PAIR_ACCURACY: margins.get(label, {}).get("pair_accuracy"),
            run_figures.BRIER: briers.get(label),
        }
    return figures


def summary(work: Path, pairs: list[tuple[str, str]], metrics: dict, outputs: dict[str, Evaluated], size,
            merged: dict[str, Path]) -> str:
    parts = [f"## CPU paper pipeline: SmolLM2-135M-Instruct, {size.steps} RL steps of "
             f"{size.prompts_per_step} prompts x 8, responses up to {size.response_tokens} tokens",
             rollout_engines(work, [v for pair in pairs for v in pair])]
    rows = [training_row(VARIANTS[v], metrics[v]) for pair in pairs for v in pair]
    parts += ["### Training (verl's metrics)", _markdown(rows)]
    for base, amir in pairs:
        labels = (VARIANTS[base], VARIANTS[amir])
        parts += [f"### What {labels[1]} did, against {labels[0]} (from the runs' files)",
                  "\n".join(what_the_runs_did(work, base, amir, metrics, merged, size))]
        accuracy = {v: validation_by_benchmark(metrics[v]) for v in (base, amir)}
        table = [{"benchmark": source,
                  "before training (one validation, shared)": format_value(accuracy[base][source].get(0)),
                  **{f"{VARIANTS[v]}, step {size.steps}": format_value(accuracy[v].get(source, {}).get(size.steps))
                     for v in (base, amir)}} for source in sorted(accuracy[base])]
        if table:
            parts += [f"### Validation accuracy per benchmark (mean@8), {labels[0]} vs {labels[1]}", _markdown(table),
                      resolution(work, base, size.steps)]
        calibration = outputs.get(f"calibration_{base}")
        figures = pair_figures(work, base, amir, metrics, outputs, size)
        briers = {m["run"]: m["missing"] for m in BRIER.finditer(calibration.output if calibration else "")}
        parts.append("\n".join(
            f"- {label}: preference margin (merged model, amir-eval margin) "
            f"{format_value(figures[label][run_figures.MARGIN], '+.4f')}, pair accuracy "
            f"{format_value(figures[label][run_figures.PAIR_ACCURACY])}; Brier (stated) "
            f"{format_value(figures[label][run_figures.BRIER], '.4f')}, (missing as 1) {briers.get(label, '-')}"
            for label in labels))
        not_measured = [f"- amir-eval {name.removesuffix(f'_{base}')}: not measured: {result.not_measured}"
                        for name, result in outputs.items() if result.not_measured and name.endswith(f"_{base}")]
        if not_measured:
            parts.append("\n".join(not_measured))
    base_log = work / "outputs" / experiment(pairs[0][0]) / "main_ppo.log"
    dropped = dropped_prompts(base_log, validation_sources=1 + len(EVAL_BENCHMARKS))  # GSM8K's test split too
    if dropped:
        parts.append("Validation prompts dropped by filter_overlong_prompts (max_prompt_length from the recipe): "
                     + ", ".join(f"{source} {d} of {t}" for source, d, t in dropped))
        unevaluated = [source for source, d, t in dropped if d == t]
        if unevaluated:
            parts.append(f"Not evaluated, every prompt over max_prompt_length: {', '.join(unevaluated)}.")
    return "\n\n".join(parts)
