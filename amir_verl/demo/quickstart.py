"""GRPO against AMIR-GRPO with verl's real ``main_ppo`` on a laptop CPU, in one command:

    python -m amir_verl.demo.quickstart [--workdir DIR] [--steps N] [--runs grpo,amir_grpo] [--one-at-a-time]
                                       [-- hydra overrides]

It makes a tiny model, tokenizer and toy data (:mod:`amir_verl.demo.toy_task`), then trains each run
with ``python -m verl.trainer.main_ppo`` on the CPU backend (``AMIR_VERL_CPU=1``, the overrides of
:func:`toy_grpo_overrides`), side by side (each with its own Ray: one run leaves about a third of 2 cores idle;
``--one-at-a-time`` runs them one after the other), from the same model with the same seeds and data order:

- ``grpo``: verl's GRPO, run through the AMIR trainer with lambda fixed at 0, so that the preference
  margin of its rollouts is measured too (the term is computed and weighted 0; the end-to-end test
  ``test_quickstart_trains_grpo_then_amir_and_reports_both_on_a_quiet_console`` checks this equals stock
  GRPO);
- ``amir_grpo``: AMIR-GRPO with the adaptive lambda.

The console gets one line per step; verl's full output goes to ``<workdir>/<run>/main_ppo.log`` and its
metrics to ``<workdir>/<run>/metrics.jsonl``. At the end it prints a summary table (also in
``<workdir>/summary.md``, its figures in ``<workdir>/summary.json``: :mod:`amir_verl.run_figures`) and writes
the comparison plot ``<workdir>/quickstart.png``. Extra arguments
after ``--`` go to every run's main_ppo.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import psutil

from amir_verl.cpu.launch import MainPPOFailed, main_ppo_command, run_main_ppo_together, stops_on_sigterm
from amir_verl.cpu.progress import RunProgress
from amir_verl.cpu.settings import cpu_settings, schedule_overrides
from amir_verl.demo.report import FIGURE_DEFINITIONS, NO_BRIER, plot_runs, summary_figures, summary_table
from amir_verl.demo.toy_task import make_assets
from amir_verl.run_config import amir_overrides
from amir_verl.run_figures import BRIER, write_summary

def toy_grpo_overrides(assets: dict[str, str], workdir: Path, steps: int, n_gpus: int = 1, group_size: int = 8,
                       prompts_per_step: int = 8, micro_batch: int = 16, test_freq: int = 2, save_freq: int = -1,
                       seed: int = 0, schedule: str = "sync", local_updates: int = 2) -> list[str]:
    """The toy task's whole GRPO run on the CPU backend (no AMIR keys): the CPU settings
    (:func:`amir_verl.cpu.settings.cpu_settings`) and the task's data, model, batch and trainer keys.

    ``workdir`` gets the run's checkpoints (``workdir/checkpoints``, every ``save_freq`` steps). ``schedule``
    is the verl V1 schedule the run's trainer mode runs (:func:`amir_verl.cpu.settings.schedule_overrides`)."""
    return cpu_settings(logical_gpus=n_gpus + (schedule == "separate_async")) + [
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=False",
        f"data.train_files={assets['train']}",
        f"data.val_files={assets['test']}",
        f"data.train_batch_size={prompts_per_step}",
        "data.max_prompt_length=32",
        "data.max_response_length=4",
        "data.shuffle=True",
        f"data.seed={seed}",
        f"actor_rollout_ref.model.path={assets['model']}",
        "actor_rollout_ref.actor.optim.lr=3e-3",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts_per_step}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro_batch}",
        "actor_rollout_ref.actor.kl_loss_coef=0.0",
        "actor_rollout_ref.actor.entropy_coeff=0",
        f"actor_rollout_ref.actor.data_loader_seed={seed}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.n={group_size}",
        f"actor_rollout_ref.rollout.seed={seed}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro_batch}",
        "actor_rollout_ref.rollout.val_kwargs.n=4",
        "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=True",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro_batch}",
        "reward.custom_reward_function.path=pkg://amir_verl.demo.toy_task",
        "reward.custom_reward_function.name=compute_score",
        f"trainer.n_gpus_per_node={n_gpus}",
        "trainer.nnodes=1",
        "trainer.project_name=amir_cpu",
        f"trainer.experiment_name={workdir.name}",
        f"trainer.total_training_steps={steps}",
        f"trainer.test_freq={test_freq}",
        f"trainer.save_freq={save_freq}",
        "trainer.val_before_train=True",
        f"trainer.default_local_dir={workdir / 'checkpoints'}",
    ] + schedule_overrides(schedule, prompts_per_step, local_updates)


# name -> (label, AMIR overrides); both start from the same model, seeds and data order
RUNS = {
    "grpo": ("GRPO", amir_overrides(beta_dpo=0.5, lambda_rule="fixed", lambda_init=0.0)),
    "amir_grpo": ("AMIR-GRPO", amir_overrides(beta_dpo=0.5)),  # the default lambda rule
}
MARKER = ".amir_quickstart"  # in a workdir the quickstart made; holds the pid of the quickstart using it
RUN_TIMEOUT_S = 1200
VALIDATION_EVERY = 10  # steps; and before training
DEFAULT_WORKDIR, DEFAULT_STEPS = Path("amir_cpu_quickstart"), 40  # what the README's demo command runs


def run_overrides(assets: dict[str, str], run_dir: Path, steps: int, seed: int, variant: list[str],
                  extra: list[str] = ()) -> list[str]:
    """One quickstart run's main_ppo overrides: the CPU GRPO run of the toy task validated every
    ``VALIDATION_EVERY`` steps, then the variant's (a :data:`RUNS` entry), then the user's."""
    return toy_grpo_overrides(assets, run_dir, steps, test_freq=VALIDATION_EVERY, seed=seed) + variant + list(extra)


class QuickstartError(Exception):
    """Bad use; the message is the one line the user sees."""


def prepare_workdir(workdir: Path, runs: list[str]) -> None:
    """Make ``workdir`` (or reuse one the quickstart made, clearing the runs about to be redone) and claim it.

    Refuses, with a :class:`QuickstartError`, a path that is a file, a folder with other content, a folder
    another running quickstart uses, and a folder it cannot write to."""
    marker = workdir / MARKER
    if workdir.exists() and not workdir.is_dir():
        raise QuickstartError(f"--workdir {workdir} is a file; give a folder")
    if workdir.is_dir() and any(workdir.iterdir()) and not marker.exists():
        raise QuickstartError(f"--workdir {workdir} already holds other files; give a new or empty folder "
                              "(the quickstart reuses only folders it made)")
    try:
        owner = int(marker.read_text() or 0) if marker.exists() else 0
    except (ValueError, OSError):
        owner = 0
    if owner and owner != os.getpid() and psutil.pid_exists(owner) and any(
        "amir_verl.demo.quickstart" in part for part in _cmdline(owner)
    ):
        raise QuickstartError(f"another quickstart (pid {owner}) is running in {workdir}; "
                              "wait for it or give another --workdir")
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        marker.write_text(str(os.getpid()))
        for run in runs:  # an old run's checkpoints would make verl resume it instead of training
            shutil.rmtree(workdir / run, ignore_errors=True)
            (workdir / run).mkdir()
    except PermissionError:
        raise QuickstartError(f"cannot write in --workdir {workdir} (permission denied); "
                              "give a folder you can write to") from None
    except OSError as error:
        raise QuickstartError(f"cannot use --workdir {workdir}: {error.strerror or error}") from None


def _cmdline(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return []


def write_report(workdir: Path, results: dict[str, dict[int, dict[str, float]]], title: str) -> tuple[str, Path]:
    table = summary_table(results)
    (workdir / "summary.md").write_text(table + "\n")
    write_summary(workdir, "toy", summary_figures(results), FIGURE_DEFINITIONS, {BRIER: NO_BRIER})
    return table, plot_runs(results, workdir / "quickstart.png", title)


@stops_on_sigterm
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR,
                   help="a new or empty folder, or one an earlier quickstart made (its runs are redone)")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="training steps of each run")
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, from: {', '.join(RUNS)}")
    p.add_argument("--seed", type=int, default=0, help="data order, rollout sampling and actor mini-batches")
    p.add_argument("--timeout", type=float, default=RUN_TIMEOUT_S, help="seconds allowed per run")
    p.add_argument("--one-at-a-time", action="store_true",
                   help="train the runs one after the other instead of side by side (same results, slower)")
    p.add_argument("overrides", nargs="*", help="extra hydra overrides for main_ppo (after --)")
    args = p.parse_args(argv)
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = [r for r in runs if r not in RUNS]
    if unknown or not runs:
        p.error(f"--runs: unknown {unknown or 'empty'}; choose from {', '.join(RUNS)}")
    if args.steps < 1:
        p.error("--steps must be at least 1")
    workdir = args.workdir.resolve()
    try:
        prepare_workdir(workdir, runs)
    except QuickstartError as error:
        print(f"[quickstart] error: {error}", file=sys.stderr)
        return 2

    start = time.monotonic()
    results: dict[str, dict[int, dict[str, float]]] = {}
    title = f"toy task, {args.steps} steps, seed {args.seed}"
    progress: dict[str, RunProgress] = {}
    batch: list[str] = []
    try:
        print(f"[quickstart] tiny model, tokenizer and toy data in {workdir}", flush=True)
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # "Writing model shards" would be the only bar on the console
        assets = make_assets(workdir)
        commands = {}
        for run in runs:
            label, amir = RUNS[run]
            run_dir = workdir / run
            overrides = run_overrides(assets, run_dir, args.steps, args.seed, amir, args.overrides)
            (run_dir / "command.txt").write_text(
                "AMIR_VERL_CPU=1 python -m verl.trainer.main_ppo \\\n    " + " \\\n    ".join(overrides) + "\n")
            progress[run] = RunProgress(run, run_dir, args.steps)
            results[label] = progress[run].steps
            commands[run] = main_ppo_command(overrides, log_path=progress[run].log_path, on_line=progress[run])
        for batch in [[run] for run in runs] if args.one_at_a_time else [runs]:
            for run in batch:
                print(f"[{run}] {RUNS[run][0]}: starting main_ppo (Ray, workers, model); "
                      f"verl's output: {workdir / run / 'main_ppo.log'}", flush=True)
            batch_start = time.monotonic()
            run_main_ppo_together({run: commands[run] for run in batch}, timeout=args.timeout)
            print(f"[{', '.join(batch)}] done in {time.monotonic() - batch_start:.0f} s", flush=True)
    except KeyboardInterrupt:
        where = ", ".join(f"{run} at step {max(progress[run].steps, default=0)}" for run in batch) or "set-up"
        print(f"\n[quickstart] interrupted during {where}: "
              f"partial results in {workdir} (<run>/main_ppo.log, <run>/metrics.jsonl)", file=sys.stderr)
        return 130
    except MainPPOFailed as failure:
        print(f"[quickstart] {failure.run} failed: {failure.reason}; full log: {failure.log_path}", file=sys.stderr)
        return 1
    except TimeoutError as error:
        print(f"[quickstart] {error}; partial logs: {workdir}/<run>/main_ppo.log", file=sys.stderr)
        return 1
    finally:
        for run_progress in progress.values():
            run_progress.close()

    table, png = write_report(workdir, results, title)
    print(f"\n{table}\n")
    print(f"[quickstart] {len(runs)} run(s) in {time.monotonic() - start:.0f} s; plot: {png}; "
          f"table: {workdir / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
