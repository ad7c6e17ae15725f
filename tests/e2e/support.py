"""What the end-to-end modules share: a CPU GRPO run of the toy task as a command, runs side by side, and the
brute-force recomputations of what a recorded step batch should have given (log-probs, l, pairs, J_pref), and
the paper's LoRA settings with the recomputation of a LoRA run from the base model and verl's checkpoints."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from amir_verl.cpu.launch import LoggedCommand, main_ppo_command, read_verl_metrics, run_main_ppo_together, verl_metrics_path
from amir_verl.demo.quickstart import toy_grpo_overrides
from amir_verl.metrics import LAMBDA, NUM_PAIRS, PG_GRAD_NORM, PREF_LOSS, PREF_TERM, REWARD, ROLLOUT_PROBS_DIFF_MAX
from amir_verl.step_batch import FIELD_REF_SEQ_LOGP
from tests.support import REPO


def train_command(assets, workdir: Path, steps: int, extra: list[str], **kwargs) -> LoggedCommand:
    """A CPU GRPO run of the toy task, no validation, plus ``extra``; verl's output in ``workdir/main_ppo.log``."""
    workdir.mkdir(parents=True, exist_ok=True)
    overrides = toy_grpo_overrides(assets, workdir, steps, test_freq=kwargs.pop("test_freq", -1), **kwargs) + extra + [
        "trainer.val_before_train=False"
    ]
    return main_ppo_command(overrides, log_path=workdir / "main_ppo.log")


# bad configs, each run on its own main_ppo: it must stop on the driver, before Ray starts, naming the fix
BAD_CONFIGS = dict(zip(
    ["unknown-key", "missing-reference", "missing-trainer-mode", "megatron-lora-key-on-fsdp",
     "lora-unmerged-through-checkpoint-engine"],
    [
        (["actor_rollout_ref.actor.policy_loss.loss_mode=amir_grpo", "trainer.v1.trainer_mode=amir",
          "+amir.bta_dpo=0.1", "actor_rollout_ref.actor.use_kl_loss=True"], r"amir\.bta_dpo"),
        (["actor_rollout_ref.actor.policy_loss.loss_mode=amir_grpo", "trainer.v1.trainer_mode=amir"],
         r"actor_rollout_ref\.actor\.use_kl_loss=True"),
        (["actor_rollout_ref.actor.policy_loss.loss_mode=amir_grpo", "actor_rollout_ref.actor.use_kl_loss=True"],
         r"add trainer\.v1\.trainer_mode=amir"),
        (["actor_rollout_ref.actor.policy_loss.loss_mode=amir_grpo", "trainer.v1.trainer_mode=amir",
          "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.model.lora.rank=16"],
         r"set actor_rollout_ref\.model\.lora_rank=16"),
        (["actor_rollout_ref.actor.policy_loss.loss_mode=amir_grpo", "trainer.v1.trainer_mode=amir",
          "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.model.lora_rank=8",
          "actor_rollout_ref.rollout.checkpoint_engine.backend=cpu_object_store"],
         r"verl issue 7495.*lora\.merge=True"),
    ],
))  # {id: (overrides, what the error must say)}: tests/e2e/test_main_ppo_cpu.py's, started by conftest.py
# (No entry for a missing flash-attn: the driver only warns, its environment need not be the workers'; an AMIR run's
# worker stops before its model loads: tests/e2e/test_two_node_cpu.py.)



@dataclass
class Launch:
    """A run that has ended."""

    workdir: Path
    error: BaseException | None  # what run_main_ppo_together raised (MainPPOFailed for a fault), or None
    ended: float  # time.monotonic() at its end


def run_alone(name: str, command: LoggedCommand, timeout: float) -> Launch:
    """``command`` (a :func:`train_command`) run to its end on its own, so that no other run's failure stops it;
    what it raised is recorded, not raised: a fault is some runs' expected end."""
    try:
        run_main_ppo_together({name: command}, timeout=timeout)
        error = None
    except BaseException as raised:  # the tests report what was not expected
        error = raised
    return Launch(command.log_path.parent, error, time.monotonic())


def train_side_by_side(commands: dict[str, LoggedCommand]) -> dict[str, dict[int, dict[str, float]]]:
    """Independent runs at once (each with its own Ray): on 2 cores one run leaves about a third idle."""
    run_main_ppo_together(commands, timeout=900)
    return {name: read_verl_metrics(verl_metrics_path(command.log_path)) for name, command in commands.items()}


BASE_METRICS = ["actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/pg_clipfrac", "actor/ppo_kl",
                REWARD, "critic/advantages/mean", "response_length/mean"]  # verl's own, of any base loss


def assert_same(a: dict, b: dict, keys, steps):
    """Equal up to float32 summation order: the rollouts finish, and so enter verl's batch, in any order.
    (Seen: grad norms equal to 7 digits, pg_loss -- a sum that nearly cancels -- within 1e-8 absolute.)"""
    for step in steps:
        for key in keys:
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-5, abs=1e-6), (step, key)


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


def load_policy(assets, workdir: Path, step: int, world: int = 1):
    """The policy at the end of ``step`` (0: the initial model), from verl's FSDP2 actor checkpoint of ``world`` ranks:
    each rank's file holds its dim-0 shard (DTensor, ``Shard(0)``) of every parameter."""
    from torch.distributed.tensor import Shard
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32).eval()
    if step > 0:
        folder = workdir / "checkpoints" / f"global_step_{step}" / "actor"
        shards = [torch.load(folder / f"model_world_size_{world}_rank_{rank}.pt", weights_only=False)
                  for rank in range(world)]
        state = {}
        for name, first in shards[0].items():
            if not hasattr(first, "to_local"):
                state[name] = first
                continue
            assert tuple(first.placements) == (Shard(0),), (name, first.placements)
            state[name] = torch.cat([shard[name].to_local() for shard in shards], dim=0)
            assert state[name].shape == first.shape, name
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
        assert set(missing) <= tied and not unexpected, (missing, unexpected)
    return model


# ---- LoRA (the paper's setup): the recipe's settings and the recomputation of a run -----------------------

def recipe_lora_overrides() -> list[str]:
    """The LoRA, reference and KL settings of ``recipes/config/paper_common.yaml``, as overrides."""
    from omegaconf import OmegaConf

    recipe = OmegaConf.load(REPO / "recipes" / "config" / "paper_common.yaml").actor_rollout_ref
    return [
        f"actor_rollout_ref.model.lora_rank={recipe.model.lora_rank}",
        f"actor_rollout_ref.model.lora_alpha={recipe.model.lora_alpha}",
        f"actor_rollout_ref.actor.use_kl_loss={recipe.actor.use_kl_loss}",
        f"actor_rollout_ref.actor.kl_loss_coef={recipe.actor.kl_loss_coef}",
        f"actor_rollout_ref.actor.kl_loss_type={recipe.actor.kl_loss_type}",
        f"actor_rollout_ref.rollout.load_format={recipe.rollout.load_format}",
        f"actor_rollout_ref.rollout.layered_summon={recipe.rollout.layered_summon}",
    ]


def base_model(assets):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32).eval()


def load_checkpoint(assets, workdir: Path, step: int):
    """verl's actor checkpoint ``global_step_<step>`` (world size 1) -> (PeftModel, its state dict).

    The adapter config is rebuilt from the checkpoint's ``lora_train_meta.json`` and verl's default target
    modules; ``load_state_dict(strict=True)`` then needs every saved tensor to have its place."""
    import json

    from peft import LoraConfig, get_peft_model

    folder = workdir / "checkpoints" / f"global_step_{step}" / "actor"
    meta = json.loads((folder / "lora_train_meta.json").read_text())
    state = {name: tensor.to_local() if hasattr(tensor, "to_local") else tensor
             for name, tensor in torch.load(folder / "model_world_size_1_rank_0.pt", weights_only=False).items()}
    model = get_peft_model(base_model(assets), LoraConfig(r=meta["r"], lora_alpha=meta["lora_alpha"],
                                                          target_modules="all-linear", task_type="CAUSAL_LM"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {name for name in missing if name.endswith("lm_head.weight")} if model.config.tie_word_embeddings else set()
    assert set(missing) == tied and not unexpected, (missing, unexpected)
    return model.eval(), state


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).abs() / b.abs().clamp(min=1e-12)).max())


def check_lora_run_with_reference(assets, workdir: Path, metrics: dict, records: dict) -> float:
    """Every check of an ``amir.reference=ref`` LoRA run of 2 or more steps; returns the largest relative l_ref error."""
    base = base_model(assets)
    base_state = base.state_dict()
    models = {0: base}  # the adapter starts with lora_B = 0: the step-1 policy is the base model
    states = {}
    for step in sorted(records):
        models[step], states[step] = load_checkpoint(assets, workdir, step)
    worst = 0.0
    for step, record in sorted(records.items()):
        # l_ref AMIR used == the base model without adapter, recomputed here
        l_ref = seq_mean(response_log_probs(base, record), record)
        used = torch.tensor(record[FIELD_REF_SEQ_LOGP])
        worst = max(worst, relative_error(used, l_ref))
        torch.testing.assert_close(used, l_ref, rtol=1e-5, atol=0.0)
        # the policy at the step's start: the previous step's checkpoint reproduces verl's old log-probs
        l_theta_tokens = response_log_probs(models[step - 1], record)
        for mine, verls in zip(l_theta_tokens, record["old_log_probs"]):
            torch.testing.assert_close(mine, torch.tensor(verls), rtol=1e-5, atol=1e-6)
        l_theta = seq_mean(l_theta_tokens, record)
        if step > 1:  # the adapter has moved the policy away from the reference
            assert float((l_theta - l_ref).abs().max()) > 1e-4, step
        pairs = pairs_by_definition(record)
        assert metrics[step][NUM_PAIRS] == len(pairs) > 0
        assert metrics[step][PREF_LOSS] == pytest.approx(-float(pref_objective(l_theta, l_ref, pairs)), rel=1e-5)
    # the rollout served the trained adapter: its log-probs are the actor's after every update
    assert all(metrics[step][ROLLOUT_PROBS_DIFF_MAX] < 1e-5 for step in records)
    # only adapter weights change: every base tensor is bit-identical after each step
    for step, state in states.items():
        for name, tensor in state.items():
            if "lora_" not in name:
                key = name.removeprefix("base_model.model.").replace(".base_layer", "")
                assert torch.equal(tensor, base_state[key]), (step, name)
    last, before = max(states), max(states) - 1
    moved = [name for name in states[last] if "lora_B" in name and not torch.equal(states[last][name], states[before][name])]
    assert moved, "no adapter weight changed in the last step"
    return worst


# ---- the asynchronous schedules: a run whose weight syncs cut responses, and the checks of a recorded update ----

GROUP = 8  # toy_grpo_overrides' rollout.n
HOLD = "4@2"  # HOLD_ENV: 4 requests under the initial weights, each at its 2nd token
# verl's dropless staleness control: a step waits for every prompt submitted a step or more before it
STALENESS = ["trainer.v1.sampler.max_off_policy_strategy=wait", "trainer.v1.sampler.max_off_policy_threshold=2"]
# verl's default warm-up (one batch), stated: a step's prompts in flight beyond the step's, so held groups never
# keep step 1 waiting
WARMUP_BATCHES = 1
VLLM_HIDDEN = 128  # make_assets' hidden size for vLLM runs: 4 heads of 32, vLLM's CPU attention's smallest head size
# mode -> (prompts per local update, local updates per step)
LAYOUT = {"colocate_async": (8, 1), "separate_async": (4, 2)}


def async_command(assets, workdir: Path, mode: str, steps: int, extra: list[str] = ()) -> LoggedCommand:
    """An AMIR-GRPO run of verl's V1 ``mode`` (:data:`LAYOUT`), a checkpoint every step, token-level IS weights,
    the rollout holding responses for the first weight sync to cut (:data:`HOLD`), and the probe recording;
    plus ``extra``."""
    from amir_verl.cpu.holds import HOLD_ENV
    from amir_verl.run_config import amir_overrides
    from tests.e2e.probe import probed

    command = train_command(assets, workdir, steps, amir_overrides(
        "amir_grpo", trainer_mode=f"amir_{mode}", beta_dpo=BETA, delta_r=DELTA) + [
        "data.max_response_length=8", "algorithm.rollout_correction.rollout_is=token",
        f"trainer.v1.{mode}.num_warmup_batches={WARMUP_BATCHES}"] + STALENESS + list(extra),
        save_freq=1, schedule=mode, local_updates=LAYOUT[mode][1])
    command.env[HOLD_ENV] = HOLD
    return probed(command, workdir, REPO)


def load_async_records(workdir: Path, steps: int, local_updates: int) -> dict[tuple[int, int], tuple[dict, dict]]:
    """The probe's records of an async run: {(step, local update): (the _compute_advantage record, the actor
    update's metrics)}."""
    records = {}
    for step in range(1, steps + 1):
        for j in range(local_updates):
            suffix = f"{step}" if j == 0 else f"{step}_{j}"
            probe = workdir / "probe"
            records[step, j] = torch.load(probe / f"step_{suffix}.pt"), torch.load(probe / f"actor_{suffix}.pt")
    return records

def versions_of_tokens(rollout: list[float], candidates: dict[int, torch.Tensor]) -> list[int] | None:
    """The weight version of each token, nondecreasing, such that each token's rollout log-prob is that
    version's (``candidates``: version -> the sample's token log-probs under it); None when there is none."""
    versions, order = [], sorted(candidates)
    at = 0
    for t, value in enumerate(rollout):
        while at < len(order) and abs(float(candidates[order[at]][t]) - value) > 1e-4:
            at += 1
        if at == len(order):
            return None
        versions.append(order[at])
    return versions


def check_update(record: dict, actor: dict, policies: dict, step: int, prompts: int, exact_gradient: bool) -> tuple[int, int]:
    """Checks 1-4 of the module docstring on one local update of ``step``; returns how many trajectories have
    tokens from two versions, and how many have tokens from weights older than the step's start."""
    groups = [key.rsplit("_", 2)[0] for key in record["keys"]]
    assert len(groups) == prompts * GROUP and all(groups.count(g) == GROUP for g in groups)  # whole groups

    # old log-probs: the step's starting weights, for every sample
    start = response_log_probs(policies[step - 1], record)
    for mine, verls in zip(start, record["old_log_probs"]):
        torch.testing.assert_close(mine, torch.tensor(verls), rtol=1e-5, atol=1e-5)
    # each token's rollout log-prob: a version of its trajectory's span, in order
    spliced = stale = 0
    for i, tag in enumerate(record["tags"]):
        low, high = tag["min_global_steps"], tag["max_global_steps"]
        assert 0 <= low <= high <= step - 1, (step, tag)
        one = {"prompts": [record["prompts"][i]], "responses": [record["responses"][i]]}
        candidates = {v: response_log_probs(policies[v], one)[0] for v in range(low, high + 1)}
        versions = versions_of_tokens(record["rollout_log_probs"][i], candidates)
        assert versions is not None, (step, i, tag)
        spliced += len(set(versions)) > 1
        stale += min(versions) < step - 1

    # pairs and the preference loss by definition; the term's value in the update
    metrics = record["metrics"]
    l_old = seq_mean(start, record)
    l_ref = seq_mean(response_log_probs(policies[0], record), record)  # verl's reference: the initial model
    torch.testing.assert_close(torch.tensor(record["amir_ref_seq_logp"]), l_ref, rtol=1e-5, atol=1e-6)
    pairs = pairs_by_definition(record)
    assert metrics[NUM_PAIRS] == len(pairs) > 0
    assert metrics[PREF_LOSS] == pytest.approx(-float(pref_objective(l_old, l_ref, pairs)), rel=1e-5)
    lambda_reg = metrics[LAMBDA]
    assert record["extra_info"]["amir_num_mini_batches"] == 1

    # the driver's pg gradient norm at ratio 1, with the IS weights
    masks = [torch.tensor(m, dtype=torch.float32) for m in record["response_mask"]]
    tokens = sum(float(m.sum()) for m in masks)
    driver = torch.sqrt(sum(((torch.tensor(adv) * torch.tensor(weight) * mask) ** 2).sum()
                            for adv, weight, mask in zip(record["advantages"], record["rollout_is_weights"], masks)))
    assert metrics[PG_GRAD_NORM] == pytest.approx(float(driver) / tokens, rel=1e-5)
    if not exact_gradient:  # the anchored surrogate: own scores live at the update's weights, partners at pi_old
        assert actor[PREF_TERM] != pytest.approx(lambda_reg * metrics[PREF_LOSS], rel=1e-5)
        return spliced, stale
    assert actor[PREF_TERM] == pytest.approx(lambda_reg * metrics[PREF_LOSS], rel=1e-5)
    # the actor's gradient at the checkpoint, over the recorded batch
    model = policies[step - 1]
    model.zero_grad()
    live = response_log_probs(model, record, grad=True)
    pg = 0.0
    for logp, old, adv, weight, mask in zip(live, record["old_log_probs"], record["advantages"],
                                            record["rollout_is_weights"], masks):
        ratio = torch.exp(logp - torch.tensor(old))
        assert float((ratio - 1).abs().max()) < 1e-4  # at the starting weights: no clipping applies
        pg = pg + (-torch.tensor(adv) * torch.tensor(weight) * ratio * mask).sum() / tokens
    (pg - lambda_reg * pref_objective(seq_mean(live, record), l_ref, pairs)).backward()
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
    assert actor["actor/grad_norm"] == pytest.approx(float(grad_norm), rel=1e-4)
    print(f"step {step}: pairs {len(pairs)}, lambda {lambda_reg:.4f}, grad_norm {float(grad_norm):.6f} "
          f"(verl {actor['actor/grad_norm']:.6f})")
    return spliced, stale


def check_sync_run(assets, workdir: Path, steps: int, prompts: int, world: int) -> dict[int, dict]:
    """:func:`check_update` on every step of a sync run on ``world`` ranks with a checkpoint every step and the
    probe; returns its probe records by step."""
    policies = {step: load_policy(assets, workdir, step, world=world if step else 1) for step in range(steps)}
    records = {}
    for step in range(1, steps + 1):
        records[step] = torch.load(workdir / "probe" / f"step_{step}.pt")
        actor = torch.load(workdir / "probe" / f"actor_{step}.pt")
        check_update(records[step], actor, policies, step, prompts, exact_gradient=True)
    return records


def processes_printing(log: str, text: str) -> set[str]:
    """The pids of the Ray worker processes with a line of ``log`` that holds ``text`` (Ray's ``(Name pid=N...)``)."""
    return {re.search(r"pid=(\d+)", line).group(1) for line in log.splitlines() if text in line and "pid=" in line}


def check_async_run(assets, workdir: Path, console: dict, records: dict, mode: str, steps: int) -> str:
    """Every check of an async run (:func:`async_command`): :func:`check_update` on each local update, responses
    held, spliced and stale, verl's console ``amir/*`` values the mean over a step's local updates, and the
    lambda controller counting every update. Returns the run's log."""
    import json

    prompts, local_updates = LAYOUT[mode]
    policies = {step: load_policy(assets, workdir, step) for step in range(steps)}
    spliced = stale = 0
    for (step, j), (record, actor) in sorted(records.items()):
        # local updates j >= 1 of separate_async start from the weights after update j - 1: no checkpoint holds them
        counts = check_update(record, actor, policies, step, prompts, exact_gradient=j == 0)
        spliced, stale = spliced + counts[0], stale + counts[1]
    log = (workdir / "main_ppo.log").read_text()
    held = log.count("held at token")
    print(f"{mode}: held responses {held}, spliced trajectories {spliced}, stale ones {stale}")
    assert held > 0 and spliced > 0 and stale > 0
    for step in range(1, steps + 1):
        calls = [records[step, j][0] for j in range(local_updates)]
        for key in (NUM_PAIRS, PREF_LOSS, LAMBDA):  # verl's MetricsAggregator: the mean over the local updates
            expected = sum(call["metrics"][key] for call in calls) / local_updates
            assert console[step][key] == pytest.approx(expected, rel=1e-6), (step, key)
        state = json.loads((workdir / "checkpoints" / f"global_step_{step}" / "amir_state.json").read_text())
        assert state["lambda_controller"]["num_updates"] == local_updates * step
    return log
