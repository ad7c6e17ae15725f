"""What the end-to-end modules share: a CPU GRPO run of the toy task as a command, runs side by side, and the
brute-force recomputations of what a recorded step batch should have given (log-probs, l, pairs, J_pref)."""

from __future__ import annotations

from pathlib import Path

import torch

from amir_verl.cpu.launch import LoggedCommand, main_ppo_command, read_verl_metrics, run_main_ppo_together, verl_metrics_path
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
    run_main_ppo_together(commands, timeout=900)
    return {name: read_verl_metrics(verl_metrics_path(command.log_path)) for name, command in commands.items()}


def train(assets, workdir: Path, steps: int, extra: list[str], **kwargs) -> dict[int, dict[str, float]]:
    return train_side_by_side({"run": train_command(assets, workdir, steps, extra, **kwargs)})["run"]


BETA, DELTA = 0.5, 0.05  # AMIR's beta_dpo and delta_r in the brute-force e2e runs: delta below the toy reward's
# 0.1 for a wrong digit, so pairs from step 1 on
GSPO_FLAGS = [
    "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
    "actor_rollout_ref.actor.clip_ratio_low=3e-4",
    "actor_rollout_ref.actor.clip_ratio_high=4e-4",
    "actor_rollout_ref.actor.use_kl_loss=True",
]


def response_log_probs(model, record: dict, grad: bool = False) -> list[torch.Tensor]:
    """Each sample's response-token log-probs under ``model`` (temperature 1), one sequence at a time."""
    out = []
    with torch.set_grad_enabled(grad):
        for prompt, response in zip(record["prompts"], record["responses"]):
            ids = torch.tensor([prompt + response])
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
            out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None]).squeeze(-1))
    return out


def pairs_by_definition(record: dict) -> list[tuple[int, int]]:
    """Every ordered (preferred, rejected) pair of a group with r_i - r_j > DELTA."""
    rewards = [sum(scores) for scores in record["rm_scores"]]
    groups = [key.rsplit("_", 2)[0] for key in record["keys"]]
    return [(i, j) for i in range(len(rewards)) for j in range(len(rewards))
            if groups[i] == groups[j] and rewards[i] - rewards[j] > DELTA]


def seq_mean(token_values, record: dict) -> torch.Tensor:
    """(N,) length-normalised sums of each response's token values over its mask."""
    values = [torch.as_tensor(v) for v in token_values]
    return torch.stack([(v * torch.tensor(m, dtype=v.dtype)).sum() / sum(m) for v, m in zip(values, record["response_mask"])])


def pref_objective(l_theta: torch.Tensor, l_ref: torch.Tensor, pairs) -> torch.Tensor:
    """J_pref = mean over pairs of log sigmoid(beta * margin)."""
    return torch.stack([torch.nn.functional.logsigmoid(BETA * ((l_theta[i] - l_ref[i]) - (l_theta[j] - l_ref[j])))
                        for i, j in pairs]).mean()


def load_policy(assets, workdir: Path, step: int):
    """The policy at the end of ``step`` (0: the initial model), from verl's actor checkpoint."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32).eval()
    if step > 0:
        folder = workdir / "checkpoints" / f"global_step_{step}" / "actor"
        state = {name: tensor.to_local() if hasattr(tensor, "to_local") else tensor
                 for name, tensor in torch.load(folder / "model_world_size_1_rank_0.pt", weights_only=False).items()}
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
        assert set(missing) <= tied and not unexpected, (missing, unexpected)
    return model

