"""The quickstart's report: the summary table and the comparison plot (the console lines: :mod:`amir_verl.cpu.progress`).

Everything here is a function of verl's logged metrics, ``{step: {key: value}}`` per run, as verl's file logger
writes them (:func:`amir_verl.cpu.launch.read_verl_metrics`); step 0 holds the validation before training.
"""

from __future__ import annotations

from pathlib import Path

from amir_verl.cpu.progress import pair_metric, validation_accuracy
from amir_verl.metrics import GRAD_SHARE, LAMBDA, MARGIN, PAIR_ACCURACY, REWARD
from amir_verl.metrics import format_value
from amir_verl import run_figures

SUMMARY_WINDOW = 5  # the table's reward at start / end: mean over the first / last this many steps

def _series(steps: dict[int, dict[str, float]], value) -> tuple[list[int], list[float]]:
    points = [(s, value(m)) for s, m in sorted(steps.items())]
    points = [(s, v) for s, v in points if v is not None]
    return [s for s, _ in points], [v for _, v in points]


def moving_average(values: list[float], window: int = SUMMARY_WINDOW) -> list[float]:
    """Mean of each value and the up to ``window - 1`` before it."""
    return [sum(values[max(0, i + 1 - window):i + 1]) / len(values[max(0, i + 1 - window):i + 1])
            for i in range(len(values))]


def _plot_smoothed(ax, steps: list[int], values: list[float], color: str, label: str) -> None:
    """The per-step values thin, their moving average over ``SUMMARY_WINDOW`` steps bold."""
    ax.plot(steps, values, color=color, alpha=0.3, lw=0.8)
    ax.plot(steps, moving_average(values), color=color, lw=2, label=f"{label} ({SUMMARY_WINDOW}-step mean)")


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summary_rows(runs: dict[str, dict[int, dict[str, float]]]) -> list[dict[str, float | None | str]]:
    """One row per run: reward over the first / last ``SUMMARY_WINDOW`` steps, validation accuracy at the
    first / last validation, margin and pair accuracy over the last ``SUMMARY_WINDOW`` steps that mined
    pairs (one step's value is noisy), and the last step's lambda and preference share."""
    rows = []
    for name, steps in runs.items():
        train_steps = {s: m for s, m in steps.items() if s > 0}
        _, rewards = _series(train_steps, lambda m: m.get(REWARD))
        _, accuracies = _series(steps, validation_accuracy)
        _, margins = _series(train_steps, lambda m: pair_metric(m, MARGIN))
        _, pair_accuracies = _series(train_steps, lambda m: pair_metric(m, PAIR_ACCURACY))
        last = train_steps[max(train_steps)] if train_steps else {}
        rows.append({
            "run": name,
            "steps": max(train_steps, default=0),
            "reward_start": _mean(rewards[:SUMMARY_WINDOW]),
            "reward_end": _mean(rewards[-SUMMARY_WINDOW:]),
            "val_acc_start": accuracies[0] if accuracies else None,
            "val_acc_end": accuracies[-1] if accuracies else None,
            "margin": _mean(margins[-SUMMARY_WINDOW:]),
            "pair_accuracy": _mean(pair_accuracies[-SUMMARY_WINDOW:]),
            "lambda": last.get(LAMBDA),
            "pref_share": last.get(GRAD_SHARE),
        })
    return rows


# how the demo measures the figures it writes to summary.json (amir_verl.run_figures)
FIGURE_DEFINITIONS = {
    run_figures.REWARD: f"mean score of the rollouts over the last {SUMMARY_WINDOW} steps",
    run_figures.VALIDATION_ACCURACY: "validation accuracy (mean@4 samples of every validation prompt) at the last validation",
    run_figures.MARGIN: f"{MARGIN} over the last {SUMMARY_WINDOW} steps that mined pairs (training rollouts, "
                        "preferred minus rejected)",
    run_figures.PAIR_ACCURACY: f"{PAIR_ACCURACY} over the last {SUMMARY_WINDOW} steps that mined pairs (share "
                               "of pairs with z > 0)",
}
NO_BRIER = "the toy task's responses state no confidence"


def summary_figures(runs: dict[str, dict[int, dict[str, float]]]) -> dict[str, dict[str, float | None]]:
    """{run: the figures of :mod:`amir_verl.run_figures`}, from the same rows as the table."""
    return {row["run"]: {run_figures.REWARD: row["reward_end"], run_figures.VALIDATION_ACCURACY: row["val_acc_end"],
                         run_figures.MARGIN: row["margin"], run_figures.PAIR_ACCURACY: row["pair_accuracy"],
                         run_figures.BRIER: None} for row in summary_rows(runs)}


def summary_table(runs: dict[str, dict[int, dict[str, float]]]) -> str:
    """The summary rows as a Markdown table (readable on the console too)."""
    header = (f"| run | steps | reward, first {SUMMARY_WINDOW} -> last {SUMMARY_WINDOW} steps | val acc, first -> last "
              f"| margin, last {SUMMARY_WINDOW} | pair acc, last {SUMMARY_WINDOW} | lambda, last | pref share, last |")
    lines = [header, "|---|---|---|---|---|---|---|---|"]
    for row in summary_rows(runs):
        lines.append(
            f"| {row['run']} | {row['steps']} | {format_value(row['reward_start'])} -> {format_value(row['reward_end'])} "
            f"| {format_value(row['val_acc_start'])} -> {format_value(row['val_acc_end'])} | {format_value(row['margin'], '+.3f')} "
            f"| {format_value(row['pair_accuracy'], '.2f')} | {format_value(row['lambda'])} | {format_value(row['pref_share'], '.2f')} |"
        )
    return "\n".join(lines)


def plot_runs(runs: dict[str, dict[int, dict[str, float]]], out_path: Path, title: str) -> Path:
    """A 2 x 2 figure, runs on shared axes: training reward, validation accuracy, preference margin
    (mean length-normalised log-prob of the preferred minus the rejected response of each pair), and lambda
    with the preference term's share of the gradient (runs with lambda > 0). Written as PNG to ``out_path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    (reward_ax, val_ax), (margin_ax, lambda_ax) = axes
    share_ax = lambda_ax.twinx()
    for (name, steps), color in zip(runs.items(), ["tab:blue", "tab:red", "tab:green", "tab:purple"]):
        train_steps = {s: m for s, m in steps.items() if s > 0}
        _plot_smoothed(reward_ax, *_series(train_steps, lambda m: m.get(REWARD)), color, name)
        val_ax.plot(*_series(steps, validation_accuracy), "o-", color=color, label=name)
        _plot_smoothed(margin_ax, *_series(train_steps, lambda m: pair_metric(m, MARGIN)), color, name)
        if any(m.get(LAMBDA) for m in train_steps.values()):  # runs with a preference term
            lambda_ax.plot(*_series(train_steps, lambda m: m.get(LAMBDA)), color=color, label=f"{name}: lambda")
            share_ax.plot(*_series(train_steps, lambda m: pair_metric(m, GRAD_SHARE)), "--", color=color,
                          label=f"{name}: preference share")
    margin_ax.axhline(0.0, color="grey", lw=0.8)
    reward_ax.set(title="training reward (mean score of the step's rollouts)", ylabel="score")
    val_ax.set(title="validation accuracy (mean@4 samples)", ylabel="accuracy")
    margin_ax.set(title="preference margin: correct minus incorrect responses", ylabel="mean log-prob per token",
                  xlabel="step")
    lambda_ax.set(title="lambda and preference share of the gradient", ylabel="lambda", xlabel="step")
    share_ax.set_ylabel("preference share")
    for ax in (reward_ax, val_ax, margin_ax):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    handles = lambda_ax.get_legend_handles_labels()[0] + share_ax.get_legend_handles_labels()[0]
    if handles:
        lambda_ax.legend(handles, [h.get_label() for h in handles], fontsize=8)
    lambda_ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path
