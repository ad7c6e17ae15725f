"""The AMIR policy-loss modes in verl's registry (``verl.trainer.ppo.core_algos.POLICY_LOSS_REGISTRY``).

Importing this module registers ``amir`` and the paper aliases ``amir_grpo`` / ``amir_gspo``
(:data:`amir_verl.run_config.AMIR_LOSS_MODES`), so that
``actor_rollout_ref.actor.policy_loss.loss_mode=amir`` is a mode verl knows. The registered functions are
NOT the loss and refuse to run: a verl policy loss only sees log-probs, advantages and a mask, so it
cannot compute the pair term. The loss is :func:`amir_verl.actor_loss.amir_ppo_loss`, which the AMIR
trainer installs on the actor workers.

:mod:`amir_verl.verl_plugin` imports this module right after ``core_algos`` finishes importing (a
post-import hook), so it imports nothing from verl but ``core_algos``: importing the loss
(:mod:`amir_verl.actor_loss`, which needs ``verl.workers.utils.losses``) from that hook would be
circular when ``losses`` is what imports ``core_algos``.
"""

from __future__ import annotations

from verl.trainer.ppo.core_algos import register_policy_loss

from amir_verl.run_config import AMIR_LOSS_MODES, AMIR_TRAINER_MODE


def registry_entry(loss_mode: str):
    """The function registered for ``loss_mode``: it raises ``RuntimeError`` saying how to run AMIR."""

    def refuse(*args, **kwargs):
        raise RuntimeError(
            f"policy_loss.loss_mode={loss_mode} is computed by amir_verl.actor_loss.amir_ppo_loss, which the AMIR "
            f"trainer installs: add trainer.v1.trainer_mode={AMIR_TRAINER_MODE} (or amir_colocate_async / "
            "amir_separate_async for verl's async schedules; keep trainer.use_v1=True). "
            "This registry entry only lets verl's config accept the mode."
        )

    refuse.__name__ = f"amir_registry_entry_{loss_mode}"
    refuse.__doc__ = f"Registry entry of loss mode {loss_mode}: not the loss (see amir_verl.actor_loss)."
    return refuse


for _mode in AMIR_LOSS_MODES:
    register_policy_loss(_mode)(registry_entry(_mode))
