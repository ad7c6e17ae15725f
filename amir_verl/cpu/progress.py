"""What a CPU run of main_ppo says while it trains: one console line per step, and its metrics to
``metrics.jsonl``, as the demo and the paper pipeline show them (from verl's file logger,
:func:`amir_verl.cpu.launch.verl_metrics_path`)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from amir_verl.cpu.launch import parse_verl_metrics_record, print_line, verl_metrics_path
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


class RunProgress:
    """Follows a run whose verl output goes to ``run_dir/main_ppo.log``: each step's metrics, as verl's file
    logger writes them (:func:`amir_verl.cpu.launch.verl_metrics_path`), to ``run_dir/metrics.jsonl`` (one
    ``{"step": N, key: value, ...}`` a step) and one console line per step.

    Called with each line of the run's output (``on_line``), it reads what the file logger added since; ``close``
    reads the rest. Not from verl's console line: Ray forwards a long line in pieces under load, and the pieces
    that do not hold ``step:`` would be lost."""

    def __init__(self, run: str, run_dir: Path, total_steps: int):
        self.run, self.total_steps = run, total_steps
        self.steps: dict[int, dict[str, float]] = {}
        self.log_path = run_dir / "main_ppo.log"
        self._source = verl_metrics_path(self.log_path)
        self._source.unlink(missing_ok=True)  # an earlier run's, until verl opens it afresh
        self._read_to, self._partial = 0, b""
        self._lock = threading.Lock()  # the output reader thread and close()
        self._jsonl = open(run_dir / "metrics.jsonl", "w", buffering=1)

    def __call__(self, line: str) -> None:
        with self._lock:
            self._read_new_records()

    def _read_new_records(self) -> None:
        try:
            with open(self._source, "rb") as source:
                source.seek(self._read_to)
                chunk = source.read()
        except FileNotFoundError:
            return
        self._read_to += len(chunk)
        *records, self._partial = (self._partial + chunk).split(b"\n")  # a record still being written waits
        for raw in filter(bytes.strip, records):
            step, metrics = parse_verl_metrics_record(raw)
            self.steps.setdefault(step, {}).update(metrics)
            self._jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
            print_line(progress_line(self.run, step, self.total_steps, metrics))  # from a reader thread

    def close(self) -> None:
        with self._lock:
            if not self._jsonl.closed:
                self._read_new_records()
                self._jsonl.close()
