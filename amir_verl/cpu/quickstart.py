"""GRPO against AMIR-GRPO with verl's real ``main_ppo`` on a laptop CPU, in one command:

    python -m amir_verl.cpu.quickstart [--workdir DIR] [--steps N] [--runs grpo,amir_grpo] [--one-at-a-time]
                                       [-- hydra overrides]

It makes a tiny model, tokenizer and toy data (:mod:`amir_verl.cpu.toy_task`), then trains each run
with ``python -m verl.trainer.main_ppo`` on the CPU backend (``AMIR_VERL_CPU=1``, the overrides of
:func:`cpu_overrides`), side by side (each with its own Ray: one run leaves about a third of 2 cores idle;
``--one-at-a-time`` runs them one after the other), from the same model with the same seeds and data order:

- ``grpo``: verl's GRPO, run through the AMIR trainer with lambda fixed at 0, so that the preference
  margin of its rollouts is measured too (the term is computed and weighted 0; the end-to-end test
  ``test_quickstart_trains_grpo_then_amir_and_reports_both_on_a_quiet_console`` checks this equals stock
  GRPO);
- ``amir_grpo``: AMIR-GRPO with the adaptive lambda.

The console gets one line per step; verl's full output goes to ``<workdir>/<run>/main_ppo.log`` and its
metrics to ``<workdir>/<run>/metrics.jsonl``. At the end it prints a summary table (also in
``<workdir>/summary.md``) and writes the comparison plot ``<workdir>/quickstart.png``. Extra arguments
after ``--`` go to every run's main_ppo.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import psutil

from amir_verl.cpu.launch import MainPPOFailed, main_ppo_command, parse_metrics_line, run_main_ppo_together
from amir_verl.cpu.report import plot_runs, progress_line, summary_table
from amir_verl.cpu.toy_task import make_assets

FP32 = "{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}"


def amir_overrides(loss_mode: str = "amir_grpo", *, trainer_mode: str = "amir", **amir: object) -> list[str]:
    """The override set that turns verl's GRPO (or GSPO) run into AMIR, as the README states it; ``trainer_mode``
    picks the schedule (``amir``, ``amir_colocate_async``, ``amir_separate_async``)."""
    return [
        f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}",
        f"trainer.v1.trainer_mode={trainer_mode}",
        "actor_rollout_ref.actor.use_kl_loss=True",
    ] + [f"+amir.{k}={v}" for k, v in amir.items()]


def cpu_overrides(assets: dict[str, str], workdir: Path, steps: int, n_gpus: int = 1, group_size: int = 8,
                  prompts_per_step: int = 8, micro_batch: int = 16, test_freq: int = 2, save_freq: int = -1,
                  seed: int = 0, schedule: str = "sync", local_updates: int = 2) -> list[str]:
    """verl overrides for a GRPO run of the toy task on the CPU backend (no AMIR keys).

    ``workdir`` gets the run's checkpoints (``workdir/checkpoints``, every ``save_freq`` steps). ``schedule``
    is the verl V1 schedule the run's trainer mode runs (:func:`schedule_overrides`)."""
    return [
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=False",
        f"data.train_files={assets['train']}",
        f"data.val_files={assets['test']}",
        f"data.train_batch_size={prompts_per_step}",
        "data.max_prompt_length=32",
        "data.max_response_length=4",
        "data.shuffle=True",
        f"data.seed={seed}",
        # the rows are read in the trainer's process: worker processes only cost start-up time, and Ray's
        # shutdown of the TaskRunner used to kill them mid-iteration ("DataLoader worker ... is killed")
        "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={assets['model']}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.model.use_remove_padding=False",
        "actor_rollout_ref.actor.strategy=fsdp2",
        f"+actor_rollout_ref.actor.fsdp_config.mixed_precision={FP32}",
        f"+actor_rollout_ref.ref.fsdp_config.mixed_precision={FP32}",
        "actor_rollout_ref.actor.optim.lr=3e-3",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts_per_step}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro_batch}",
        "actor_rollout_ref.actor.kl_loss_coef=0.0",
        "actor_rollout_ref.actor.entropy_coeff=0",
        f"actor_rollout_ref.actor.data_loader_seed={seed}",
        "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.n={group_size}",
        f"actor_rollout_ref.rollout.seed={seed}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro_batch}",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "actor_rollout_ref.rollout.val_kwargs.n=4",
        "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=True",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro_batch}",
        "reward.custom_reward_function.path=pkg://amir_verl.cpu.toy_task",
        "reward.custom_reward_function.name=compute_score",
        "reward.num_workers=1",
        f"trainer.n_gpus_per_node={n_gpus}",
        "trainer.nnodes=1",
        "trainer.logger=[console]",
        "trainer.project_name=amir_cpu",
        f"trainer.experiment_name={workdir.name}",
        f"trainer.total_training_steps={steps}",
        f"trainer.test_freq={test_freq}",
        f"trainer.save_freq={save_freq}",
        "trainer.val_before_train=True",
        f"trainer.default_local_dir={workdir / 'checkpoints'}",
        "+ray_kwargs.ray_init.num_cpus=16",  # logical: verl's workers, TransferQueue and reward actors
        # logical GPUs: verl's resource pools ask for them (separate_async: one more, its standalone rollout's)
        f"+ray_kwargs.ray_init.num_gpus={n_gpus + (schedule == 'separate_async')}",
        "+ray_kwargs.ray_init.include_dashboard=False",
        # a Ray of this run's own: ray.init() would otherwise join the cluster named by RAY_ADDRESS or the
        # last `ray start` on this machine, and fail there on num_cpus / num_gpus
        "+ray_kwargs.ray_init.address=local",
        # one TransferQueue storage actor instead of 8: each is a Python process that takes seconds to start
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    ] + schedule_overrides(schedule, prompts_per_step, local_updates)


def schedule_overrides(schedule: str, prompts_per_step: int, local_updates: int = 2) -> list[str]:
    """What verl's V1 ``schedule`` needs on the CPU backend besides the trainer mode: nothing for ``sync`` and
    ``colocate_async``; for ``separate_async`` a standalone rollout replica on a logical GPU of its own, its
    weights through the checkpoint engine ``cpu_object_store``, and ``local_updates`` local updates per step
    (verl requires train_batch_size = parameter_sync_step x ppo_mini_batch_size)."""
    if schedule in ("sync", "colocate_async"):
        return []
    if schedule != "separate_async":
        raise ValueError(f"unknown verl V1 schedule {schedule!r}")
    if prompts_per_step % local_updates:
        raise ValueError(f"{prompts_per_step} prompts per step do not split into {local_updates} local updates")
    return [
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=cpu_object_store",
        f"trainer.v1.separate_async.parameter_sync_step={local_updates}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts_per_step // local_updates}",
    ]



# name -> (label, AMIR overrides); both start from the same model, seeds and data order
RUNS = {
    "grpo": ("GRPO", amir_overrides(beta_dpo=0.5, lambda_rule="fixed", lambda_init=0.0)),
    "amir_grpo": ("AMIR-GRPO", amir_overrides(beta_dpo=0.5)),  # the default lambda rule
}
MARKER = ".amir_quickstart"  # in a workdir the quickstart made; holds the pid of the quickstart using it
RUN_TIMEOUT_S = 1200
VALIDATION_EVERY = 10  # steps; and before training


def run_overrides(assets: dict[str, str], run_dir: Path, steps: int, seed: int, variant: list[str],
                  extra: list[str] = ()) -> list[str]:
    """One quickstart run's main_ppo overrides: the CPU GRPO run of the toy task validated every
    ``VALIDATION_EVERY`` steps, then the variant's (a :data:`RUNS` entry), then the user's."""
    return cpu_overrides(assets, run_dir, steps, test_freq=VALIDATION_EVERY, seed=seed) + variant + list(extra)


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
        "amir_verl.cpu.quickstart" in part for part in _cmdline(owner)
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


def write_report(workdir: Path, results: dict[str, dict[int, dict[str, float]]], title: str) -> tuple[str, Path]:
    table = summary_table(results)
    (workdir / "summary.md").write_text(table + "\n")
    return table, plot_runs(results, workdir / "quickstart.png", title)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", type=Path, default=Path("amir_cpu_quickstart"),
                   help="a new or empty folder, or one an earlier quickstart made (its runs are redone)")
    p.add_argument("--steps", type=int, default=40, help="training steps of each run")
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
            commands[run] = main_ppo_command(overrides, log_path=run_dir / "main_ppo.log", on_line=progress[run])
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
