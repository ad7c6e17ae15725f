"""Worker side of the verl glue: the ``amir_grpo`` / ``amir_gspo`` policy-loss modes and the actor loss.

What it hooks in verl 0.9.1:
- ``verl.trainer.ppo.core_algos.register_policy_loss``: registers ``amir_grpo`` and ``amir_gspo``, so
  ``actor_rollout_ref.actor.policy_loss.loss_mode=amir_grpo`` passes verl's config checks and
  ``verl.workers.utils.losses.ppo_loss`` computes the base part (``vanilla`` / ``gspo``) unchanged.
  A registered policy loss only sees log-probs, advantages and the mask, so it cannot compute the
  pair term itself.
- ``ActorRolloutRefWorker.set_loss_fn`` (called by :class:`amir_verl.trainer.AmirPPOTrainer`):
  installs :func:`amir_ppo_loss`, which calls verl's own ``ppo_loss`` and adds this micro-batch's
  share of ``lambda * (-J_pref)`` from the per-sample fields the driver computed
  (:mod:`amir_verl.step_batch`). No extra forward pass, no graph kept past the micro-batch.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager

import torch
from tensordict import TensorDict

from verl.trainer.ppo.core_algos import get_policy_loss_fn, register_policy_loss
from verl.utils import tensordict_utils as tu
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import no_padding_2_padding

from amir_verl.preference import (
    length_normalised_log_probs,
    pair_log_likelihood_per_sequence,
    preference_loss_share,
)
from amir_verl.step_batch import EXTRA_LOSS_SCALE, FIELD_PARTNER_SCORE, FIELD_PARTNER_SIGN, FIELD_REF_SEQ_LOGP

# loss mode -> the verl policy loss that computes its policy-gradient part
BASE_LOSS_MODE = {"amir_grpo": "vanilla", "amir_gspo": "gspo"}
AMIR_TRAINER_MODE = "amir"

_inside_amir_loss = contextvars.ContextVar("inside_amir_loss", default=False)


@contextmanager
def _amir_loss_active():
    token = _inside_amir_loss.set(True)
    try:
        yield
    finally:
        _inside_amir_loss.reset(token)


def _make_base_policy_loss(loss_mode: str):
    base_mode = BASE_LOSS_MODE[loss_mode]

    def policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                    rollout_is_weights=None):
        # Reached without amir_ppo_loss only when the run's trainer did not install it: without it the
        # preference term would be silently missing, so refuse.
        if not _inside_amir_loss.get():
            raise RuntimeError(
                f"policy_loss.loss_mode={loss_mode} needs the AMIR trainer, which adds the preference term: "
                f"add trainer.v1.trainer_mode={AMIR_TRAINER_MODE} (and keep trainer.use_v1=True)"
            )
        return get_policy_loss_fn(base_mode)(
            old_log_prob=old_log_prob,
            log_prob=log_prob,
            advantages=advantages,
            response_mask=response_mask,
            loss_agg_mode=loss_agg_mode,
            config=config,
            rollout_is_weights=rollout_is_weights,
        )

    policy_loss.__name__ = f"compute_policy_loss_{loss_mode}"
    policy_loss.__doc__ = f"The `{base_mode}` policy loss, reached through amir_ppo_loss (loss mode {loss_mode})."
    return policy_loss


for _mode in BASE_LOSS_MODE:
    register_policy_loss(_mode)(_make_base_policy_loss(_mode))


def _dense(x: torch.Tensor) -> torch.Tensor:
    """Per-sample fields may come back from TransferQueue as a jagged nested tensor of equal rows."""
    return x.to_padded_tensor(0.0) if x.is_nested else x


def amir_ppo_loss(config, model_output, data: TensorDict, dp_group=None, *, beta_dpo: float):
    """verl's ``ppo_loss`` plus this micro-batch's share of ``lambda * (-J_pref)``.

    Same signature and return as ``verl.workers.utils.losses.ppo_loss`` (bind ``config`` and
    ``beta_dpo`` with ``functools.partial``). ``data`` must carry the fields of
    :mod:`amir_verl.step_batch` and the batch-level ``amir_loss_scale``; with scale 0 (lambda = 0 or
    no pair in the step) the result is ``ppo_loss``'s, untouched.
    """
    with _amir_loss_active():
        loss, metrics = ppo_loss(config, model_output, data, dp_group)
    scale = tu.get_non_tensor_data(data=data, key=EXTRA_LOSS_SCALE, default=None)
    if scale is None:
        raise RuntimeError(
            f"the actor batch has no '{EXTRA_LOSS_SCALE}': the AMIR loss was installed but the driver did not "
            f"run the AMIR trainer's advantage step (trainer.v1.trainer_mode={AMIR_TRAINER_MODE})"
        )
    if scale == 0:
        return loss, metrics

    log_prob = no_padding_2_padding(model_output["log_probs"], data)  # (B, T) current policy
    response_mask = _dense(data["response_mask"]).bool()
    # no_padding_2_padding pads to the batch-wide max_response_len when verl recorded one; the mask
    # is padded to this micro-batch's longest response. Align the two (the extra columns are padding).
    width = max(log_prob.shape[1], response_mask.shape[1])
    log_prob = torch.nn.functional.pad(log_prob, (0, width - log_prob.shape[1]))
    response_mask = torch.nn.functional.pad(response_mask, (0, width - response_mask.shape[1]))
    policy_seq_logp = length_normalised_log_probs(log_prob, response_mask)
    f = pair_log_likelihood_per_sequence(
        policy_seq_logp,
        _dense(data[FIELD_REF_SEQ_LOGP]).to(policy_seq_logp.dtype).reshape(-1),
        _dense(data[FIELD_PARTNER_SCORE]).to(policy_seq_logp.dtype),
        _dense(data[FIELD_PARTNER_SIGN]).to(policy_seq_logp.dtype),
        beta_dpo,
    )
    # FSDP averages gradients over data-parallel ranks; scaling by dp_size makes that average a sum,
    # as verl's agg_loss does for the policy-gradient term.
    dp_size = tu.get_non_tensor_data(data=data, key="dp_size", default=1)
    return loss + preference_loss_share(f, scale * dp_size), metrics
