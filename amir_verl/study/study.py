"""Does AMIR change the margin and the accuracy? GRPO against AMIR-GRPO over several seeds, with statistics:

    python -m amir_verl.study --task toy|smollm2 [--seeds 8] [--first-seed 0] [--steps N] [--workdir DIR]
                              [--record] [-- hydra overrides for every run]

For each seed it runs one pair, GRPO and AMIR-GRPO side by side from the same start with the same seeds:

- ``toy``: the demo (:mod:`amir_verl.demo.quickstart`, ``--seed S``; ``--steps``, default its 40). The seed
  sets the data order, the rollout sampling and the actor's mini-batches; the tiny model is the same on
  every seed. GRPO is run through the AMIR trainer with lambda 0, so its pairs are measured too.
- ``smollm2``: the paper pipeline (:mod:`amir_verl.paper_pipeline.pipeline`, ``--size study --seed S``) on
  SmolLM2-135M-Instruct. The seed sets the generated data, the cold start, the initial LoRA adapter (shared
  by the pair) and the sampling; the study raises the recipe's learning rate (:data:`SMOLLM2_STUDY_OVERRIDES`)
  and gives the AMIR run a fixed lambda of 2 (:data:`SMOLLM2_STUDY_AMIR_OVERRIDES`).

Each pair writes its figures to ``<workdir>/seed_<S>/summary.json`` (:mod:`amir_verl.run_figures`). The study
then reports, per figure, AMIR minus GRPO seed by seed and its mean with a 95% paired t interval
(:mod:`amir_verl.study.statistics`): ``<workdir>/study.md`` (also printed), ``study.csv`` (every seed's
figures) and ``study.png``; with ``--record`` the table goes to ``docs/results/study_<task>.md`` too
(:mod:`amir_verl.results_page`), where the documentation includes it. It resumes: a seed whose summary.json
exists is read, not rerun, as long as the task, steps and overrides are those recorded in
``<workdir>/study.json``; a seed stopped halfway is redone.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from amir_verl import run_figures
from amir_verl.cpu.launch import stops_on_sigterm
from amir_verl.metrics import format_value
from amir_verl.paper_pipeline import VARIANTS
from amir_verl.results_page import write_results
from amir_verl.study.statistics import CONFIDENCE, PairedDifference, paired_difference

BASE, AMIR = VARIANTS["grpo"], VARIANTS["amir_grpo"]  # the pair's labels in summary.json (the demo's too)
# The study's deviations from the paper recipe on SmolLM2, each measured on seed 0 (docs/study.md, "Deviations from the
# recipe"). Every run gets lr 1e-3: at the recipe's 5e-6 a few LoRA steps moved the merged weights
# by under 1e-6 and changed no sampled response; at 2e-4 still no response changed. The AMIR run gets a fixed
# lambda of 2: the recipe's rule (loss_ratio, the official code's) held lambda at its floor, 0.005, and the
# package's grad_share at 0.5 with the term at 0.1-0.2 of the gradient; with either, at 2e-4, AMIR-GRPO generated
# GRPO's responses at every step. At lr 1e-3 and lambda 2 the policies part within the 4 steps (step-2 rewards
# and the validation differ); a smaller setting would measure a difference of zero by construction.
SMOLLM2_STUDY_OVERRIDES = ("actor_rollout_ref.actor.optim.lr=1e-3",)
SMOLLM2_STUDY_AMIR_OVERRIDES = ("amir.lambda_rule=fixed", "+amir.lambda_init=2.0")


@dataclass(frozen=True)
class Task:
    """How one seed's pair is trained: ``command(seed_dir, seed, steps, overrides)`` is the argv of a
    ``main(argv) -> exit status`` that leaves summary.json in ``seed_dir``."""

    name: str
    description: str
    default_steps: int | None  # None: the task's size fixes the steps (--steps is refused)
    main: Callable[[list[str]], int]
    argv: Callable[[Path, int, int | None, list[str]], list[str]]


def _toy_main(argv: list[str]) -> int:
    from amir_verl.demo import quickstart

    return quickstart.main(argv)


def _smollm2_main(argv: list[str]) -> int:
    from amir_verl.paper_pipeline import pipeline

    return pipeline.main(argv)


TASKS = {
    "toy": Task("toy", "the demo's toy task (tiny Qwen2-shaped model)", 40, _toy_main,
                lambda d, seed, steps, extra: ["--workdir", str(d), "--seed", str(seed), "--steps", str(steps),
                                               "--", *extra]),
    "smollm2": Task("smollm2", "the paper pipeline on SmolLM2-135M-Instruct (size `study`)", None, _smollm2_main,
                    lambda d, seed, steps, extra: ["--workdir", str(d), "--size", "study", "--seed", str(seed),
                                                   *(f"--amir-override={o}" for o in SMOLLM2_STUDY_AMIR_OVERRIDES),
                                                   "--", *SMOLLM2_STUDY_OVERRIDES, *extra]),
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
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _figures_line(summary: dict, label: str) -> str:
    values = summary["runs"][label]
    return "  ".join(f"{figure} {format_value(values[figure], '.3f')}" for figure in run_figures.FIGURES
                     if figure not in summary["not_measured"])


def run_study(task: Task, workdir: Path, seeds: list[int], steps: int | None, overrides: list[str]) -> dict[int, dict]:
    """Train the seeds not done yet, one pair at a time; returns {seed: summary.json}."""
    summaries: dict[int, dict] = {}
    durations: list[float] = []
    for number, seed in enumerate(seeds, start=1):
        folder = seed_dir(workdir, seed)
        if (folder / run_figures.SUMMARY_FILE).exists():
            summaries[seed] = read_pair(folder)
            print(f"[study] seed {seed} ({number} of {len(seeds)}): done earlier, read {folder / run_figures.SUMMARY_FILE}",
                  flush=True)
            continue
        print(f"[study] seed {seed} ({number} of {len(seeds)}): training {BASE} and {AMIR} in {folder}", flush=True)
        start = time.monotonic()
        status = task.main(task.argv(folder, seed, steps, overrides))
        if status == 130:  # the demo and the pipeline catch Ctrl-C themselves, stop their runs and return 130
            raise KeyboardInterrupt
        if status != 0:
            raise StudyError(f"seed {seed}: the {task.name} pair stopped with exit status {status} (its output is "
                             f"above; logs in {folder}); rerun the same command to resume from seed {seed}")
        summaries[seed] = read_pair(folder)
        durations.append(time.monotonic() - start)
        left = sum(1 for s in seeds[number:] if not (seed_dir(workdir, s) / run_figures.SUMMARY_FILE).exists())
        for label in (BASE, AMIR):
            print(f"[study] seed {seed} {label}: {_figures_line(summaries[seed], label)}", flush=True)
        print(f"[study] seed {seed} done in {durations[-1]:.0f} s; {len(seeds) - number} seed(s) to go"
              + (f", about {left * sum(durations) / len(durations) / 60:.0f} min" if left else ""), flush=True)
    return summaries


@stops_on_sigterm
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m amir_verl.study", description=__doc__.splitlines()[0].rstrip(":"))
    p.add_argument("--task", choices=list(TASKS), required=True)
    p.add_argument("--seeds", type=int, default=8, help="number of seeds (pairs of runs)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--steps", type=int, help="training steps of each run (toy only; default the demo's 40)")
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
    try:
        claim_workdir(workdir, {"task": task.name, "steps": steps, "overrides": args.overrides})
        summaries = run_study(task, workdir, seeds, steps, args.overrides)
    except StudyError as error:
        print(f"[study] error: {error}", file=sys.stderr)
        return error.status
    except KeyboardInterrupt:
        print(f"\n[study] interrupted; finished seeds are kept in {workdir}: rerun the same command to resume",
              file=sys.stderr)
        return 130
    differences = compare(summaries)
    table = study_table(task, summaries, differences)
    (workdir / "study.md").write_text(table + "\n")
    write_csv(workdir / "study.csv", summaries)
    steps_text = f"{steps} steps" if steps else "size study"
    png = plot_study(workdir / "study.png", summaries, differences,
                     f"{AMIR} minus {BASE}, {task.name}, {steps_text}, seeds {seeds[0]}-{seeds[-1]}")
    print(f"\n{table}\n")
    if args.record:
        command = "python -m amir_verl.study " + shlex.join(sys.argv[1:] if argv is None else argv)
        # the report's '## ' title as a plain line: the page that includes the file has its own headings
        recorded = write_results(f"study_{task.name}", command, table.removeprefix("## "))
        print(f"[study] table recorded in {recorded}")
    print(f"[study] {len(seeds)} seeds in {time.monotonic() - start:.0f} s; table {workdir / 'study.md'}, "
          f"per seed {workdir / 'study.csv'}, plot {png}")
    return 0
