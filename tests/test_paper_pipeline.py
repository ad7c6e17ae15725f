"""The CPU paper pipeline's pieces (no launch): its overrides leave every algorithm key of the paper recipes as
written, and its generated data passes through data_prep into the parquet the recipes read."""

import random

import pytest
from omegaconf import OmegaConf

from amir_verl.paper_pipeline import EVAL_BENCHMARKS
from amir_verl.paper_pipeline.pipeline import CPU_OVERRIDES, SIZES
from amir_verl.paper_pipeline.data import raw_record, word_problem, worked_answer
from amir_verl.datasets import SOURCES, to_row
from amir_verl.reward import compute_score
from amir_verl.reward.template import parse_response
from tests.support import compose_recipe

# Paths of the composed config that define the algorithm: what the overrides must not change. An entry ending
# in "." or "_" is a prefix; any other is that key and everything under it.
ALGORITHM_KEYS = (
    "algorithm.",  # advantage estimator, KL in reward
    "amir.",
    "trainer.v1.trainer_mode",
    "actor_rollout_ref.actor.policy_loss.",
    "actor_rollout_ref.actor.loss_agg_mode",
    "actor_rollout_ref.actor.clip_ratio_",
    "actor_rollout_ref.actor.clip_ratio",
    "actor_rollout_ref.actor.use_kl_loss",
    "actor_rollout_ref.actor.kl_loss_",
    "actor_rollout_ref.actor.entropy_coeff",
    "actor_rollout_ref.actor.optim.",
    "actor_rollout_ref.actor.ppo_epochs",
    "actor_rollout_ref.model.lora_",
    "actor_rollout_ref.model.lora.",
    "actor_rollout_ref.model.target_modules",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.rollout.temperature",
    "actor_rollout_ref.rollout.top_p",
    "actor_rollout_ref.rollout.top_k",
    "actor_rollout_ref.rollout.val_kwargs.",
    "reward.reward_manager.",
    "reward.custom_reward_function.",
    "data.max_prompt_length",
    "data.filter_overlong_prompts",
    "data.truncation",
    "data.val_files",
    "data.train_files",
)


def is_algorithm_key(path: str) -> bool:
    return any(path.startswith(key) if key.endswith((".", "_")) else path == key or path.startswith(key + ".")
               for key in ALGORITHM_KEYS)


def differences(a, b, path=""):
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in a.keys() | b.keys() for d in differences(a.get(k), b.get(k), f"{path}.{k}" if path else k)]
    return [] if a == b else [path]


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("variant", ["grpo", "amir_grpo", "gspo", "amir_gspo"])
def test_the_pipelines_cpu_overrides_touch_no_algorithm_key_of_the_recipe(variant, size, monkeypatch):
    monkeypatch.setenv("AMIR_OUTPUT", "/tmp/out")
    as_written = OmegaConf.to_container(compose_recipe(variant, "/models/smollm2"))
    on_cpu = OmegaConf.to_container(compose_recipe(variant, "/models/smollm2", [*CPU_OVERRIDES, *SIZES[size].overrides()]))
    changed = sorted(differences(as_written, on_cpu))
    touched = [path for path in changed if is_algorithm_key(path)]
    assert not touched, touched
    # and the overrides do what they are for (the check above is not vacuous)
    assert "actor_rollout_ref.rollout.name" in changed and "data.train_batch_size" in changed
    assert on_cpu["actor_rollout_ref"]["rollout"]["val_kwargs"]["n"] == 8 and on_cpu["actor_rollout_ref"]["rollout"]["n"] == 8
    assert on_cpu["actor_rollout_ref"]["model"]["lora_rank"] == 16


def test_the_algorithm_check_sees_a_changed_algorithm_key(monkeypatch):
    monkeypatch.setenv("AMIR_OUTPUT", "/tmp/out")
    as_written = OmegaConf.to_container(compose_recipe("amir_grpo", "/m"))
    changed = OmegaConf.to_container(compose_recipe("amir_grpo", "/m", ["actor_rollout_ref.rollout.val_kwargs.n=2",
                                                                       "+amir.beta_dpo=0.5"]))
    assert sorted(p for p in differences(as_written, changed) if is_algorithm_key(p)) == [
        "actor_rollout_ref.rollout.val_kwargs.n", "amir.beta_dpo"]


@pytest.mark.parametrize("benchmark", ["gsm8k", *EVAL_BENCHMARKS])
def test_generated_problems_convert_and_their_worked_answer_earns_full_correctness(benchmark):
    rng = random.Random(3)
    problem = word_problem(rng)
    row = to_row(SOURCES[benchmark], raw_record(benchmark, problem, 0, rng), SOURCES[benchmark].splits[-1], 0)
    golds = list(row["reward_model"]["ground_truth"])
    response = worked_answer(problem)
    if benchmark == "aqua_rat":  # the gold is the option's letter
        response = response.replace(f"<answer> {problem.answer} </answer>", f"<answer> {golds[0]} </answer>")
    assert parse_response(response).format_ok
    score = compute_score(row["data_source"], response, golds)
    assert score["acc"] == 1.0, (benchmark, golds, response, score)
