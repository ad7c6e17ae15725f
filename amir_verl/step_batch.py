"""From one step batch to the per-sequence AMIR fields the actor's loss needs (torch only, no verl import).

The driver runs :func:`driver_step` once per local update (once per step, but in ``separate_async``, once per
each of its local updates) on the whole batch of that update (all groups, all data parallel ranks), after old
and reference log-probs are known: :func:`compute_step_fields` mines the pairs and freezes the partners, then
:func:`gradient_signal` measures both terms and the lambda controller picks lambda. Every sequence then carries,
as ordinary per-sample fields, everything its share of the preference term needs, so the term is exact
however verl later splits the batch across ranks and micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from amir_verl import metrics
from amir_verl.config import AmirConfig
from amir_verl.lambda_control import LambdaController, StepSignal
from amir_verl.preference import (
    PreferencePairs,
    PreferenceStats,
    check_finite,
    dpo_logits,
    length_normalised_log_probs,
    mine_preference_pairs,
    pair_log_likelihood_per_sequence,
    partner_table,
    summarise_preference_pairs,
)

# Names of the per-sample fields the driver adds to verl's batch (TransferQueue) for the actor.
FIELD_REF_SEQ_LOGP = "amir_ref_seq_logp"
FIELD_PARTNER_SCORE = "amir_partner_score"
FIELD_PARTNER_SIGN = "amir_partner_sign"
# Batch-level values (verl ``extra_info``) from which the worker computes the term's weight
# (:func:`preference_term_weight`): lambda of this step, pairs of the step, mini-batches per epoch.
EXTRA_LAMBDA = "amir_lambda"
EXTRA_NUM_PAIRS = "amir_num_pairs"
EXTRA_NUM_MINI_BATCHES = "amir_num_mini_batches"


@dataclass(frozen=True)
class StepFields:
    """Per-sequence AMIR inputs of one step batch of N sequences.

    old_seq_logp: (N,) l_old, the length-normalised log-probability the update starts from.
    ref_seq_logp: (N,) l_ref (zeros when reference-free).
    partner_score: (N, W) frozen partner scores l_old - l_ref; W >= 1.
    partner_sign: (N, W) +1 / -1 / 0 (see :func:`amir_verl.preference.partner_table`).
    stats: the step's ``amir/*`` statistics at the policy the update starts from (old_log_probs).
    """

    old_seq_logp: torch.Tensor
    ref_seq_logp: torch.Tensor
    partner_score: torch.Tensor
    partner_sign: torch.Tensor
    stats: PreferenceStats

    @property
    def num_pairs(self) -> int:
        return self.stats.num_pairs


def session_final_mask(keys: Sequence[str], device: torch.device | str | None = None) -> torch.Tensor:
    """(N,) bool on ``device`` (default: the CPU): True for the last output of each agent-loop session.

    verl 0.9.1 names samples ``{uid}_{session_id}_{index}`` and its GRPO advantage uses only each
    session's final output (``compute_advantage_for_multi_trajectories``); AMIR mines pairs among the
    same outputs. Single-turn rollouts have one output per session, so every sample is final.
    """
    keys_arr = np.asarray(keys, dtype=np.str_)
    if keys_arr.size and bool(np.char.endswith(keys_arr, "_0").all()) and bool(np.char.count(keys_arr, "_").min() >= 2):
        return torch.ones(len(keys), dtype=torch.bool, device=device)  # one output per session: all final (usual)
    last: dict[str, tuple[int, int]] = {}
    for row, key in enumerate(keys):
        parts = key.rsplit("_", 2)
        if len(parts) != 3 or not parts[2].isdigit():
            raise ValueError(f"sample key {key!r} is not of verl's form '{{uid}}_{{session_id}}_{{index}}'")
        session, index = f"{parts[0]}_{parts[1]}", int(parts[2])
        if session not in last or last[session][0] < index:
            last[session] = (index, row)
    mask = torch.zeros(len(keys), dtype=torch.bool, device=device)
    mask[torch.tensor([row for _, row in last.values()], dtype=torch.long, device=device)] = True
    return mask


def compute_step_fields(
    config: AmirConfig,
    sequence_rewards: torch.Tensor,
    uids: Sequence[str],
    response_mask: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor | None,
    sample_keys: Sequence[str] | None = None,
    is_padding: Sequence[bool] | None = None,
) -> StepFields:
    """Mine the step's pairs and lay out each sequence's partners.

    Args:
        config: the run's AMIR config.
        sequence_rewards: (N,) the score that produced the advantages (sum of token-level rewards).
        uids: N group ids (verl's per-prompt ``uid``).
        response_mask: (N, T) response tokens.
        old_log_probs: (N, T) log-probs of the policy that the update starts from.
        ref_log_probs: (N, T) reference log-probs; required when ``config.reference == "ref"``.
        sample_keys: N verl sample keys, used for a layout-independent order inside each group and
            to keep only each session's final output; None treats every sample as final.
        is_padding: N flags of verl's filler samples, which never enter a pair.

    The tensors share one device (the driver's CPU in verl, or an accelerator); every tensor made here is
    made on ``old_log_probs``' device. The fields are float64 whatever the inputs' dtype (bf16 included):
    the driver computes the scores and statistics in double, the trainer ships them to the actor as float32.
    """
    n = len(uids)
    if sequence_rewards.shape != (n,) or response_mask.shape[0] != n or old_log_probs.shape != response_mask.shape:
        raise ValueError(
            f"inconsistent step batch: {n} uids, rewards {tuple(sequence_rewards.shape)}, response_mask "
            f"{tuple(response_mask.shape)}, old_log_probs {tuple(old_log_probs.shape)}"
        )
    mask = response_mask.bool()
    check_finite("sequence rewards", sequence_rewards)
    check_finite("old_log_probs (response tokens)", old_log_probs[mask])
    l_old = length_normalised_log_probs(old_log_probs.double(), mask)
    if config.reference_free:
        l_ref = torch.zeros_like(l_old)
    else:
        if ref_log_probs is None:
            raise ValueError(
                "amir.reference=ref but the batch has no reference log-probs (ref_log_prob): enable verl's "
                "reference with actor_rollout_ref.actor.use_kl_loss=True (kl_loss_coef=0.0 adds no KL), "
                "or set amir.reference=ref_free"
            )
        if ref_log_probs.shape != response_mask.shape:
            raise ValueError(f"ref_log_probs shape {tuple(ref_log_probs.shape)} != {tuple(response_mask.shape)}")
        check_finite("ref_log_prob (response tokens)", ref_log_probs[mask])
        l_ref = length_normalised_log_probs(ref_log_probs.double(), mask)

    device = old_log_probs.device
    eligible = mask.any(dim=-1)
    padding = (torch.zeros(n, dtype=torch.bool, device=device) if is_padding is None
               else torch.as_tensor(list(is_padding), dtype=torch.bool, device=device))
    eligible &= ~padding
    if sample_keys is not None:
        eligible &= session_final_mask(sample_keys, device=device)

    # Canonical order (uid, key) inside each group: tie-breaks then do not depend on how verl
    # happened to order the batch (completion order, balancing). numpy sorts the strings in C.
    _, group_of_sample = np.unique(np.asarray(uids, dtype=np.str_), return_inverse=True)
    if sample_keys is not None:
        canonical = np.lexsort((np.asarray(sample_keys, dtype=np.str_), group_of_sample))
    else:
        canonical = np.argsort(group_of_sample, kind="stable")
    perm = torch.as_tensor(canonical, dtype=torch.long, device=device)
    group_ids = torch.as_tensor(group_of_sample.astype(np.int64), device=device)
    pairs = mine_preference_pairs(
        sequence_rewards[perm],
        group_ids[perm],
        delta_r=config.delta_r,
        mode=config.pair_mode,
        max_pairs_per_group=config.max_pairs_per_group,
        eligible=eligible[perm],
    )
    pairs = PreferencePairs(preferred=perm[pairs.preferred], rejected=perm[pairs.rejected], group=pairs.group)

    logits = dpo_logits(l_old, l_ref, pairs, config.beta_dpo)
    num_groups = int(np.unique(group_of_sample[~padding.cpu().numpy()]).size)
    stats = summarise_preference_pairs(pairs, logits, l_old, num_groups)
    partner_score, partner_sign = partner_table(pairs, n, l_old - l_ref)
    if partner_score.shape[1] == 0:  # keep one (unused) column: a zero-width field is a needless corner case
        partner_score = torch.zeros(n, 1, dtype=l_old.dtype, device=device)
        partner_sign = torch.zeros(n, 1, dtype=l_old.dtype, device=device)
    return StepFields(l_old, l_ref, partner_score, partner_sign, stats)


def preference_term_weight(lambda_reg: float, num_pairs: int, num_mini_batches: int, dp_size: int) -> float:
    """The weight w of the preference term in a micro-batch's loss: w = lambda * M * dp / P.

    Each micro-batch adds ``-w * (sum_k f_k - sum_k f_k.detach() / 2)`` over its sequences k
    (:func:`amir_verl.preference.preference_loss_share`), f_k the sum of log sigmoid(z) over the pairs
    of k with k's own score live and its partners' frozen. Why each factor:

    - 1 / P: the whole-batch term is lambda * (-J_pref) = -(lambda / P) * sum_pairs log sigmoid(z).
      Summed over every sequence of the batch, the f_k count each pair twice in value, and their
      gradients add up to exactly the gradient of the pair sum (a pair's derivative splits into the
      part through its preferred and the part through its rejected member), hence the half-detached
      sum above.
    - M, the number of mini-batches (optimizer steps per epoch): verl normalises the policy-gradient
      loss per mini-batch (``global_batch_size`` and ``batch_num_tokens`` are the mini-batch's), while a
      mini-batch holds about 1/M of the pairs' sequences; weighting by M makes every optimizer step
      balance the term against the policy gradient as a single full-batch step would. M = 1 gives the
      exact gradient of ``pg_loss + lambda * (-J_pref)`` over the whole batch.
    - dp, the data-parallel size: FSDP averages gradients over ranks; multiplying by dp turns that
      average into a sum, as verl's ``agg_loss`` does for the policy-gradient term.

    0 when there is no pair or lambda is 0 (the loss is then verl's base loss, untouched).
    """
    if num_pairs == 0 or lambda_reg == 0:
        return 0.0
    return lambda_reg * num_mini_batches * dp_size / num_pairs


def num_mini_batches(num_sequences: int, mini_batch_sequences: int) -> int:
    """M = N / mini-batch size; verl's V1 actor splits the step batch into equal mini-batches."""
    if mini_batch_sequences <= 0 or num_sequences % mini_batch_sequences:
        raise ValueError(f"step batch of {num_sequences} is not a multiple of the mini-batch {mini_batch_sequences}")
    return num_sequences // mini_batch_sequences


# Sequences per chunk when the base loss is evaluated in chunks: about 2^19 tokens (2 MiB per float32
# tensor), small enough for the CPU's caches. 16.8 M tokens of vanilla: 0.64 s in chunks, 2.3 s whole.
SIGNAL_CHUNK_TOKENS = 1 << 19


def policy_gradient_at_old(
    policy_loss_fn: Callable[..., tuple[torch.Tensor, dict]],
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    chunked: bool = False,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[float, float]:
    """The base policy loss at log_prob = old_log_probs and the L2 norm of its gradient over the response
    tokens, by autograd through ``policy_loss_fn``.

    Args:
        policy_loss_fn: as for :func:`gradient_signal`.
        old_log_probs, advantages, response_mask: (N, T).
        rollout_is_weights: (N, T) verl's importance weights (``algorithm.rollout_correction.rollout_is``),
            which the actor's loss applies to the policy-gradient term, or None when the run has none.
        chunked: evaluate :data:`SIGNAL_CHUNK_TOKENS` tokens' worth of sequences at a time and add up the
            values and squared norms. Right only for a loss that is a sum of per-sequence parts under
            the whole batch's normalisers (``amir_verl.run_config.SPLIT_INVARIANT_BASE_MODES``); False
            evaluates the batch as one piece.

    Returns:
        (loss value, gradient norm).
    """
    mask = response_mask.bool()
    n, width = mask.shape
    rows = max(1, SIGNAL_CHUNK_TOKENS // max(width, 1)) if chunked else max(n, 1)
    loss_value, squared_norm = 0.0, 0.0
    for start in range(0, n, rows):
        part = slice(start, start + rows)
        log_prob = old_log_probs[part].detach().clone().requires_grad_(True)
        loss, _ = policy_loss_fn(old_log_prob=old_log_probs[part], log_prob=log_prob, advantages=advantages[part],
                                 response_mask=mask[part],
                                 rollout_is_weights=None if rollout_is_weights is None else rollout_is_weights[part])
        (grad,) = torch.autograd.grad(loss, log_prob, allow_unused=True)
        loss_value += float(loss.detach())
        if grad is not None:
            squared_norm += float(torch.linalg.vector_norm(grad * mask[part])) ** 2
    return loss_value, squared_norm**0.5


def gradient_signal(
    policy_loss_fn: Callable[..., tuple[torch.Tensor, dict]],
    step: StepFields,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    beta_dpo: float,
    chunked: bool = False,
    rollout_is_weights: torch.Tensor | None = None,
) -> StepSignal:
    """Both terms at the start of the update, measured on the driver without a model.

    Args:
        policy_loss_fn: verl's registered base policy loss, called as verl's ``ppo_loss`` calls it
            (``old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
            rollout_is_weights``), with ``loss_agg_mode`` and ``config`` bound by the caller.
        step: the step's AMIR fields (:func:`compute_step_fields`).
        old_log_probs, advantages, response_mask: (N, T) the whole step batch.
        beta_dpo: beta of the DPO logit.
        chunked, rollout_is_weights: see :func:`policy_gradient_at_old`. The preference term takes no
            importance weight: it is a fixed-data objective over the mined pairs, not an on-policy estimate.

    The policy loss is evaluated at log_prob = old_log_probs (a leaf requiring grad) and differentiated
    by autograd, so the gradient is exact for any registered loss and aggregation. The preference
    gradient is analytic: -J_pref depends on token t of sequence k only through l_k, so
    ``d(-J_pref)/dlogp_kt = -(1/P) dF/ds_k / |o_k|`` with F the sum of the f_k of
    :func:`amir_verl.preference.pair_log_likelihood_per_sequence`, and its squared L2 norm over the
    tokens is ``(1/P^2) sum_k (dF/ds_k)^2 / |o_k|``.
    """
    pg_loss, pg_grad_norm = policy_gradient_at_old(policy_loss_fn, old_log_probs, advantages, response_mask, chunked,
                                                   rollout_is_weights)

    pref_grad_norm = 0.0
    if step.num_pairs:
        own = (step.old_seq_logp - step.ref_seq_logp).detach().requires_grad_(True)
        f = pair_log_likelihood_per_sequence(own, torch.zeros_like(own), step.partner_score.to(own.dtype),
                                             step.partner_sign.to(own.dtype), beta_dpo)
        (d_own,) = torch.autograd.grad(f.sum(), own)
        lengths = response_mask.bool().sum(dim=-1).clamp(min=1).to(d_own.dtype)
        pref_grad_norm = float(torch.sqrt((d_own.square() / lengths).sum())) / step.num_pairs
    return StepSignal(
        pg_loss=pg_loss,
        pref_loss=step.stats.pref_loss,
        pg_grad_norm=pg_grad_norm,
        pref_grad_norm_per_lambda=pref_grad_norm,
        num_pairs=step.num_pairs,
    )


@dataclass(frozen=True)
class DriverStep:
    """One local update's AMIR computation on the driver (:func:`driver_step`)."""

    fields: StepFields
    signal: StepSignal
    lambda_reg: float  # the lambda this update uses
    num_mini_batches: int  # optimizer steps the actor takes on this batch

    @property
    def extra_info(self) -> dict[str, float | int]:
        """What the actor's loss reads from the batch's ``extra_info`` (:mod:`amir_verl.actor_loss`)."""
        return {EXTRA_LAMBDA: self.lambda_reg, EXTRA_NUM_PAIRS: self.fields.num_pairs,
                EXTRA_NUM_MINI_BATCHES: self.num_mini_batches}

    @property
    def metrics(self) -> dict[str, float]:
        """The update's ``amir/*`` metrics: the pair statistics, then the lambda controller's, all at the lambda
        this update uses."""
        lam, signal = self.lambda_reg, self.signal
        return {
            **self.fields.stats.as_metrics(),
            metrics.LAMBDA: lam,
            metrics.GRAD_SHARE: signal.grad_share(lam),
            metrics.PG_GRAD_NORM: signal.pg_grad_norm,
            metrics.PREF_GRAD_NORM: lam * signal.pref_grad_norm_per_lambda,
            metrics.LOSS_RATIO: signal.loss_ratio(lam),
        }


def driver_step(
    config: AmirConfig,
    controller: LambdaController,
    policy_loss_fn: Callable[..., tuple[torch.Tensor, dict]],
    *,
    sequence_rewards: torch.Tensor,
    uids: Sequence[str],
    response_mask: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor | None,
    advantages: torch.Tensor,
    mini_batch_sequences: int,
    sample_keys: Sequence[str] | None = None,
    is_padding: Sequence[bool] | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    chunked: bool = False,
) -> DriverStep:
    """What the driver computes from one local update's batch: the AMIR fields (:func:`compute_step_fields`),
    both terms' gradient signal (:func:`gradient_signal`, with ``policy_loss_fn``, ``chunked`` and
    ``rollout_is_weights`` as it takes them), and the update's lambda (``controller`` advances by one update).

    Tensors as :func:`compute_step_fields` takes them: (N,) ``sequence_rewards``; (N, T) ``response_mask``,
    ``old_log_probs``, ``ref_log_probs`` (None for ``reference=ref_free``), ``advantages`` and
    ``rollout_is_weights``; the base loss sees the last three in float32, as verl's actor computes it.
    ``mini_batch_sequences``: the actor's mini-batch in sequences."""
    fields = compute_step_fields(
        config, sequence_rewards=sequence_rewards, uids=uids, response_mask=response_mask,
        old_log_probs=old_log_probs, ref_log_probs=ref_log_probs, sample_keys=sample_keys, is_padding=is_padding,
    )
    signal = gradient_signal(
        policy_loss_fn, fields, old_log_probs=old_log_probs.float(), advantages=advantages.float(),
        response_mask=response_mask, beta_dpo=config.beta_dpo, chunked=chunked,
        rollout_is_weights=None if rollout_is_weights is None else rollout_is_weights.float(),
    )
    return DriverStep(fields, signal, controller.step(signal), num_mini_batches(len(uids), mini_batch_sequences))
