"""The `amir` config namespace and the run-level checks, on configs composed from verl 0.9.1's own yaml."""

import dataclasses

import pytest
from omegaconf import OmegaConf

from amir_verl.config import AmirConfig, describe_keys
from amir_verl.run_config import validate_amir_run
from tests.support import AMIR, GRPO, REPO, compose_verl


def test_defaults_are_valid_and_documented():
    cfg = AmirConfig()
    assert cfg.reference == "ref" and cfg.pair_mode == "all" and cfg.lambda_rule == "grad_share"
    keys = [k for k, _, _ in describe_keys()]
    assert keys == [f"amir.{f.name}" for f in dataclasses.fields(AmirConfig)]


def test_recipe_yaml_repeats_the_dataclass_defaults():
    yaml = OmegaConf.load(REPO / "recipes" / "config" / "amir_trainer.yaml")
    assert OmegaConf.to_container(yaml.amir) == dataclasses.asdict(AmirConfig())


def test_the_usage_page_lists_every_key_with_its_default():
    page = (REPO / "docs" / "usage.md").read_text()
    for key, default, _ in describe_keys():
        shown = "null" if default is None else str(default).lower() if isinstance(default, bool) else str(default)
        assert f"| `{key}` | `{shown}` |" in page, key


@pytest.mark.parametrize(
    "values,key",
    [
        ({"bta_dpo": 0.1}, "amir.bta_dpo"),
        ({"beta_dpo": 0}, "amir.beta_dpo"),
        ({"beta_dpo": float("nan")}, "amir.beta_dpo"),
        ({"beta_dpo": "big"}, "amir.beta_dpo"),
        ({"delta_r": -1}, "amir.delta_r"),
        ({"pair_mode": "topk"}, "amir.pair_mode"),
        ({"max_pairs_per_group": 0}, "amir.max_pairs_per_group"),
        ({"max_pairs_per_group": 2.5}, "amir.max_pairs_per_group"),
        ({"reference": "none"}, "amir.reference"),
        ({"lambda_init": 50.0}, "amir.lambda_init"),  # outside grad_share's default clamps
        ({"lambda_rule": "loss_ratio", "lambda_init": 0.5}, "amir.lambda_init"),  # outside the official clamps
        ({"lambda_init": -0.1, "lambda_rule": "fixed"}, "amir.lambda_init"),
        ({"lambda_min": 10.0}, "amir.lambda_min"),
        ({"target_ratio_low": 0.8}, "amir.target_ratio_low"),
        ({"target_ratio_high": 1.5}, "amir.target_ratio_high"),  # a share is at most 1
        ({"lambda_increase": 0.9}, "amir.lambda_increase"),
        ({"lambda_decrease": 1.2}, "amir.lambda_decrease"),
        ({"lambda_rule": "ema"}, "amir.lambda_rule"),
        ({"lambda_adaptive": False}, "amir.lambda_adaptive"),  # replaced by lambda_rule
        ({"base_loss_mode": 3}, "amir.base_loss_mode"),
    ],
)
def test_bad_values_name_the_key(values, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        AmirConfig.from_mapping(values)


def test_fixed_lambda_zero_is_allowed_and_ints_are_floats():
    cfg = AmirConfig.from_mapping({"lambda_init": 0, "lambda_rule": "fixed", "beta_dpo": 1})
    assert cfg.lambda_init == 0.0 and isinstance(cfg.beta_dpo, float)


def test_null_rule_keys_take_the_rules_defaults():
    """loss_ratio: the official code's constants; grad_share: its own; a set key wins."""
    official = AmirConfig(lambda_rule="loss_ratio").lambda_settings()
    assert (official.lambda_init, official.lambda_min, official.lambda_max, official.target_low,
            official.target_high, official.increase, official.decrease) == (0.01, 0.005, 0.05, 0.3, 0.7, 1.25, 0.8)
    share = AmirConfig().lambda_settings()
    assert share.rule == "grad_share" and share.lambda_min <= share.lambda_init <= share.lambda_max
    assert 0 < share.target_low < share.target_high <= 1
    assert AmirConfig(lambda_max=9.0).lambda_settings().lambda_max == 9.0


@pytest.mark.parametrize(
    "loss_mode,base,expected",
    [("amir_grpo", None, "vanilla"), ("amir_gspo", None, "gspo"), ("amir_grpo", "vanilla", "vanilla"),
     ("amir", "cispo", "cispo"), ("amir", "sapo", "sapo")],
)
def test_base_loss_mode(loss_mode, base, expected):
    from amir_verl.run_config import resolve_base_loss_mode

    assert resolve_base_loss_mode(loss_mode, AmirConfig(base_loss_mode=base)) == expected


@pytest.mark.parametrize(
    "loss_mode,base,message",
    [("amir", None, r"\+amir\.base_loss_mode=<verl loss mode>"),
     ("amir", "vanila", r"amir\.base_loss_mode='vanila' is not in verl's policy-loss registry.*cispo"),
     ("amir", "amir_grpo", r"amir\.base_loss_mode='amir_grpo' cannot be AMIR's base"),
     ("amir", "bypass_mode", r"amir\.base_loss_mode='bypass_mode' cannot be AMIR's base"),
     ("amir_grpo", "gspo", r"amir_grpo is AMIR on `vanilla`, but amir\.base_loss_mode='gspo'")],
)
def test_bad_base_loss_mode_names_it(loss_mode, base, message):
    from amir_verl.run_config import resolve_base_loss_mode

    with pytest.raises(ValueError, match=message):
        resolve_base_loss_mode(loss_mode, AmirConfig(base_loss_mode=base))


def test_stock_grpo_plus_amir_overrides_validates():
    config = compose_verl(GRPO + AMIR + ["actor_rollout_ref.actor.use_kl_loss=True", "+amir.beta_dpo=0.1"])
    assert validate_amir_run(config).beta_dpo == 0.1


def test_verl_validate_config_accepts_the_amir_loss_modes():
    from verl.utils.config import validate_config

    for mode, extra in (("amir_grpo", []), ("amir_gspo", []), ("amir", ["+amir.base_loss_mode=cispo"])):
        config = compose_verl(
            GRPO + extra + [f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}", "trainer.v1.trainer_mode=amir",
                    "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
                    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2", "trainer.n_gpus_per_node=1",
                    "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                    "actor_rollout_ref.rollout.n=2",
                    "+actor_rollout_ref.model.override_config.attn_implementation=sdpa"]  # no flash-attn here
        )
        validate_config(config=config, use_reference_policy=True, use_critic=False)


def test_missing_reference_fails_naming_the_override():
    config = compose_verl(GRPO + AMIR)  # use_kl_loss defaults to False: no reference log-probs
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.use_kl_loss=True.*amir\.reference=ref_free"):
        validate_amir_run(config)
    ok = compose_verl(GRPO + AMIR + ["+amir.reference=ref_free"])
    assert validate_amir_run(ok).reference_free


def test_wrong_loss_mode_fails_naming_the_key():
    config = compose_verl(GRPO + ["trainer.v1.trainer_mode=amir", "actor_rollout_ref.actor.use_kl_loss=True"])
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.policy_loss\.loss_mode"):
        validate_amir_run(config)


def test_unknown_key_in_composed_config():
    config = compose_verl(GRPO + AMIR + ["actor_rollout_ref.actor.use_kl_loss=True", "+amir.lamda_init=0.02"])
    with pytest.raises(ValueError, match=r"amir\.lamda_init"):
        validate_amir_run(config)


def test_recipe_config_composes_on_verl_and_validates():
    config = compose_verl(["actor_rollout_ref.rollout.name=vllm", "amir.beta_dpo=0.3"], REPO / "recipes" / "config",
                          "amir_trainer")
    assert config.trainer.v1.trainer_mode == "amir"
    assert config.actor_rollout_ref.actor.kl_loss_coef == 0.0  # reference log-probs without a KL term
    assert validate_amir_run(config).beta_dpo == 0.3


def test_early_check_inside_verls_validate_config():
    """The plugin wraps verl.utils.config.validate_config, which main_ppo calls before Ray starts."""
    from amir_verl.run_config import check_amir_run

    check_amir_run(compose_verl(GRPO))  # a stock run: untouched
    with pytest.raises(ValueError, match=r"add trainer\.v1\.trainer_mode=amir"):
        check_amir_run(compose_verl(GRPO + ["actor_rollout_ref.actor.policy_loss.loss_mode=amir_gspo",
                                            "actor_rollout_ref.actor.use_kl_loss=True"]))
    with pytest.raises(ValueError, match=r"trainer\.use_v1=True"):
        check_amir_run(compose_verl(GRPO + AMIR + ["trainer.use_v1=False"]))
    with pytest.raises(ValueError, match=r"amir\.bta"):
        check_amir_run(compose_verl(GRPO + AMIR + ["actor_rollout_ref.actor.use_kl_loss=True", "+amir.bta=1"]))
    amir_on = ["actor_rollout_ref.actor.policy_loss.loss_mode=amir", "trainer.v1.trainer_mode=amir",
               "actor_rollout_ref.actor.use_kl_loss=True"]
    with pytest.raises(ValueError, match=r"amir\.base_loss_mode='nope'"):
        check_amir_run(compose_verl(GRPO + amir_on + ["+amir.base_loss_mode=nope"]))
    check_amir_run(compose_verl(GRPO + amir_on + ["+amir.base_loss_mode=gpg"]))


@pytest.mark.parametrize("verl_mode, amir_mode", [("colocate_async", "amir_colocate_async"),
                                                  ("separate_async", "amir_separate_async")])
def test_an_amir_loss_under_verls_async_mode_names_the_amir_async_mode(verl_mode, amir_mode):
    from amir_verl.run_config import check_amir_run

    config = compose_verl(GRPO + [AMIR[0], f"trainer.v1.trainer_mode={verl_mode}",
                                  "actor_rollout_ref.actor.use_kl_loss=True"])
    with pytest.raises(ValueError, match=rf"add trainer\.v1\.trainer_mode={amir_mode} \(verl's {verl_mode} schedule"):
        check_amir_run(config)


@pytest.mark.parametrize("mode", ["amir", "amir_colocate_async", "amir_separate_async"])
def test_bypass_mode_is_refused_under_every_amir_trainer(mode):
    """verl's bypass mode takes old_log_probs from the rollout engine (the behaviour policy, possibly several
    versions) and swaps the loss mode for its own: the partners' frozen scores would not be at the update's
    starting weights, and the preference term would be lost."""
    from amir_verl.run_config import check_amir_run

    config = compose_verl(GRPO + [AMIR[0], f"trainer.v1.trainer_mode={mode}", "actor_rollout_ref.actor.use_kl_loss=True",
                                  "algorithm.rollout_correction.bypass_mode=True"])
    with pytest.raises(ValueError, match=r"bypass_mode=True"):
        check_amir_run(config)


# ---- what stops any run on the driver (run_config.check_any_run) ----------------------------------------------

# (the attention check, which only warns on the driver: tests/test_cluster_paths.py)


LORA_THROUGH_ENGINE = ["+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
                       "actor_rollout_ref.model.lora_rank=16", "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl"]


@pytest.mark.parametrize("mode", ["amir", "amir_colocate_async", "amir_separate_async"])
def test_an_unmerged_lora_synced_through_a_checkpoint_engine_is_refused_under_amir(mode):
    """verl 0.9.1 drops the adapter on that path (issue 7495): the rollout would sample the base model."""
    from amir_verl.run_config import check_amir_run

    amir = [AMIR[0], f"trainer.v1.trainer_mode={mode}", "actor_rollout_ref.actor.use_kl_loss=True"]
    with pytest.raises(ValueError, match=r"lora\.merge=False under actor_rollout_ref\.rollout\.checkpoint_engine\."
                                         r"backend=nccl.*verl issue 7495.*set actor_rollout_ref\.model\.lora\.merge=True"):
        check_amir_run(compose_verl(GRPO + amir + LORA_THROUGH_ENGINE))
    check_amir_run(compose_verl(GRPO + amir + LORA_THROUGH_ENGINE + ["actor_rollout_ref.model.lora.merge=True"]))
    check_amir_run(compose_verl(GRPO + amir + LORA_THROUGH_ENGINE[:2]))  # the naive hand-over sends the adapter


def test_verls_own_run_with_that_lora_sync_gets_a_warning_naming_the_issue(caplog):
    from amir_verl.run_config import check_any_run

    with caplog.at_level("WARNING", logger="amir_verl.run_config"):
        check_any_run(compose_verl(GRPO + ["trainer.v1.trainer_mode=separate_async"] + LORA_THROUGH_ENGINE))
    assert "verl issue 7495" in caplog.text
