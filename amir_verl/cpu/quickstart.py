"""AMIR-GRPO with verl's real ``main_ppo`` on a laptop CPU, in one command:

    python -m amir_verl.cpu.quickstart [--workdir DIR] [--steps N] [-- extra hydra overrides]

It makes a tiny model, tokenizer and toy data (:mod:`amir_verl.cpu.toy_task`), then runs
``python -m verl.trainer.main_ppo`` with ``AMIR_VERL_CPU=1`` and the overrides of
:func:`cpu_overrides`: the stock GRPO config plus the AMIR override set, FSDP2 in float32 on the
CPU, the ``hf`` rollout, validation, a checkpoint, verl's console logger.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from amir_verl.cpu import SWITCH
from amir_verl.cpu.toy_task import make_assets

FP32 = "{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}"


def amir_overrides(loss_mode: str = "amir_grpo", **amir: object) -> list[str]:
    """The override set that turns verl's GRPO (or GSPO) run into AMIR, as the README states it."""
    return [
        f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}",
        "trainer.v1.trainer_mode=amir",
        "actor_rollout_ref.actor.use_kl_loss=True",
    ] + [f"+amir.{k}={v}" for k, v in amir.items()]


def cpu_overrides(assets: dict[str, str], workdir: Path, steps: int, n_gpus: int = 1, group_size: int = 8,
                  prompts_per_step: int = 8, micro_batch: int = 16, test_freq: int = 2, save_freq: int = -1,
                  seed: int = 0) -> list[str]:
    """verl overrides for a GRPO run of the toy task on the CPU backend (no AMIR keys)."""
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
        "trainer.experiment_name=quickstart",
        f"trainer.total_training_steps={steps}",
        f"trainer.test_freq={test_freq}",
        f"trainer.save_freq={save_freq}",
        "trainer.val_before_train=True",
        f"trainer.default_local_dir={workdir / 'checkpoints'}",
        "+ray_kwargs.ray_init.num_cpus=16",  # logical: verl's workers, TransferQueue and reward actors
        f"+ray_kwargs.ray_init.num_gpus={n_gpus}",  # logical GPUs: verl's resource pools ask for them
        "+ray_kwargs.ray_init.include_dashboard=False",
    ]


def run_main_ppo(overrides: list[str], log_path: Path | None = None, timeout: float | None = None) -> str:
    """Run ``python -m verl.trainer.main_ppo`` on the CPU backend, echoing its output; returns the output."""
    env = dict(os.environ, **{SWITCH: "1", "TOKENIZERS_PARALLELISM": "false", "RAY_DEDUP_LOGS": "0"})
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *overrides]
    lines = []
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        start = time.monotonic()
        for line in proc.stdout:
            lines.append(line)
            if log_path is None:
                print(line, end="", flush=True)
            if timeout is not None and time.monotonic() - start > timeout:
                proc.kill()
                raise TimeoutError(f"main_ppo ran over {timeout} s")
        proc.wait()
    output = "".join(lines)
    if log_path is not None:
        log_path.write_text(output)
    if proc.returncode != 0:
        raise RuntimeError(f"main_ppo exited with {proc.returncode}:\n{output[-6000:]}")
    return output


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", type=Path, default=Path("amir_cpu_quickstart"))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--loss-mode", default="amir_grpo", choices=["amir_grpo", "amir_gspo"])
    p.add_argument("overrides", nargs="*", help="extra hydra overrides for main_ppo (after --)")
    args = p.parse_args()
    workdir = args.workdir.resolve()
    start = time.monotonic()
    print(f"[quickstart] making the tiny model, tokenizer and toy data in {workdir}", flush=True)
    assets = make_assets(workdir)
    overrides = cpu_overrides(assets, workdir, args.steps, test_freq=10, save_freq=args.steps) + amir_overrides(
        args.loss_mode, reference="ref", beta_dpo=0.5, lambda_init=0.05, lambda_max=0.2
    ) + list(args.overrides)
    print(f"[quickstart] {SWITCH}=1 python -m verl.trainer.main_ppo \\\n    " + " \\\n    ".join(overrides), flush=True)
    run_main_ppo(overrides)
    print(f"[quickstart] done in {time.monotonic() - start:.0f} s; checkpoint in {workdir / 'checkpoints'}")


if __name__ == "__main__":
    main()
