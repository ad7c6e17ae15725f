"""Every paper recipe composes against verl 0.9.1's own config and passes verl's validation (no launch)."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from amir_verl.run_config import validate_amir_run
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import validate_config

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
MODELS = ["Qwen/Qwen2.5-3B-Instruct", "Qwen/Qwen2.5-7B-Instruct", "google/gemma-3-4b-it"]
VARIANTS = ["grpo", "amir_grpo", "gspo", "amir_gspo"]


def compose_recipe(variant, model, extra=()):
    with initialize_config_dir(config_dir=str(RECIPES / "config"), version_base=None):
        config = compose(config_name=f"paper_{variant}", overrides=[f"actor_rollout_ref.model.path={model}", *extra])
    OmegaConf.resolve(config)
    return config


@pytest.fixture
def vllm_lora_check(monkeypatch):
    """verl's validate_config ends with vLLM's LoRA-rank check, which imports vllm (a GPU extra, not
    installed on CPU): record the rank it is asked about instead."""
    import sys
    import types

    asked = []
    fake = types.ModuleType("verl.workers.rollout.vllm_rollout.utils")
    fake.get_vllm_max_lora_rank = asked.append
    monkeypatch.setitem(sys.modules, "verl.workers.rollout.vllm_rollout.utils", fake)
    return asked


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_recipe_composes_and_validates(variant, model, vllm_lora_check):
    config = compose_recipe(variant, model, ["trainer.n_gpus_per_node=4", "trainer.nnodes=2"])
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    assert vllm_lora_check == [16]
    assert config.actor_rollout_ref.model.lora_rank == 16 and config.actor_rollout_ref.model.lora_alpha == 16
    assert config.actor_rollout_ref.actor.optim.lr == 5e-6 and config.actor_rollout_ref.rollout.n == 8
    assert config.data.max_prompt_length + config.data.max_response_length == 2048
    val = config.actor_rollout_ref.rollout.val_kwargs
    assert (val.n, val.temperature, val.top_p) == (8, 0.6, 1.0) and len(config.data.val_files) == 7
    assert config.trainer.validation_data_dir  # generations are dumped for the evaluation CLI
    if variant.startswith("amir"):
        amir = validate_amir_run(config)
        assert amir.reference == "ref"
        # the official code's lambda rule and constants, so that the recipes reproduce the official runs
        rule = amir.lambda_settings()
        assert (rule.rule, rule.lambda_init, rule.lambda_min, rule.lambda_max, rule.target_low, rule.target_high) == (
            "loss_ratio", 0.01, 0.005, 0.05, 0.3, 0.7)


@pytest.mark.parametrize("base", ["grpo", "gspo"])
def test_amir_variant_differs_from_its_baseline_only_by_the_amir_overrides(base):
    baseline = OmegaConf.to_container(compose_recipe(base, MODELS[0]))
    amir = OmegaConf.to_container(compose_recipe(f"amir_{base}", MODELS[0]))
    assert amir.pop("amir") == {"lambda_rule": "loss_ratio"} and "amir" not in baseline

    def differences(a, b, path=""):
        if isinstance(a, dict) and isinstance(b, dict):
            return [d for k in a.keys() | b.keys() for d in differences(a.get(k), b.get(k), f"{path}.{k}")]
        return [] if a == b else [path]

    assert sorted(differences(baseline, amir)) == [
        ".actor_rollout_ref.actor.policy_loss.loss_mode", ".trainer.v1.trainer_mode"
    ]


def test_launch_script_names_the_configs():
    script = (RECIPES / "paper" / "run.sh").read_text()
    assert '--config-name="paper_${VARIANT}"' in script
    for variant in VARIANTS:
        assert (RECIPES / "config" / f"paper_{variant}.yaml").exists()
