"""Worker side of the verl glue: the AMIR actor loss.

``ActorRolloutRefWorker.set_loss_fn`` (called by :class:`amir_verl.trainer.AmirTrainerMixin`) installs
:func:`amir_ppo_loss`, which calls verl's own ``ppo_loss`` with the base loss mode
(``amir.base_loss_mode``; any mode of verl's registry) and adds this micro-batch's share of
``lambda * (-J_pref)`` from the per-sample fields the driver computed (:mod:`amir_verl.step_batch`).
No extra forward pass, no graph kept past the micro-batch. The loss modes ``amir`` / ``amir_grpo`` /
``amir_gspo`` are in verl's policy-loss registry through :mod:`amir_verl.loss_modes`, as entries that
refuse to run: this is the loss.
"""

from __future__ import annotations

import dataclasses

import torch
from tensordict import TensorDict

from verl.utils import tensordict_utils as tu
from verl.utils.metric import AggregationType, Metric
from verl.workers.config import ActorConfig
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import no_padding_2_padding

from amir_verl import metrics as metric_names
from amir_verl.preference import (
    length_normalised_log_probs,
    pair_log_likelihood_per_sequence,
    preference_loss_share,
)
from amir_verl.loss_modes import AMIR_TRAINER_MODE
from amir_verl.step_batch import (
    EXTRA_LAMBDA,
    EXTRA_NUM_MINI_BATCHES,
    EXTRA_NUM_PAIRS,
    FIELD_PARTNER_SCORE,
    FIELD_PARTNER_SIGN,
    FIELD_REF_SEQ_LOGP,
    preference_term_weight,
)

def base_actor_config(config: ActorConfig, base_loss_mode: str) -> ActorConfig:
    """The run's actor config with ``policy_loss.loss_mode`` replaced by the base mode (a copy, with its own
    ``global_batch_info``, which verl's ``ppo_loss`` fills in per micro-batch)."""
    return dataclasses.replace(config, policy_loss=dataclasses.replace(config.policy_loss, loss_mode=base_loss_mode),
                               global_batch_info={})


def _dense(x: torch.Tensor) -> torch.Tensor:
    """Per-sample fields may come back from TransferQueue as a jagged nested tensor of equal rows."""
    return x.to_padded_tensor(0.0) if x.is_nested else x


def amir_ppo_loss(config: ActorConfig, model_output, data: TensorDict, dp_group=None, *, beta_dpo: float):
    """verl's ``ppo_loss`` with the base loss mode, plus this micro-batch's share of ``lambda * (-J_pref)``.

    Same signature and return as ``verl.workers.utils.losses.ppo_loss`` (bind ``config``, an actor
    config whose loss mode is the BASE mode (:func:`base_actor_config`), and ``beta_dpo`` with
    ``functools.partial``). ``data`` must carry the fields of :mod:`amir_verl.step_batch` and the
    batch-level lambda, pair count and mini-batch count; with weight 0 (lambda = 0 or no pair in the
    step) the result is ``ppo_loss``'s, untouched.
    """
    loss, metrics = ppo_loss(config, model_output, data, dp_group)
    lambda_reg = tu.get_non_tensor_data(data=data, key=EXTRA_LAMBDA, default=None)
    if lambda_reg is None:
        raise RuntimeError(
            f"the actor batch has no '{EXTRA_LAMBDA}': the AMIR loss was installed but the driver did not "
            f"run the AMIR trainer's advantage step (trainer.v1.trainer_mode={AMIR_TRAINER_MODE})"
        )
    dp_size = tu.get_non_tensor_data(data=data, key="dp_size", default=1)
    weight = preference_term_weight(
        lambda_reg,
        num_pairs=tu.get_non_tensor_data(data=data, key=EXTRA_NUM_PAIRS, default=0),
        num_mini_batches=tu.get_non_tensor_data(data=data, key=EXTRA_NUM_MINI_BATCHES, default=1),
        dp_size=dp_size,
    )
    if weight == 0:
        return loss, metrics

    log_prob = no_padding_2_padding(model_output["log_probs"], data)  # (B, T) current policy
    response_mask = _dense(data["response_mask"]).bool()
    # no_padding_2_padding pads to the batch-wide max_response_len when verl recorded one; the mask
    # is padded to this micro-batch's longest response. Align the two (the extra columns are padding).
    width = max(log_prob.shape[1], response_mask.shape[1])
    log_prob = torch.nn.functional.pad(log_prob, (0, width - log_prob.shape[1]))
    response_mask = torch.nn.functional.pad(response_mask, (0, width - response_mask.shape[1]))
    policy_seq_logp = length_normalised_log_probs(log_prob, response_mask)
    partner_sign = _dense(data[FIELD_PARTNER_SIGN])  # (B, W): nonzero where the sequence has a pair
    f = pair_log_likelihood_per_sequence(
        policy_seq_logp,
        _dense(data[FIELD_REF_SEQ_LOGP]).to(policy_seq_logp.dtype).reshape(-1),
        _dense(data[FIELD_PARTNER_SCORE]).to(policy_seq_logp.dtype),
        partner_sign.to(policy_seq_logp.dtype),
        beta_dpo,
    )
    term = preference_loss_share(f, weight)
    # the names' meaning: amir_verl.metrics (ACTOR_PREF_TERM...). SUM: verl averages over ranks and sums over micro-batches, which is the term's value in this
    # optimizer step's loss (the ranks' gradients are averaged the same way).
    for key in (metric_names.ACTOR_PREF_TERM, metric_names.ACTOR_PREF_TERM_MIN):
        metrics[key] = Metric(value=term.detach(), aggregation=AggregationType.SUM)
    paired = (partner_sign != 0).any(dim=-1).sum().to(torch.float32)
    metrics[metric_names.ACTOR_PAIRED_SEQUENCES_MIN] = Metric(value=paired, aggregation=AggregationType.SUM)
    return loss + term, metrics
