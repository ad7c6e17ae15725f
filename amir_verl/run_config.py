"""Checks of a whole verl run config for AMIR, run before any worker or model starts.

They run twice: on the driver inside verl's ``validate_config`` (wrapped by
:func:`install_early_config_check`, so ``main_ppo`` stops before Ray starts), and in
``AmirPPOTrainer.__init__`` (for code that builds the trainer without ``main_ppo``).
"""

from __future__ import annotations

import functools

from omegaconf import DictConfig
from verl.trainer.ppo.utils import need_reference_policy

from amir_verl.config import CONFIG_NAMESPACE, AmirConfig

LOSS_MODE_KEY = "actor_rollout_ref.actor.policy_loss.loss_mode"
AMIR_LOSS_MODES = ("amir_grpo", "amir_gspo")


def validate_amir_run(config: DictConfig) -> AmirConfig:
    """Return the run's :class:`AmirConfig`, or raise ``ValueError`` naming the key or override to fix."""
    loss_mode = config.actor_rollout_ref.actor.policy_loss.get("loss_mode", "vanilla")
    if loss_mode not in AMIR_LOSS_MODES:
        raise ValueError(
            f"the AMIR trainer needs {LOSS_MODE_KEY} in {AMIR_LOSS_MODES} (amir_grpo on GRPO's `vanilla` loss, "
            f"amir_gspo on `gspo`), got {loss_mode!r}"
        )
    amir = AmirConfig.from_mapping(config.get(CONFIG_NAMESPACE))
    if not amir.reference_free and not need_reference_policy(config):
        raise ValueError(
            f"{CONFIG_NAMESPACE}.reference=ref needs reference log-probs, which this run does not compute: add "
            "actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.0 (the coefficient "
            f"0 adds no KL term), or set {CONFIG_NAMESPACE}.reference=ref_free"
        )
    distillation = config.get("distillation")
    if distillation is not None and distillation.get("enabled", False):
        raise ValueError("AMIR does not combine with on-policy distillation: set distillation.enabled=False")
    return amir


AMIR_TRAINER_MODE_KEY = "trainer.v1.trainer_mode"


def check_amir_run(config: DictConfig) -> None:
    """For a run that asks for AMIR (loss mode or trainer mode): everything :func:`validate_amir_run`
    checks, plus that both switches are set and the V1 trainer is used. Other runs: nothing."""
    loss_mode = config.actor_rollout_ref.actor.policy_loss.get("loss_mode", "vanilla")
    trainer = config.get("trainer", {})
    trainer_mode = trainer.get("v1", {}).get("trainer_mode", "sync")
    if loss_mode not in AMIR_LOSS_MODES and trainer_mode != "amir":
        return
    if loss_mode in AMIR_LOSS_MODES and not trainer.get("use_v1", True):
        raise ValueError(f"{LOSS_MODE_KEY}={loss_mode} needs verl's V1 trainer: set trainer.use_v1=True")
    if loss_mode in AMIR_LOSS_MODES and trainer_mode != "amir":
        raise ValueError(
            f"{LOSS_MODE_KEY}={loss_mode} needs the AMIR trainer, which adds the preference term: add "
            f"{AMIR_TRAINER_MODE_KEY}=amir (got {trainer_mode!r})"
        )
    validate_amir_run(config)


def install_early_config_check() -> None:
    """Wrap ``verl.utils.config.validate_config`` so that it also runs :func:`check_amir_run`.

    ``verl.trainer.main_ppo.main`` calls it on the driver before ``ray.init``; ``main_ppo`` binds the
    name at import, after ``import verl`` has loaded this plugin, so it gets the wrapper. Guarded by
    ``tests/test_verl_seams.py``.
    """
    import verl.utils.config as verl_config

    upstream = verl_config.validate_config
    if getattr(upstream, "_amir_checked", False):
        return

    @functools.wraps(upstream)
    def validate_config(config, *args, **kwargs):
        result = upstream(config, *args, **kwargs)
        check_amir_run(config)
        return result

    validate_config._amir_checked = True
    verl_config.validate_config = validate_config
