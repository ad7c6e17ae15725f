"""Checks of a whole verl run config for AMIR, run before any worker or model starts."""

from __future__ import annotations

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
