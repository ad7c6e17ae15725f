"""What a CPU run of main_ppo says while it trains: one console line per step, and its metrics to
``metrics.jsonl``, as the demo and the paper pipeline show them (from verl's console metric lines,
:func:`amir_verl.cpu.launch.parse_metrics_line`)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from amir_verl.cpu.launch import parse_metrics_line
from amir_verl.metrics import LAMBDA, MARGIN, NUM_PAIRS, REWARD, STEP_TIME, format_value


def _validation_keys(metrics: dict[str, float]) -> list[str]:
    return sorted(k for k in metrics if k.startswith("val-core/") and "/acc/mean@" in k)


def validation_accuracy(metrics: dict[str, float]) -> float | None:
    """verl's validation accuracy of a step (``val-core/<data source>/acc/mean@<n>``), with several data sources
    their unweighted mean (each benchmark counts once); None if the step was not validated."""
    keys = _validation_keys(metrics)
    return sum(metrics[k] for k in keys) / len(keys) if keys else None


def _accuracy_text(metrics: dict[str, float]) -> str:
    sources = len(_validation_keys(metrics))
    return format_value(validation_accuracy(metrics)) + (f" (mean of {sources} benchmarks)" if sources > 1 else "")


def pair_metric(metrics: dict[str, float], key: str) -> float | None:
    """An ``amir/`` pair statistic of a step, None when the step mined no pair (verl logs 0 then)."""
    return metrics.get(key) if metrics.get(NUM_PAIRS) else None


def progress_line(run: str, step: int, total_steps: int, metrics: dict[str, float]) -> str:
    """One console line for one step of one run."""
    if step == 0:
        return f"[{run}] step  0/{total_steps}  validation before training: acc {_accuracy_text(metrics)}"
    parts = [f"[{run}] step {step:2d}/{total_steps}", f"reward {format_value(metrics.get(REWARD))}"]
    if validation_accuracy(metrics) is not None:
        parts.append(f"val acc {_accuracy_text(metrics)}")
    parts += [f"margin {format_value(pair_metric(metrics, MARGIN), '+.3f')}",
              f"pairs {format_value(metrics.get(NUM_PAIRS), '.0f')}", f"lambda {format_value(metrics.get(LAMBDA))}",
              f"{format_value(metrics.get(STEP_TIME), '.1f')} s"]
    return "  ".join(parts)


_CONSOLE = threading.Lock()


class RunProgress:
    """Reads a run's main_ppo output line by line: metrics to ``metrics.jsonl``, one console line per step."""

    def __init__(self, run: str, run_dir: Path, total_steps: int):
        self.run, self.total_steps = run, total_steps
        self.steps: dict[int, dict[str, float]] = {}
        self._jsonl = open(run_dir / "metrics.jsonl", "w", buffering=1)

    def __call__(self, line: str) -> None:
        parsed = parse_metrics_line(line)
        if parsed is None:
            return
        step, metrics = parsed
        self.steps.setdefault(step, {}).update(metrics)
        self._jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        with _CONSOLE:  # runs side by side print from their own reader threads: whole lines only
            print(progress_line(self.run, step, self.total_steps, metrics), flush=True)

    def close(self) -> None:
        self._jsonl.close()
