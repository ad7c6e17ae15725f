"""The AMIR preference term in pure torch (no verl import).

Notation (the paper, arXiv 2601.03661, section 2): a step batch holds N response sequences, each in
one rollout group (one prompt). Inside a group, response i is preferred over j when
``r_i - r_j > delta_r``. For a pair,

    z_ij = beta * [(l_theta(i) - l_ref(i)) - (l_theta(j) - l_ref(j))]

with ``l_m`` the length-normalised sequence log-probability, and

    J_pref = mean over all mined pairs of the batch of log sigmoid(z_ij)      (0 when there are none)

The functions below are small and independent so that the driver (:mod:`amir_verl.step_batch`,
:mod:`amir_verl.trainer`), the actor's loss (:mod:`amir_verl.actor_loss`), the tests and the benchmarks
can each use exactly the piece they need.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from amir_verl import metrics

PAIR_MODES = ("all", "best_vs_rest")


def at_least_float32(dtype: torch.dtype) -> torch.dtype:
    """The dtype AMIR computes in for inputs of ``dtype``: float32 for bf16/fp16 (or integer) inputs, the
    input's own dtype when it is float32 or wider. A length-normalised sum over thousands of bf16 log-probs
    would keep about 3 significant digits; float32 and float64 inputs are computed exactly as before."""
    return torch.promote_types(dtype, torch.float32)


@dataclass(frozen=True)
class PreferencePairs:
    """Mined pairs, all of shape (P,): ``preferred[p]`` beats ``rejected[p]`` inside group ``group[p]``.

    Indices refer to positions in the inputs of :func:`mine_preference_pairs`; ``group`` holds the
    caller's group ids. Pairs are ordered by group, then preferred index, then rejected index (the
    capped mode orders a group's kept pairs by decreasing reward gap instead).
    """

    preferred: torch.Tensor
    rejected: torch.Tensor
    group: torch.Tensor

    def __len__(self) -> int:
        return int(self.preferred.numel())


def check_finite(name: str, values: torch.Tensor) -> None:
    """Raise ``ValueError`` naming ``name`` and the first bad position when ``values`` has NaN or inf."""
    bad = ~torch.isfinite(values)
    if bool(bad.any()):
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{name} contains {int(bad.sum())} non-finite value(s) (NaN or inf), first at index {first}: "
            f"{values[first].item()}"
        )


def mine_preference_pairs(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    delta_r: float,
    mode: str = "all",
    max_pairs_per_group: int | None = None,
    eligible: torch.Tensor | None = None,
) -> PreferencePairs:
    """Mine the ordered pairs ``(i, j)`` of each group with ``rewards[i] - rewards[j] > delta_r``.

    Args:
        rewards: (N,) float, the sequence-level reward of each response. NaN/inf raise ``ValueError``.
        group_ids: (N,) int64, the group (prompt) of each response; any integers, any order.
        delta_r: strict reward margin, >= 0.
        mode: ``"all"``: every qualifying ordered pair. ``"best_vs_rest"``: only pairs whose preferred
            side has the group's maximal reward (every response tied at the maximum counts as best, so
            the result does not depend on the order of the batch).
        max_pairs_per_group: keep at most this many pairs per group, those with the largest reward gap;
            among equal gaps the lower (preferred, rejected) indices win. ``None``: no cap.
        eligible: (N,) bool, responses allowed in pairs (False for empty responses or padding filler).

    Returns:
        :class:`PreferencePairs`; empty (P = 0) when nothing qualifies.
    """
    if mode not in PAIR_MODES:
        raise ValueError(f"pair mode must be one of {PAIR_MODES}, got {mode!r}")
    if delta_r < 0:
        raise ValueError(f"delta_r must be >= 0, got {delta_r}")
    if max_pairs_per_group is not None and max_pairs_per_group < 1:
        raise ValueError(f"max_pairs_per_group must be >= 1 or None, got {max_pairs_per_group}")
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must be 1-D of equal length, got {tuple(rewards.shape)} and "
            f"{tuple(group_ids.shape)}"
        )
    check_finite("rewards", rewards)
    n = rewards.numel()
    device = rewards.device
    if eligible is None:
        eligible = torch.ones(n, dtype=torch.bool, device=device)
    empty = torch.zeros(0, dtype=torch.long, device=device)
    if n == 0 or not bool(eligible.any()):
        return PreferencePairs(empty, empty, empty)

    # Lay the groups out as rows of a (num_groups, width) table so every comparison is one tensor op.
    index = torch.arange(n, device=device)
    order = torch.argsort(group_ids, stable=True)  # stable: keeps the caller's order inside a group
    sorted_groups = group_ids[order]
    unique_groups, counts = torch.unique_consecutive(sorted_groups, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    row = torch.repeat_interleave(torch.arange(len(unique_groups), device=device), counts)
    column = index - starts[row]
    width = int(counts.max())
    table_index = torch.full((len(unique_groups), width), -1, dtype=torch.long, device=device)
    table_index[row, column] = order
    present = table_index >= 0
    safe_index = table_index.clamp(min=0)
    table_ok = present & eligible[safe_index]
    table_reward = torch.where(table_ok, rewards.to(torch.float64)[safe_index],
                               torch.zeros((), dtype=torch.float64, device=device))

    gap = table_reward.unsqueeze(2) - table_reward.unsqueeze(1)  # (groups, width, width): r_i - r_j
    qualifies = (gap > delta_r) & table_ok.unsqueeze(2) & table_ok.unsqueeze(1)
    if mode == "best_vs_rest":
        masked = torch.where(table_ok, table_reward, torch.full_like(table_reward, -torch.inf))
        is_best = table_ok & (masked == masked.max(dim=1, keepdim=True).values)
        qualifies &= is_best.unsqueeze(2)

    if max_pairs_per_group is not None and max_pairs_per_group < width * width:
        # Rank each group's candidate pairs by gap (descending); a stable sort keeps index order on ties.
        flat_gap = torch.where(qualifies, gap, torch.full_like(gap, -torch.inf)).flatten(1)
        ranked = torch.argsort(flat_gap, dim=1, descending=True, stable=True)[:, :max_pairs_per_group]
        keep = torch.zeros_like(flat_gap, dtype=torch.bool)
        keep.scatter_(1, ranked, True)
        kept = qualifies & keep.view_as(qualifies)
        ranked_ok = kept.flatten(1).gather(1, ranked)
        g, slot = ranked_ok.nonzero(as_tuple=True)
        flat = ranked[g, slot]
        i_col, j_col = flat // width, flat % width
    else:
        g, i_col, j_col = qualifies.nonzero(as_tuple=True)
    preferred = table_index[g, i_col]
    rejected = table_index[g, j_col]
    return PreferencePairs(preferred, rejected, unique_groups[g])


def length_normalised_log_probs(token_log_probs: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``l(o) = (1/|o|) * sum_t log pi(o_t | q, o_<t)`` over the response tokens.

    Args:
        token_log_probs: (N, T) per-token log-probabilities (padding positions may hold anything finite).
        response_mask: (N, T) 1 for response tokens, 0 for padding.

    Returns:
        (N,) the mean log-probability per sequence, in float32 or the inputs' wider dtype
        (:func:`at_least_float32`); 0 for an empty response (mask all zero), which callers exclude from
        pairs since it has no token to push.
    """
    token_log_probs = token_log_probs.to(at_least_float32(token_log_probs.dtype))
    mask = response_mask.to(token_log_probs.dtype)
    lengths = mask.sum(dim=-1)
    return (token_log_probs * mask).sum(dim=-1) / lengths.clamp(min=1)


def dpo_logits(
    policy_seq_logp: torch.Tensor,
    ref_seq_logp: torch.Tensor,
    pairs: PreferencePairs,
    beta: float,
) -> torch.Tensor:
    """z = beta * [(l_theta(i) - l_ref(i)) - (l_theta(j) - l_ref(j))], shape (P,).

    ``policy_seq_logp`` and ``ref_seq_logp`` are (N,); pass zeros as ``ref_seq_logp`` for the
    reference-free variant (l_ref = 0). Computed in float32 or the inputs' wider dtype.
    """
    dtype = at_least_float32(torch.promote_types(policy_seq_logp.dtype, ref_seq_logp.dtype))
    score = policy_seq_logp.to(dtype) - ref_seq_logp.to(dtype)
    return beta * (score[pairs.preferred] - score[pairs.rejected])


def preference_objective(logits: torch.Tensor) -> torch.Tensor:
    """J_pref = mean_p log sigmoid(z_p); exactly 0 (never NaN) when there is no pair. Shape (), float32 or wider."""
    logits = logits.to(at_least_float32(logits.dtype))
    if logits.numel() == 0:
        return logits.new_zeros(())
    return F.logsigmoid(logits).mean()


def partner_table(
    pairs: PreferencePairs, num_sequences: int, frozen_score: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence list of the pairs it belongs to, for the micro-batch loss.

    For pair (i, j), sequence i gets an entry (partner score s_j, sign +1) and j gets (s_i, sign -1),
    where ``frozen_score`` (N,) is s = l_old - l_ref, the score at the start of the update.

    Returns:
        partner_score: (N, W) float, W = the largest number of pairs a sequence belongs to (0 if none).
        partner_sign: (N, W) float in {+1, -1, 0}; 0 marks an unused slot.
        Both on ``frozen_score``'s device, in its dtype or float32 when it is narrower.
    """
    device = frozen_score.device
    frozen_score = frozen_score.to(at_least_float32(frozen_score.dtype))
    owner = torch.cat([pairs.preferred, pairs.rejected])
    partner = torch.cat([pairs.rejected, pairs.preferred])
    sign = torch.cat(
        [
            torch.ones(len(pairs), device=device, dtype=frozen_score.dtype),
            -torch.ones(len(pairs), device=device, dtype=frozen_score.dtype),
        ]
    )
    counts = torch.bincount(owner, minlength=num_sequences)
    width = int(counts.max()) if owner.numel() else 0
    score = torch.zeros(num_sequences, width, dtype=frozen_score.dtype, device=device)
    signs = torch.zeros(num_sequences, width, dtype=frozen_score.dtype, device=device)
    if owner.numel():
        order = torch.argsort(owner, stable=True)
        owner_sorted = owner[order]
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(owner.numel(), device=device) - starts[owner_sorted]
        score[owner_sorted, slot] = frozen_score[partner[order]]
        signs[owner_sorted, slot] = sign[order]
    return score, signs


def pair_log_likelihood_per_sequence(
    policy_seq_logp: torch.Tensor,
    ref_seq_logp: torch.Tensor,
    partner_score: torch.Tensor,
    partner_sign: torch.Tensor,
    beta: float,
) -> torch.Tensor:
    """f_k = sum over the pairs of sequence k of log sigmoid(z), with k's own score live and the
    partner's score frozen (from :func:`partner_table`).

    Args:
        policy_seq_logp: (M,) l_theta of the sequences of a micro-batch, carrying the graph.
        ref_seq_logp: (M,) l_ref of the same sequences (zeros when reference-free).
        partner_score: (M, W) frozen partner scores s = l_old - l_ref.
        partner_sign: (M, W) +1 where k is preferred, -1 where k is rejected, 0 for unused slots.

    Returns:
        (M,) f_k, in float32 or the inputs' wider dtype. On-policy (l_theta == l_old) the sum over all k
        of f_k is twice the sum of log sigmoid(z) over the pairs, and the sum of the gradients of f_k is
        exactly the gradient of that pair sum: each pair's derivative splits into the part through i and
        the part through j.
    """
    dtype = policy_seq_logp.dtype
    for other in (ref_seq_logp, partner_score, partner_sign):
        dtype = torch.promote_types(dtype, other.dtype)
    dtype = at_least_float32(dtype)
    own = (policy_seq_logp.to(dtype) - ref_seq_logp.to(dtype)).unsqueeze(-1)
    partner_sign = partner_sign.to(dtype)
    logits = beta * partner_sign * (own - partner_score.to(dtype))
    return (F.logsigmoid(logits) * partner_sign.abs()).sum(dim=-1)


def preference_loss_share(pair_log_likelihood: torch.Tensor, weight: float | torch.Tensor) -> torch.Tensor:
    """A micro-batch's share of ``-weight * sum_pairs log sigmoid(z)``; shape ().

    Its value is ``-weight * sum(f)/2`` (each pair is counted once over the two sequences it joins)
    and its gradient is ``-weight * grad(sum(f))``, so the shares of all micro-batches of all ranks
    add up to the loss of the whole batch in value and, on-policy, in gradient.
    """
    f = pair_log_likelihood
    return -weight * (f.sum() - 0.5 * f.detach().sum())


@dataclass(frozen=True)
class PreferenceStats:
    """Scalars logged as ``amir/*`` each step."""

    pref_loss: float  # -J_pref
    num_pairs: int
    pairs_per_group: float
    groups_without_pairs: int
    pair_accuracy: float  # share of pairs with z > 0
    margin: float  # mean l_theta(preferred) - l_theta(rejected)

    def as_metrics(self) -> dict[str, float]:
        """The step's ``amir/*`` pair statistics, each under :data:`amir_verl.metrics.PREFIX` + its field."""
        return {metrics.PREFIX + k: float(v) for k, v in self.__dict__.items()}


def summarise_preference_pairs(
    pairs: PreferencePairs, logits: torch.Tensor, policy_seq_logp: torch.Tensor, num_groups: int
) -> PreferenceStats:
    """Step statistics from the mined pairs, their logits (P,) and l_theta (N,) over ``num_groups`` groups."""
    num_pairs = len(pairs)
    if num_pairs == 0:
        return PreferenceStats(0.0, 0, 0.0, num_groups, 0.0, 0.0)
    groups_with_pairs = int(torch.unique(pairs.group).numel())
    margin = (policy_seq_logp[pairs.preferred] - policy_seq_logp[pairs.rejected]).mean()
    return PreferenceStats(
        pref_loss=float(-preference_objective(logits)),
        num_pairs=num_pairs,
        pairs_per_group=num_pairs / max(num_groups, 1),
        groups_without_pairs=num_groups - groups_with_pairs,
        pair_accuracy=float((logits > 0).double().mean()),
        margin=float(margin),
    )
