"""Does AMIR change the margin and the accuracy? GRPO against AMIR-GRPO over several seeds, with statistics:

    python -m amir_verl.study --task toy|smollm2 [--seeds 8] [--first-seed 0] [--steps N] [--workdir DIR]
                              [--record] [-- hydra overrides for every run]

For each seed it runs one pair, GRPO and AMIR-GRPO side by side from the same start with the same seeds:

- ``toy``: the demo (:mod:`amir_verl.demo.quickstart`, ``--seed S``; ``--steps``, default 60) in the study's
  setting (:mod:`amir_verl.study.toy_setting`: the copy-digit task with a 1/0 reward, a cold-started model made
  once in ``<workdir>/setting`` and shared by every seed, checkpoints every 10 steps). The seed sets the data
  order, the rollout sampling and the actor's mini-batches. GRPO is run through the AMIR trainer with lambda 0,
  so its pairs are measured too. After each pair, every checkpoint of both runs is scored on the fixed probe
  set (:func:`amir_verl.study.probes.score_demo_pair`: the 100 validation prompts, each with the ten digits).
- ``smollm2``: the paper pipeline (:mod:`amir_verl.paper_pipeline.pipeline`, ``--size study --seed S``: 10 steps,
  validated and checkpointed every 2) on SmolLM2-135M-Instruct. The seed sets the generated data, the cold
  start, the initial LoRA adapter (shared by the pair) and the sampling; the study raises the recipe's learning
  rate (:data:`SMOLLM2_STUDY_OVERRIDES`) and gives the AMIR run a fixed lambda of 2
  (:data:`SMOLLM2_STUDY_AMIR_OVERRIDES`). After each pair, every checkpoint of both runs is scored on the seed's
  probe set (:func:`amir_verl.study.probes.sampled_probe_set`: :data:`SMOLLM2_PROBE_SAMPLES` responses to each
  validation prompt, sampled once from the seed's cold-started model and graded), and each validation dump gives
  the incorrect responses' length and the Brier score (:func:`validation_curves`).

Each pair writes its figures to ``<workdir>/seed_<S>/summary.json`` (:mod:`amir_verl.run_figures`). The study
then reports, per figure, AMIR minus GRPO seed by seed and its mean with a 95% paired t interval
(:mod:`amir_verl.study.statistics`): ``<workdir>/study.md`` (also printed), ``study.csv`` (every seed's
figures) and ``study.png``; where the runs have verl metrics, per seed the validation accuracy before and after
training, AMIR's steps with pairs and the AMIR-GRPO / GRPO median step time; with probes, per figure of
:data:`CURVE_FIGURES` (probe margin and pair accuracy; smollm2 also the sampled lengths and Brier score) AMIR
minus GRPO at each checkpoint and averaged over training, with the paired interval
and the smallest detectable difference (``study_probes.csv``: every score; ``study.png``: the probe curves,
the end-of-run figures then in ``study_figures.png``). With ``--record`` the report goes to
``docs/results/study_<task>.md`` too (:mod:`amir_verl.results_page`), where the documentation includes it. It
resumes: a seed whose summary.json exists is read, not rerun (and a run's probe scores file is read, not
rescored), as long as the task, steps, overrides and setting are those recorded in ``<workdir>/study.json``;
a seed stopped halfway is redone from an empty folder.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import shlex
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from statistics import median
from pathlib import Path
from typing import Callable

from amir_verl import run_figures
from amir_verl.cpu.launch import VERL_METRICS_FILE, read_verl_metrics, stops_on_sigterm
from amir_verl.cpu.progress import validation_accuracy
from amir_verl.metrics import NUM_PAIRS, format_value
from amir_verl.paper_pipeline import VARIANTS
from amir_verl.paper_pipeline.pipeline import SIZES
from amir_verl.results_page import write_results
from amir_verl.reward.bounded import available_cores
from amir_verl.study import toy_setting
from amir_verl.study.probes import DEMO_RUNS, PROBE_FILE, ProbeScore, ProbeSet, probe_curves
from amir_verl.study.statistics import (
    CONFIDENCE,
    POWER,
    CurveComparison,
    PairedDifference,
    compare_curves,
    mean_interval,
    paired_difference,
)

BASE, AMIR = VARIANTS["grpo"], VARIANTS["amir_grpo"]  # the pair's labels in summary.json (the demo's too)
RUN_FOLDERS = dict(zip((BASE, AMIR), DEMO_RUNS))  # label -> the run's folder in a seed's folder (the demo's names)
# The study's deviations from the paper recipe on SmolLM2, each measured on seed 0 (docs/study.md, "Deviations from the
# recipe"). Every run gets lr 1e-3: at the recipe's 5e-6 a few LoRA steps moved the merged weights
# by under 1e-6 and changed no sampled response; at 2e-4 still no response changed. The AMIR run gets a fixed
# lambda of 2: the recipe's rule (loss_ratio, the official code's) held lambda at its floor, 0.005, and the
# package's grad_share at 0.5 with the term at 0.1-0.2 of the gradient; with either, at 2e-4, AMIR-GRPO generated
# GRPO's responses at every step. At lr 1e-3 and lambda 2 the policies part within the 4 steps (step-2 rewards
# and the validation differ); a smaller setting would measure a difference of zero by construction.
SMOLLM2_STUDY_OVERRIDES = ("actor_rollout_ref.actor.optim.lr=1e-3",)
SMOLLM2_STUDY_AMIR_OVERRIDES = ("amir.lambda_rule=fixed", "+amir.lambda_init=2.0")
# The hf rollout server, the pair side by side (one thread each), not verl's vllm rollout one run after the other:
# on 2 cores the vLLM engine's worker kept a core busy while the actor computed, and a step of the study's size
# took 150 s (2026-12-07, seed 0: old log-probs 37 s, reference 26 s, update 59 s, generation 27 s). Side by
# side, the step-time ratio is also measured under the same load for both runs.
SMOLLM2_STUDY_ROLLOUT = "hf"


Scores = dict[str, dict[int, ProbeScore]]  # a seed's probe scores: {run: {step: score}}
Curves = dict[str, dict[int, dict[str, float]]]  # a seed's figures per checkpoint: {run: {step: {figure: value}}}


@dataclass(frozen=True)
class Task:
    """How one seed's pair is trained: ``argv(seed_dir, seed, steps, overrides)`` is the argv of a
    ``main(argv) -> exit status`` that leaves summary.json in ``seed_dir``.

    Optional: ``prepare(study_dir)`` makes what every seed shares in the study's folder once and returns the
    overrides that point the runs at it (given before the user's); ``setting`` is what study.json records of it;
    ``score(study_dir, seed_dir, progress)`` scores the pair's checkpoints on the task's probe set (one for every
    seed, or with ``probe_set_per_seed`` one per seed, sampled from that seed's starting model);
    ``sampled(seed_dir)`` reads the figures of each run's sampled responses per validated step
    ({run: {step: {figure: value}}}, figures of :data:`CURVE_FIGURES`); ``run_dirs(seed_dir)`` names each run's
    folder, where verl's metrics file is ({run: folder}, the runs named as :data:`RUN_FOLDERS` does)."""

    name: str
    description: str
    default_steps: int | None  # None: the task's size fixes the steps (--steps is refused)
    main: Callable[[list[str]], int]
    argv: Callable[[Path, int, int | None, list[str]], list[str]]
    prepare: Callable[[Path], list[str]] | None = None
    setting: dict | None = None
    score: Callable[[Path, Path, Callable[[str], None]], Scores] | None = None
    probe_set_per_seed: bool = False
    sampled: Callable[[Path], Curves] | None = None
    run_dirs: Callable[[Path], dict[str, Path]] = lambda folder: {run: folder / run for run in DEMO_RUNS}


def _toy_main(argv: list[str]) -> int:
    from amir_verl.demo import quickstart

    return quickstart.main(argv)


def _toy_prepare(study_dir: Path) -> list[str]:
    return toy_setting.setting_overrides(toy_setting.prepare_setting(study_dir))


def _toy_score(study_dir: Path, folder: Path, progress: Callable[[str], None]) -> Scores:
    from amir_verl.study.probes import score_demo_pair

    return score_demo_pair(folder, probe_rows=toy_setting.validation_rows(), grade=toy_setting.compute_score,
                           initial_model=study_dir / toy_setting.SETTING_FOLDER / "model", progress=progress)


def _smollm2_main(argv: list[str]) -> int:
    from amir_verl.paper_pipeline import pipeline

    return pipeline.main(argv)


def _smollm2_run_dirs(folder: Path) -> dict[str, Path]:
    from amir_verl.paper_pipeline import experiment

    return {run: folder / "outputs" / experiment(run) for run in DEMO_RUNS}  # the pipeline's variants: same names


SMOLLM2_PROBE_SAMPLES = 8  # responses per validation prompt in the probe set


def _smollm2_score(study_dir: Path, folder: Path, progress: Callable[[str], None]) -> Scores:
    from amir_verl.study.probes import read_rows, sampled_probe_set, score_pair

    model, adapter = folder / "models" / "smollm2_cold_start", folder / "models" / "lora_init"
    data = folder / "data" / "amir"
    seed = int(folder.name.removeprefix("seed_"))  # seed_dir's name

    def make_probe_set():
        # the runs' validation prompts (the recipe's val_files), sampled from the seed's starting policy: the
        # cold-started model with the initial adapter, whose B = 0 leaves it the model
        rows = read_rows([data / "gsm8k" / "test.parquet", *sorted((data / "eval").glob("*/*.parquet"))])
        progress(f"probe set: {SMOLLM2_PROBE_SAMPLES} responses to each of {len(rows)} validation prompts, "
                 f"sampled from {model.name}")
        return sampled_probe_set(model, rows, samples_per_prompt=SMOLLM2_PROBE_SAMPLES,
                                 max_new_tokens=SIZES["study"].response_tokens, seed=seed, task="smollm2")

    return score_pair(folder, _smollm2_run_dirs(folder), model, make_probe_set, adapter=adapter, progress=progress)


VALIDATION_FIGURES_FILE = "validation_figures.json"  # a run's validation_curves, read back once written


def _smollm2_sampled(folder: Path) -> Curves:
    """Each run's :func:`validation_curves` (kept in ``<run dir>/validation_figures.json``); step 0 is the first
    run's (the pipeline validates a pair's shared start once)."""
    from transformers import AutoTokenizer

    curves = {}
    for run, run_dir in _smollm2_run_dirs(folder).items():
        kept = run_dir / VALIDATION_FIGURES_FILE
        if not kept.exists():
            tokenizer = AutoTokenizer.from_pretrained(folder / "models" / "smollm2_cold_start")
            kept.write_text(json.dumps({str(step): figures for step, figures in
                                        validation_curves(run_dir / "validation", tokenizer).items()}) + "\n")
        curves[run] = {int(step): figures for step, figures in json.loads(kept.read_text()).items()}
    first, second = DEMO_RUNS
    if 0 in curves[first]:
        curves[second].setdefault(0, curves[first][0])
    return curves


INCORRECT_TOKENS, BRIER = "incorrect_response_tokens", "brier"


def validation_curves(validation_dir: Path, tokenizer) -> dict[int, dict[str, float]]:
    """{step: figures} of a run's validation dumps (verl's ``<validation_dir>/<step>.jsonl``): the mean length
    in ``tokenizer``'s tokens of the incorrect responses (NaN where none is) and the Brier score over the
    responses that state a confidence (:func:`amir_verl.evaluation.analyses.calibration`'s ``brier_stated``;
    NaN where none does)."""
    from amir_verl.evaluation.analyses import calibration
    from amir_verl.evaluation.passk import NothingToMeasure
    from amir_verl.evaluation.records import load_run

    curves = {}
    for path in sorted(Path(validation_dir).glob("*.jsonl")):
        if not path.stem.isdigit():
            continue
        samples = load_run(path).samples
        lengths = [len(tokenizer(s.response, add_special_tokens=False)["input_ids"]) for s in samples if not s.correct]
        try:
            brier = calibration(samples)[1]["brier_stated"]
        except NothingToMeasure:
            brier = math.nan
        curves[int(path.stem)] = {INCORRECT_TOKENS: sum(lengths) / len(lengths) if lengths else math.nan,
                                  BRIER: brier}
    return dict(sorted(curves.items()))


TASKS = {
    "toy": Task("toy", "the copy-digit task on the demo's tiny model, cold-started (amir_verl.study.toy_setting)",
                60, _toy_main,
                lambda d, seed, steps, extra: ["--workdir", str(d), "--seed", str(seed), "--steps", str(steps),
                                               "--", *extra],
                prepare=_toy_prepare, setting=toy_setting.RECORD, score=_toy_score),
    "smollm2": Task("smollm2", "the paper pipeline on SmolLM2-135M-Instruct (size `study`)", None, _smollm2_main,
                    lambda d, seed, steps, extra: ["--workdir", str(d), "--size", "study", "--seed", str(seed),
                                                   "--rollout", SMOLLM2_STUDY_ROLLOUT,
                                                   *(f"--amir-override={o}" for o in SMOLLM2_STUDY_AMIR_OVERRIDES),
                                                   "--", *SMOLLM2_STUDY_OVERRIDES, *extra],
                    setting={"size": asdict(SIZES["study"]), "rollout": SMOLLM2_STUDY_ROLLOUT,
                             "probe_samples": SMOLLM2_PROBE_SAMPLES},
                    score=_smollm2_score, probe_set_per_seed=True, sampled=_smollm2_sampled,
                    run_dirs=_smollm2_run_dirs),
}
STUDY_FILE = "study.json"


class StudyError(Exception):
    """Bad use (exit status 2) or a failed seed (1); the message is the one line the user sees."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


def seed_dir(workdir: Path, seed: int) -> Path:
    return workdir / f"seed_{seed}"


def claim_workdir(workdir: Path, settings: dict) -> None:
    """Record the study's settings in ``workdir`` or check them against the ones recorded: results of
    other settings are never mixed in."""
    if workdir.exists() and not workdir.is_dir():
        raise StudyError(f"--workdir {workdir} is a file; give a folder", 2)
    path = workdir / STUDY_FILE
    if path.exists():
        recorded = json.loads(path.read_text())
        if recorded != settings:
            changed = ", ".join(f"{k} {recorded.get(k)!r} -> {settings.get(k)!r}"
                                for k in sorted(recorded.keys() | settings.keys()) if recorded.get(k) != settings.get(k))
            raise StudyError(f"{workdir} holds a study with other settings ({changed}); give another --workdir", 2)
        return
    if workdir.exists() and any(workdir.iterdir()):
        raise StudyError(f"--workdir {workdir} holds other files; give a new or empty folder", 2)
    workdir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=2) + "\n")


def read_pair(folder: Path) -> dict:
    """A seed's summary.json, checked to hold the pair."""
    summary = run_figures.read_summary(folder)
    missing = [label for label in (BASE, AMIR) if label not in summary["runs"]]
    if missing:
        raise StudyError(f"{folder / run_figures.SUMMARY_FILE} has no run {missing}")
    return summary


def compare(summaries: dict[int, dict]) -> dict[str, PairedDifference]:
    """{figure: AMIR minus GRPO over the seeds}, the seeds in the order given."""
    return {figure: paired_difference([s["runs"][BASE][figure] for s in summaries.values()],
                                      [s["runs"][AMIR][figure] for s in summaries.values()])
            for figure in run_figures.FIGURES}


def study_table(task: Task, summaries: dict[int, dict], differences: dict[str, PairedDifference]) -> str:
    """The Markdown report: one row per figure, then what each figure is and what was not measured."""
    seeds = list(summaries)
    first = next(iter(summaries.values()))
    pct = f"{CONFIDENCE:.0%}"
    lines = [f"## {BASE} against {AMIR} over {len(seeds)} seeds ({', '.join(map(str, seeds))}): {task.description}",
             "",
             f"| figure | seeds | {BASE} | {AMIR} | {AMIR} minus {BASE}, mean | {pct} interval (paired t) "
             f"| seeds {AMIR} higher / lower |",
             "|---|---|---|---|---|---|---|"]
    for figure, d in differences.items():
        if d.seeds == 0:
            lines.append(f"| {figure} | 0 | - | - | - | - | - |")
            continue
        interval = "-" if math.isnan(d.low) else f"[{d.low:+.4f}, {d.high:+.4f}]"
        lines.append(f"| {figure} | {d.seeds} | {d.grpo_mean:.4f} | {d.amir_mean:.4f} | {d.mean:+.4f} | {interval} "
                     f"| {d.amir_higher} / {d.amir_lower} |")
    lines += ["", "Figures (as this task measures them):"]
    lines += [f"- {figure}: {first['definitions'].get(figure, run_figures.DEFINITIONS[figure])}"
              for figure in run_figures.FIGURES if figure not in first["not_measured"]]
    lines += [f"- {figure}: not measured: {reason}" for figure, reason in first["not_measured"].items()]
    lines.append(f"- The interval is mean difference -/+ t(0.975, seeds - 1) x sd / sqrt(seeds), over the seeds "
                 f"where both runs have the figure; an interval that contains 0 shows no difference at {pct}.")
    verdicts = [f"{figure} {'higher' if d.low > 0 else 'lower'} with {AMIR}" for figure, d in differences.items()
                if d.seeds >= 2 and (d.low > 0 or d.high < 0)]
    lines.append("- Intervals that exclude 0: " + (", ".join(verdicts) if verdicts else "none") + ".")
    return "\n".join(lines)


def write_csv(path: Path, summaries: dict[int, dict]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["seed", "run", *run_figures.FIGURES])
        for seed, summary in summaries.items():
            for label in (BASE, AMIR):
                writer.writerow([seed, label, *("" if summary["runs"][label][fig] is None else summary["runs"][label][fig]
                                                for fig in run_figures.FIGURES)])


def plot_study(path: Path, summaries: dict[int, dict], differences: dict[str, PairedDifference], title: str) -> Path:
    """One panel per measured figure: each seed's GRPO and AMIR values joined by a line, the means bold, and
    the mean difference with its interval in the panel's title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [figure for figure, d in differences.items() if d.seeds]
    fig, axes = plt.subplots(1, max(len(measured), 1), figsize=(3.2 * max(len(measured), 1), 3.6), squeeze=False)
    for ax, figure in zip(axes[0], measured):
        d = differences[figure]
        for summary in summaries.values():
            values = [summary["runs"][label][figure] for label in (BASE, AMIR)]
            if None not in values:
                ax.plot([0, 1], values, "o-", color="grey", alpha=0.5, lw=1)
        ax.plot([0, 1], [d.grpo_mean, d.amir_mean], "s-", color="tab:red", lw=2.5, label="mean")
        interval = "" if math.isnan(d.low) else f"\n{CONFIDENCE:.0%}: [{d.low:+.3f}, {d.high:+.3f}]"
        ax.set_title(f"{figure}\ndifference {d.mean:+.3f}{interval}", fontsize=9)
        ax.set_xticks([0, 1], [BASE, AMIR])
        ax.set_xlim(-0.3, 1.3)
        ax.grid(alpha=0.3)
    return _save_figure(fig, path, title)


def _save_figure(fig, path: Path, title: str) -> Path:
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _figures_line(summary: dict, label: str) -> str:
    values = summary["runs"][label]
    return "  ".join(f"{figure} {format_value(values[figure], '.3f')}" for figure in run_figures.FIGURES
                     if figure not in summary["not_measured"])


def run_study(task: Task, workdir: Path, seeds: list[int], steps: int | None, setting: list[str],
              overrides: list[str]) -> tuple[dict[int, dict], dict[int, Curves]]:
    """Train the seeds not done yet, one pair at a time (``setting``'s overrides, then the user's), and score
    each pair's checkpoints where the task has probes (a run's scores file is read, not redone); returns
    ({seed: summary.json}, {seed: figures per checkpoint}: the probe scores and the sampled figures, empty
    without probes)."""
    summaries: dict[int, dict] = {}
    scores: dict[int, Curves] = {}
    durations: list[float] = []
    for number, seed in enumerate(seeds, start=1):
        folder = seed_dir(workdir, seed)
        trained_from = None  # when this seed's training started, if it trains now
        if (folder / run_figures.SUMMARY_FILE).exists():
            summaries[seed] = read_pair(folder)
            print(f"[study] seed {seed} ({number} of {len(seeds)}): done earlier, read {folder / run_figures.SUMMARY_FILE}",
                  flush=True)
        else:
            print(f"[study] seed {seed} ({number} of {len(seeds)}): training {BASE} and {AMIR} in {folder}", flush=True)
            if folder.exists():  # a stopped attempt's files: the seed is redone from nothing, and its wall time
                # (seed_wall_time, read off the files' times) covers this attempt only
                print(f"[study] seed {seed}: removing the files of a stopped attempt", flush=True)
                shutil.rmtree(folder)
            trained_from = time.monotonic()
            status = task.main(task.argv(folder, seed, steps, [*setting, *overrides]))
            if status == 130:  # the demo and the pipeline catch Ctrl-C themselves, stop their runs and return 130
                raise KeyboardInterrupt
            if status != 0:
                raise StudyError(f"seed {seed}: the {task.name} pair stopped with exit status {status} (its output is "
                                 f"above; logs in {folder}); rerun the same command to resume from seed {seed}")
            summaries[seed] = read_pair(folder)
            for label in (BASE, AMIR):
                print(f"[study] seed {seed} {label}: {_figures_line(summaries[seed], label)}", flush=True)
        if task.score is not None:
            probe_scores = task.score(workdir, folder, lambda line, seed=seed: print(f"[study] seed {seed} {line}",
                                                                                    flush=True))
            for label, run in RUN_FOLDERS.items():
                print(f"[study] seed {seed} {label}: {_probe_line(probe_scores[run])}", flush=True)
            sampled = task.sampled(folder) if task.sampled is not None else {}
            seed_wall_time(folder)  # the seed's files are all written
            scores[seed] = {run: {step: {**sampled.get(run, {}).get(step, {}),
                                         **(asdict(probe_scores[run][step]) if step in probe_scores[run] else {})}
                                  for step in sorted(probe_scores[run].keys() | sampled.get(run, {}).keys())}
                            for run in RUN_FOLDERS.values()}
        if trained_from is not None:
            durations.append(time.monotonic() - trained_from)
            left = sum(1 for s in seeds[number:] if not (seed_dir(workdir, s) / run_figures.SUMMARY_FILE).exists())
            print(f"[study] seed {seed} done in {durations[-1]:.0f} s; {len(seeds) - number} seed(s) to go"
                  + (f", about {left * sum(durations) / len(durations) / 60:.0f} min" if left else ""), flush=True)
    return summaries, scores


def probe_set_text(task: Task, workdir: Path, seeds: list[int]) -> str:
    """What the report says of the probe set: the one every seed's pair was scored on (each seed's
    ``probes.json``), refused unless it is one; with ``task.probe_set_per_seed``, each seed's own."""
    probe_sets = {seed: ProbeSet.load(seed_dir(workdir, seed) / PROBE_FILE) for seed in seeds}
    if task.probe_set_per_seed:
        sizes = ", ".join(f"seed {seed}: {len(p.prompts)} prompts" for seed, p in probe_sets.items())
        return f"one per seed, shared by the seed's two runs: {probe_sets[seeds[0]].description} ({sizes})"
    fingerprints = {seed: p.fingerprint() for seed, p in probe_sets.items()}
    if len(set(fingerprints.values())) > 1:
        raise StudyError(f"the seeds were scored on different probe sets ({fingerprints}): their curves do not compare")
    return f"the same for both runs of every seed: {probe_sets[seeds[0]].description}"


def _probe_line(run_scores: dict[int, ProbeScore]) -> str:
    first, last = min(run_scores), max(run_scores)
    return (f"probe margin {run_scores[first].margin:+.3f} -> {run_scores[last].margin:+.3f}, pair accuracy "
            f"{run_scores[first].pair_accuracy:.3f} -> {run_scores[last].pair_accuracy:.3f} (steps {first} -> {last}, "
            f"{len(run_scores)} checkpoints)")


# ---- the probe curves, the runs' facts and their report ----------------------------------------------------------

CURVE_FIGURES = {  # figure per checkpoint (a ProbeScore field, or a sampled figure) -> what the report calls it
    "margin": "probe margin (mean log-prob per token of the correct response minus that of the incorrect ones)",
    "pair_accuracy": "probe pair accuracy (share of (correct, incorrect) pairs with the correct one scored higher)",
    INCORRECT_TOKENS: "length of the incorrect validation responses (mean tokens; sampled by each run)",
    BRIER: "Brier score of the validation responses' stated confidence (sampled by each run)",
}
STEP_TIME = "timing_s/step"  # verl's wall time of a training step


@dataclass(frozen=True)
class ProbeComparison:
    steps: list[int]
    grpo: list[list[float | None]]  # [seed][checkpoint]
    amir: list[list[float | None]]
    comparison: CurveComparison


def compare_probes(scores: dict[int, Curves]) -> dict[str, ProbeComparison]:
    """{figure: AMIR minus GRPO at each checkpoint and averaged over training}, the seeds in ``scores``' order,
    for each figure of :data:`CURVE_FIGURES` that a run has."""
    out = {}
    present = {figure for runs in scores.values() for steps in runs.values() for values in steps.values()
               for figure, value in values.items() if value is not None and not math.isnan(value)}
    for figure in (f for f in CURVE_FIGURES if f in present):
        steps, grpo, amir = probe_curves(scores, figure)
        out[figure] = ProbeComparison(steps, grpo, amir, compare_curves(steps, grpo, amir))
    return out


@dataclass(frozen=True)
class RunFacts:
    """What a run's verl metrics say besides the figures: how much it learned, whether it mined pairs, its speed."""

    first_accuracy: float | None  # validation accuracy at the first validation (before training)
    last_accuracy: float | None
    steps: int
    steps_with_pairs: int
    median_step_s: float | None  # timing_s/step, median over the steps after the first


def run_facts(metrics: dict[int, dict[str, float]]) -> RunFacts:
    """:class:`RunFacts` of a run's metrics ({step: {key: value}}, step 0 the validation before training)."""
    accuracies = [a for _, m in sorted(metrics.items()) if (a := validation_accuracy(m)) is not None]
    train = {step: m for step, m in metrics.items() if step > 0}
    times = [m[STEP_TIME] for step, m in train.items() if step > 1 and STEP_TIME in m]
    return RunFacts(accuracies[0] if accuracies else None, accuracies[-1] if accuracies else None, len(train),
                    sum(1 for m in train.values() if m.get(NUM_PAIRS)), median(times) if times else None)


def read_run_facts(task: Task, folder: Path) -> dict[str, RunFacts] | None:
    """{label: RunFacts} of a seed's pair from each run's verl metrics file; None where a run has none. A run not
    validated before training (the paper pipeline validates a pair's shared start once, in its first run) starts
    from the other run's validation at step 0."""
    run_dirs = task.run_dirs(folder)
    paths = {label: run_dirs[run] / VERL_METRICS_FILE for label, run in RUN_FOLDERS.items()}
    if not all(path.exists() for path in paths.values()):
        return None
    metrics = {label: read_verl_metrics(path) for label, path in paths.items()}
    starts = [m[0] for m in metrics.values() if validation_accuracy(m.get(0, {})) is not None]
    for m in metrics.values():
        if starts and validation_accuracy(m.get(0, {})) is None:
            m[0] = {**m.get(0, {}), **starts[0]}
    return {label: run_facts(m) for label, m in metrics.items()}


def step_time_ratio(facts: dict[str, RunFacts]) -> float | None:
    """AMIR's median step time over GRPO's, one seed."""
    grpo, amir = facts[BASE].median_step_s, facts[AMIR].median_step_s
    return amir / grpo if grpo and amir is not None else None


def _interval(d: PairedDifference) -> str:
    return "-" if math.isnan(d.low) else f"[{d.low:+.4f}, {d.high:+.4f}]"


def _number(value: float, form: str = ".4f") -> str:
    return "-" if value is None or math.isnan(value) else format(value, form)


def probe_table(comparisons: dict[str, ProbeComparison], probe_set: str) -> str:
    """Per probe figure: AMIR minus GRPO at each checkpoint and averaged over training, each with its paired
    interval and the smallest difference the design detects."""
    pct = f"{CONFIDENCE:.0%}"
    any_comparison = next(iter(comparisons.values()))
    steps = any_comparison.steps
    lines = [f"Probe set ({probe_set}); scored at steps "
             f"{', '.join(map(str, steps))} (step 0: the shared starting model)."]
    for figure, probe in comparisons.items():
        c = probe.comparison
        steps = probe.steps
        lines += ["", f"{CURVE_FIGURES[figure]}:", "",
                  f"| step | seeds | {BASE} | {AMIR} | {AMIR} minus {BASE}, mean | {pct} interval (paired t) "
                  f"| detectable difference ({POWER:.0%} power) |",
                  "|---|---|---|---|---|---|---|"]
        rows = [(str(step), d, detectable) for step, d, detectable in
                zip(steps, c.per_checkpoint, c.detectable_per_checkpoint)]
        rows.append((f"mean over steps {steps[0]}-{steps[-1]} (area / {steps[-1] - steps[0]})", c.area,
                     c.detectable_area))
        for name, d, detectable in rows:
            lines.append(f"| {name} | {d.seeds} | {_number(d.grpo_mean)} | {_number(d.amir_mean)} "
                         f"| {_number(d.mean, '+.4f')} | {_interval(d)} | {_number(detectable)} |")
    lines += ["",
              f"- Interval: mean difference -/+ t(0.975, seeds - 1) x sd / sqrt(seeds) over the seeds (paired t). "
              f"Mean over training: each seed's difference curve integrated by the trapezoid rule over the "
              f"checkpoints and divided by the steps spanned, then the same interval over the seeds.",
              f"- Detectable difference: (t(0.975, seeds - 1) + t({POWER}, seeds - 1)) x sd / sqrt(seeds), the "
              f"smallest true mean difference a two-sided paired t test at 5% detects with {POWER:.0%} power, at "
              f"the observed sd."]
    return "\n".join(lines)


WALL_TIME_FILE = "wall_time.json"


def seed_wall_time(folder: Path) -> float:
    """Seconds from the first file a seed's pair wrote to its last (its data to its probe scores), read off the
    files' times once and kept in ``<folder>/wall_time.json``: a resumed study, or a copy of the folder (whose
    files have new times), reports the figure measured."""
    kept = folder / WALL_TIME_FILE
    if kept.exists():
        return json.loads(kept.read_text())["seconds"]
    times = [path.stat().st_mtime for path in folder.rglob("*") if path.is_file()]
    seconds = max(times) - min(times) if times else 0.0
    kept.write_text(json.dumps({"seconds": round(seconds, 1)}) + "\n")
    return round(seconds, 1)


def wall_time_line(workdir: Path, seeds: list[int]) -> str:
    times = [seed_wall_time(seed_dir(workdir, seed)) for seed in seeds]
    return (f"- Wall time, from each seed folder's first file to its last (training, merging, evaluation and "
            f"scoring): {sum(times):,.0f} s for the {len(seeds)} seeds, {min(times):,.0f} to {max(times):,.0f} s a seed, "
            f"on {available_cores()} cores.")


def facts_table(facts: dict[int, dict[str, RunFacts]]) -> str:
    """One row per seed: validation accuracy first -> last per run, AMIR's steps with pairs, the step times."""
    lines = [f"| seed | {BASE} validation accuracy, first -> last | {AMIR} validation accuracy, first -> last "
             f"| {AMIR} steps with pairs | {BASE} step, s | {AMIR} step, s | {AMIR} / {BASE} step time |",
             "|---|---|---|---|---|---|---|"]
    for seed, runs in facts.items():
        grpo, amir = runs[BASE], runs[AMIR]
        ratio = step_time_ratio(runs)
        lines.append(f"| {seed} | {_number(grpo.first_accuracy, '.3f')} -> {_number(grpo.last_accuracy, '.3f')} "
                     f"| {_number(amir.first_accuracy, '.3f')} -> {_number(amir.last_accuracy, '.3f')} "
                     f"| {amir.steps_with_pairs} of {amir.steps} | {_number(grpo.median_step_s, '.2f')} "
                     f"| {_number(amir.median_step_s, '.2f')} | {_number(ratio, '.3f')} |")
    ratios = sorted(r for runs in facts.values() if (r := step_time_ratio(runs)) is not None)
    if ratios:
        lines += ["", f"- Step time: verl's `{STEP_TIME}`, the median over each run's steps after the first; the two "
                      f"runs of a seed train side by side on the same cores. {AMIR} / {BASE} over the seeds: median "
                      f"{median(ratios):.3f}, range {ratios[0]:.3f} to {ratios[-1]:.3f}."]
    return "\n".join(lines)


def write_probe_csv(path: Path, scores: dict[int, Curves]) -> None:
    fields = [name for name in ProbeScore.__dataclass_fields__]
    fields += [f for f in CURVE_FIGURES if f not in fields and any(f in values for runs in scores.values()
                                                                   for steps in runs.values() for values in steps.values())]
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["seed", "run", "step", *fields])
        for seed, runs in scores.items():
            for label, run in RUN_FOLDERS.items():
                for step, values in sorted(runs[run].items()):
                    writer.writerow([seed, label, step, *("" if values.get(f) is None else values[f] for f in fields)])


def plot_probes(path: Path, comparisons: dict[str, ProbeComparison], title: str) -> Path:
    """Per probe figure, two panels: each run's mean curve over the seeds with its band (t interval of the
    mean), and each seed's AMIR-minus-GRPO curve (grey) with their mean and paired band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pct = f"{CONFIDENCE:.0%}"
    fig, axes = plt.subplots(len(comparisons), 2, figsize=(10, 3.4 * len(comparisons)), squeeze=False)
    for (ax_runs, ax_diff), (figure, probe) in zip(axes, comparisons.items()):
        name = figure.replace("_", " ")
        for label, curves, color in ((BASE, probe.grpo, "tab:blue"), (AMIR, probe.amir, "tab:red")):
            bands = [mean_interval([curve[k] for curve in curves]) for k in range(len(probe.steps))]
            ax_runs.plot(probe.steps, [b[0] for b in bands], "o-", color=color, label=label)
            ax_runs.fill_between(probe.steps, [b[1] for b in bands], [b[2] for b in bands], color=color, alpha=0.2)
        ax_runs.set_title(f"probe {name}: mean over {len(probe.grpo)} seeds, {pct} band", fontsize=9)
        ax_runs.legend(fontsize=8)
        for g, a in zip(probe.grpo, probe.amir):
            ax_diff.plot(probe.steps, [None if x is None or y is None else y - x for x, y in zip(g, a)], "-",
                         color="grey", alpha=0.5, lw=1)
        c = probe.comparison
        ax_diff.plot(probe.steps, [d.mean for d in c.per_checkpoint], "s-", color="black", lw=2, label="mean")
        ax_diff.fill_between(probe.steps, [d.low for d in c.per_checkpoint], [d.high for d in c.per_checkpoint],
                             color="black", alpha=0.15, label=f"{pct} paired t")
        ax_diff.axhline(0, color="tab:grey", lw=0.8)
        band = "" if math.isnan(c.area.low) else f" [{c.area.low:+.3f}, {c.area.high:+.3f}]"
        ax_diff.set_title(f"{AMIR} minus {BASE}, per seed\nmean over training {c.area.mean:+.3f}{band}", fontsize=9)
        ax_diff.legend(fontsize=8)
        for ax in (ax_runs, ax_diff):
            ax.set_xlabel("training step")
            ax.grid(alpha=0.3)
    return _save_figure(fig, path, title)


@stops_on_sigterm
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m amir_verl.study", description=__doc__.splitlines()[0].rstrip(":"))
    p.add_argument("--task", choices=list(TASKS), required=True)
    p.add_argument("--seeds", type=int, default=8, help="number of seeds (pairs of runs)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--steps", type=int, help="training steps of each run (toy only; default the task's)")
    p.add_argument("--workdir", type=Path, help="default: amir_study_<task>")
    p.add_argument("--record", action="store_true", help="also write the table to docs/results/study_<task>.md")
    p.add_argument("overrides", nargs="*", help="extra hydra overrides for every run (after --)")
    args = p.parse_args(argv)
    task = TASKS[args.task]
    if args.seeds < 2:
        p.error("--seeds must be at least 2: a paired interval needs two differences")
    if args.steps is not None and task.default_steps is None:
        p.error(f"--steps: the {task.name} task's steps are its pipeline size's")
    if args.steps is not None and args.steps < 1:
        p.error("--steps must be at least 1")
    steps = args.steps or task.default_steps
    workdir = (args.workdir or Path(f"amir_study_{task.name}")).resolve()
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    start = time.monotonic()
    settings = {"task": task.name, "steps": steps, "overrides": args.overrides}
    if task.setting is not None:  # recorded only where a task has one: older studies stay resumable
        settings["setting"] = task.setting
    try:
        claim_workdir(workdir, settings)
        setting = task.prepare(workdir) if task.prepare is not None else []
        summaries, scores = run_study(task, workdir, seeds, steps, setting, args.overrides)
        probe_set = probe_set_text(task, workdir, list(scores)) if scores else None
    except StudyError as error:
        print(f"[study] error: {error}", file=sys.stderr)
        return error.status
    except KeyboardInterrupt:
        print(f"\n[study] interrupted; finished seeds are kept in {workdir}: rerun the same command to resume",
              file=sys.stderr)
        return 130
    differences = compare(summaries)
    table = study_table(task, summaries, differences)
    steps_text = f"{steps} steps" if steps else "size study"
    title = f"{AMIR} minus {BASE}, {task.name}, {steps_text}, seeds {seeds[0]}-{seeds[-1]}"
    facts = {seed: f for seed in summaries if (f := read_run_facts(task, seed_dir(workdir, seed))) is not None}
    if facts:
        table += "\n\nPer seed, from the runs' verl metrics:\n\n" + facts_table(facts)
    table += "\n" + wall_time_line(workdir, list(summaries))
    figures_png = workdir / "study.png"
    if scores:
        comparisons = compare_probes(scores)
        table += "\n\n" + probe_table(comparisons, probe_set)
        write_probe_csv(workdir / "study_probes.csv", scores)
        plot_probes(workdir / "study.png", comparisons, f"probe set, {title}")
        figures_png = workdir / "study_figures.png"
    (workdir / "study.md").write_text(table + "\n")
    write_csv(workdir / "study.csv", summaries)
    plot_study(figures_png, summaries, differences, title)
    print(f"\n{table}\n")
    if args.record:
        command = "python -m amir_verl.study " + shlex.join(sys.argv[1:] if argv is None else argv)
        # the report's '## ' title as a plain line: the page that includes the file has its own headings
        recorded = write_results(f"study_{task.name}", command, table.removeprefix("## "))
        plot = recorded.parent.parent / f"study_{task.name}.png"  # docs/: the study page shows it
        shutil.copyfile(workdir / "study.png", plot)
        print(f"[study] table recorded in {recorded}, plot in {plot}")
    print(f"[study] {len(seeds)} seeds in {time.monotonic() - start:.0f} s; table {workdir / 'study.md'}, "
          f"per seed {workdir / 'study.csv'}" + (f", probe scores {workdir / 'study_probes.csv'}" if scores else "")
          + f", plot {workdir / 'study.png'}" + (f" and {figures_png}" if scores else ""))
    return 0
