"""From one step batch to the per-sequence AMIR fields the actor's loss needs (torch only, no verl import).

The driver runs :func:`compute_step_fields` once per step on the whole batch (all groups, all data
parallel ranks), after old and reference log-probs are known. Every sequence then carries, as
ordinary per-sample fields, everything its share of the preference term needs, so the term is exact
however verl later splits the batch across ranks and micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from amir_verl.config import AmirConfig
from amir_verl.preference import (
    PreferencePairs,
    PreferenceStats,
    check_finite,
    dpo_logits,
    length_normalised_log_probs,
    mine_preference_pairs,
    partner_table,
    summarise_preference_pairs,
)

# Names of the per-sample fields the driver adds to verl's batch (TransferQueue) for the actor.
FIELD_REF_SEQ_LOGP = "amir_ref_seq_logp"
FIELD_PARTNER_SCORE = "amir_partner_score"
FIELD_PARTNER_SIGN = "amir_partner_sign"
# Batch-level value (verl ``extra_info``): the weight of the whole preference term, see ``loss_scale``.
EXTRA_LOSS_SCALE = "amir_loss_scale"


@dataclass(frozen=True)
class StepFields:
    """Per-sequence AMIR inputs of one step batch of N sequences.

    ref_seq_logp: (N,) l_ref (zeros when reference-free).
    partner_score: (N, W) frozen partner scores l_old - l_ref; W >= 1.
    partner_sign: (N, W) +1 / -1 / 0 (see :func:`amir_verl.preference.partner_table`).
    stats: the step's ``amir/*`` statistics at the policy that generated the batch.
    """

    ref_seq_logp: torch.Tensor
    partner_score: torch.Tensor
    partner_sign: torch.Tensor
    stats: PreferenceStats

    @property
    def num_pairs(self) -> int:
        return self.stats.num_pairs


def session_final_mask(keys: Sequence[str]) -> torch.Tensor:
    """(N,) bool: True for the last output of each agent-loop session.

    verl 0.9.1 names samples ``{uid}_{session_id}_{index}`` and its GRPO advantage uses only each
    session's final output (``compute_advantage_for_multi_trajectories``); AMIR mines pairs among the
    same outputs. Single-turn rollouts have one output per session, so every sample is final.
    """
    keys_arr = np.asarray(keys, dtype=np.str_)
    if keys_arr.size and bool(np.char.endswith(keys_arr, "_0").all()) and bool(np.char.count(keys_arr, "_").min() >= 2):
        return torch.ones(len(keys), dtype=torch.bool)  # one output per session: all final (the usual case)
    last: dict[str, tuple[int, int]] = {}
    for row, key in enumerate(keys):
        parts = key.rsplit("_", 2)
        if len(parts) != 3 or not parts[2].isdigit():
            raise ValueError(f"sample key {key!r} is not of verl's form '{{uid}}_{{session_id}}_{{index}}'")
        session, index = f"{parts[0]}_{parts[1]}", int(parts[2])
        if session not in last or last[session][0] < index:
            last[session] = (index, row)
    mask = torch.zeros(len(keys), dtype=torch.bool)
    mask[[row for _, row in last.values()]] = True
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

    eligible = mask.any(dim=-1)
    padding = torch.zeros(n, dtype=torch.bool) if is_padding is None else torch.as_tensor(list(is_padding), dtype=torch.bool)
    eligible &= ~padding
    if sample_keys is not None:
        eligible &= session_final_mask(sample_keys)

    # Canonical order (uid, key) inside each group: tie-breaks then do not depend on how verl
    # happened to order the batch (completion order, balancing). numpy sorts the strings in C.
    _, group_of_sample = np.unique(np.asarray(uids, dtype=np.str_), return_inverse=True)
    if sample_keys is not None:
        canonical = np.lexsort((np.asarray(sample_keys, dtype=np.str_), group_of_sample))
    else:
        canonical = np.argsort(group_of_sample, kind="stable")
    perm = torch.from_numpy(canonical)
    group_ids = torch.from_numpy(group_of_sample.astype(np.int64))
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
    num_groups = int(np.unique(group_of_sample[~padding.numpy()]).size)
    stats = summarise_preference_pairs(pairs, logits, l_old, num_groups)
    partner_score, partner_sign = partner_table(pairs, n, l_old - l_ref)
    if partner_score.shape[1] == 0:  # keep one (unused) column: a zero-width field is a needless corner case
        partner_score = torch.zeros(n, 1, dtype=l_old.dtype)
        partner_sign = torch.zeros(n, 1, dtype=l_old.dtype)
    return StepFields(l_ref, partner_score, partner_sign, stats)


def loss_scale(lambda_reg: float, num_pairs: int, num_sequences: int, mini_batch_sequences: int) -> float:
    """Weight of the summed pair log-likelihoods in each optimizer step's loss.

    ``lambda / P`` makes one update over the whole batch minimise ``lambda * (-J_pref)``. verl takes
    one optimizer step per mini-batch and normalises the policy-gradient term per mini-batch, so with
    M = N / mini_batch_sequences mini-batches the term is multiplied by M: each step then weighs it
    against the policy gradient exactly as a single full-batch step would. 0 when there is no pair.
    """
    if num_pairs == 0 or lambda_reg == 0:
        return 0.0
    if num_sequences % mini_batch_sequences:
        raise ValueError(f"step batch of {num_sequences} is not a multiple of the mini-batch {mini_batch_sequences}")
    return lambda_reg * (num_sequences // mini_batch_sequences) / num_pairs
