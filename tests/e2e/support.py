"""What the end-to-end modules share: a CPU GRPO run of the toy task as a command, and runs side by side."""

from __future__ import annotations

from pathlib import Path

from amir_verl.cpu.launch import LoggedCommand, main_ppo_command, parse_step_metrics, run_main_ppo_together
from amir_verl.demo.quickstart import toy_grpo_overrides


def train_command(assets, workdir: Path, steps: int, extra: list[str], **kwargs) -> LoggedCommand:
    """A CPU GRPO run of the toy task, no validation, plus ``extra``; verl's output in ``workdir/main_ppo.log``."""
    workdir.mkdir(parents=True, exist_ok=True)
    overrides = toy_grpo_overrides(assets, workdir, steps, test_freq=kwargs.pop("test_freq", -1), **kwargs) + extra + [
        "trainer.val_before_train=False"
    ]
    return main_ppo_command(overrides, log_path=workdir / "main_ppo.log")


def train_side_by_side(commands: dict[str, LoggedCommand]) -> dict[str, dict[int, dict[str, float]]]:
    """Independent runs at once (each with its own Ray): on 2 cores one run leaves about a third idle."""
    return {name: parse_step_metrics(output) for name, output in run_main_ppo_together(commands, timeout=900).items()}


def train(assets, workdir: Path, steps: int, extra: list[str], **kwargs) -> dict[int, dict[str, float]]:
    return train_side_by_side({"run": train_command(assets, workdir, steps, extra, **kwargs)})["run"]


GSPO_FLAGS = [
    "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
    "actor_rollout_ref.actor.clip_ratio_low=3e-4",
    "actor_rollout_ref.actor.clip_ratio_high=4e-4",
    "actor_rollout_ref.actor.use_kl_loss=True",
]
