"""The pure math core: pair mining (property tests against brute force), logits, objective, partner table."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from amir_verl.preference import (
    check_finite,
    dpo_logits,
    length_normalised_log_probs,
    mine_preference_pairs,
    pair_log_likelihood_per_sequence,
    partner_table,
    preference_loss_share,
    preference_objective,
    summarise_preference_pairs,
)

reward_values = st.sampled_from([0.0, 0.1, 0.5, 1.0, 1.05, 1.6, 2.0, 3.9, -1.0])


@st.composite
def groups(draw):
    n = draw(st.integers(0, 24))
    rewards = draw(st.lists(reward_values, min_size=n, max_size=n))
    gids = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    eligible = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return torch.tensor(rewards, dtype=torch.float64), torch.tensor(gids, dtype=torch.long), torch.tensor(
        eligible, dtype=torch.bool
    )


def brute_force_pairs(rewards, gids, eligible, delta, mode):
    n = len(rewards)
    out = set()
    for i, j in itertools.product(range(n), range(n)):
        if i == j or gids[i] != gids[j] or not (eligible[i] and eligible[j]):
            continue
        if float(rewards[i]) - float(rewards[j]) > delta:
            if mode == "best_vs_rest":
                best = max(float(rewards[k]) for k in range(n) if gids[k] == gids[i] and eligible[k])
                if float(rewards[i]) != best:
                    continue
            out.add((i, j))
    return out


@settings(max_examples=300, deadline=None)
@given(groups(), st.sampled_from([0.0, 0.05, 0.5, 1.0, 2.0]), st.sampled_from(["all", "best_vs_rest"]))
def test_mining_matches_brute_force(data, delta, mode):
    rewards, gids, eligible = data
    pairs = mine_preference_pairs(rewards, gids, delta, mode=mode, eligible=eligible)
    got = set(zip(pairs.preferred.tolist(), pairs.rejected.tolist()))
    assert len(got) == len(pairs)  # no duplicates
    assert got == brute_force_pairs(rewards, gids, eligible, delta, mode)
    for p, r, g in zip(pairs.preferred.tolist(), pairs.rejected.tolist(), pairs.group.tolist()):
        assert gids[p] == gids[r] == g  # no pair crosses groups
        assert float(rewards[p]) - float(rewards[r]) > delta  # the margin holds


@settings(max_examples=200, deadline=None)
@given(groups(), st.sampled_from([0.0, 0.5]), st.integers(1, 6))
def test_cap_keeps_largest_gaps(data, delta, cap):
    rewards, gids, eligible = data
    full = mine_preference_pairs(rewards, gids, delta, eligible=eligible)
    capped = mine_preference_pairs(rewards, gids, delta, max_pairs_per_group=cap, eligible=eligible)
    full_set = set(zip(full.preferred.tolist(), full.rejected.tolist()))
    capped_set = set(zip(capped.preferred.tolist(), capped.rejected.tolist()))
    assert capped_set <= full_set
    for g in set(gids.tolist()):
        in_group = [(p, r) for p, r in full_set if gids[p] == g]
        kept = [(p, r) for p, r in capped_set if gids[p] == g]
        assert len(kept) == min(cap, len(in_group))
        if kept and len(kept) < len(in_group):
            gap = lambda pr: float(rewards[pr[0]] - rewards[pr[1]])  # noqa: E731
            dropped = set(in_group) - set(kept)
            assert min(map(gap, kept)) >= max(map(gap, dropped))


def test_mining_does_not_depend_on_batch_order():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.5, 1.0])
    gids = torch.tensor([0, 0, 1, 1, 0, 0])
    perm = torch.tensor([5, 3, 0, 4, 2, 1])
    a = mine_preference_pairs(rewards, gids, 0.2, mode="best_vs_rest")
    b = mine_preference_pairs(rewards[perm], gids[perm], 0.2, mode="best_vs_rest")
    pa = set(zip(a.preferred.tolist(), a.rejected.tolist()))
    pb = {(int(perm[p]), int(perm[r])) for p, r in zip(b.preferred.tolist(), b.rejected.tolist())}
    assert pa == pb == {(0, 1), (0, 4), (5, 1), (5, 4), (2, 3)}


def test_all_mode_pair_count_is_count_of_qualifying_ordered_pairs():
    rewards = torch.tensor([3.0, 2.0, 1.0, 0.0, 0.0])  # one group
    pairs = mine_preference_pairs(rewards, torch.zeros(5, dtype=torch.long), 0.5)
    assert len(pairs) == 4 + 3 + 2  # 3 > {2, 1, 0, 0}; 2 > {1, 0, 0}; 1 > {0, 0}


@pytest.mark.parametrize(
    "rewards,gids",
    [
        ([], []),  # empty batch
        ([1.0], [0]),  # a group of one
        ([1.0, 1.0, 1.0], [0, 0, 0]),  # all-equal rewards
        ([1.0, 0.7], [0, 0]),  # within the margin
        ([1.0, 0.0], [0, 1]),  # different groups
    ],
)
def test_no_pairs_cases(rewards, gids):
    pairs = mine_preference_pairs(torch.tensor(rewards), torch.tensor(gids, dtype=torch.long), 0.5)
    assert len(pairs) == 0
    z = dpo_logits(torch.zeros(len(rewards)), torch.zeros(len(rewards)), pairs, 0.2)
    j = preference_objective(z)
    assert j.item() == 0.0 and not torch.isnan(j)
    stats = summarise_preference_pairs(pairs, z, torch.zeros(len(rewards)), num_groups=len(set(gids)))
    assert stats.num_pairs == 0 and stats.pref_loss == 0.0 and stats.groups_without_pairs == len(set(gids))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_rewards_raise(bad):
    with pytest.raises(ValueError, match=r"rewards contains 1 non-finite value.*index \(1,\)"):
        mine_preference_pairs(torch.tensor([1.0, bad, 0.0]), torch.zeros(3, dtype=torch.long), 0.5)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(delta_r=-0.1), "delta_r"),
        (dict(delta_r=0.5, mode="topk"), "pair mode"),
        (dict(delta_r=0.5, max_pairs_per_group=0), "max_pairs_per_group"),
    ],
)
def test_bad_mining_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mine_preference_pairs(torch.tensor([1.0, 0.0]), torch.zeros(2, dtype=torch.long), **kwargs)


def test_length_normalised_log_probs_and_empty_response():
    lp = torch.tensor([[-1.0, -3.0, 99.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert length_normalised_log_probs(lp, mask).tolist() == [-2.0, 0.0]


def test_dpo_logits_and_objective_by_hand():
    l_theta = torch.tensor([-1.0, -2.0, -0.5])
    l_ref = torch.tensor([-1.5, -1.0, -0.5])
    pairs = mine_preference_pairs(torch.tensor([1.0, 0.0, 0.0]), torch.zeros(3, dtype=torch.long), 0.5)
    z = dpo_logits(l_theta, l_ref, pairs, beta=0.2)
    # pairs (0,1) and (0,2): scores s = [0.5, -1.0, 0.0]
    assert z.tolist() == pytest.approx([0.2 * 1.5, 0.2 * 0.5])
    expected = (math.log(1 / (1 + math.exp(-0.3))) + math.log(1 / (1 + math.exp(-0.1)))) / 2
    assert preference_objective(z).item() == pytest.approx(expected)
    stats = summarise_preference_pairs(pairs, z, l_theta, num_groups=1)
    assert stats.pair_accuracy == 1.0
    assert stats.margin == pytest.approx(((-1.0 + 2.0) + (-1.0 + 0.5)) / 2)


@settings(max_examples=100, deadline=None)
@given(groups(), st.floats(0.05, 2.0))
def test_partner_decomposition_matches_pair_objective(data, beta):
    """On-policy, the per-sequence shares equal -sum log sigmoid(z) in value and gradient."""
    rewards, gids, eligible = data
    n = len(rewards)
    pairs = mine_preference_pairs(rewards, gids, 0.2, eligible=eligible)
    torch.manual_seed(n)
    l_theta = torch.randn(n, dtype=torch.float64, requires_grad=True)
    l_ref = torch.randn(n, dtype=torch.float64)
    direct = -torch.nn.functional.logsigmoid(dpo_logits(l_theta, l_ref, pairs, beta)).sum()
    (g_direct,) = torch.autograd.grad(direct, l_theta) if len(pairs) else (torch.zeros(n, dtype=torch.float64),)
    score, sign = partner_table(pairs, n, (l_theta - l_ref).detach())
    f = pair_log_likelihood_per_sequence(l_theta, l_ref, score, sign, beta)
    share = preference_loss_share(f, 1.0)
    (g_share,) = torch.autograd.grad(share, l_theta, allow_unused=True) if n else (torch.zeros(0, dtype=torch.float64),)
    g_share = torch.zeros(n, dtype=torch.float64) if g_share is None else g_share
    assert float(share) == pytest.approx(float(direct), abs=1e-12)
    torch.testing.assert_close(g_share, g_direct, rtol=1e-12, atol=1e-12)
    assert (sign != 0).sum() == 2 * len(pairs)


def test_partner_frozen_off_policy():
    """Off-policy, sequence k's term uses its own live score against its partners' scores at the start."""
    pairs = mine_preference_pairs(torch.tensor([1.0, 0.0]), torch.zeros(2, dtype=torch.long), 0.5)
    frozen = torch.tensor([-1.0, -2.0], dtype=torch.float64)  # s at the start of the update
    score, sign = partner_table(pairs, 2, frozen)
    live = torch.tensor([-0.5, -3.0], dtype=torch.float64)  # the policy moved since
    f = pair_log_likelihood_per_sequence(live, torch.zeros(2, dtype=torch.float64), score, sign, 1.0)
    ls = torch.nn.functional.logsigmoid
    assert f[0].item() == pytest.approx(ls(torch.tensor(-0.5 - -2.0)).item())  # own live vs frozen partner
    assert f[1].item() == pytest.approx(ls(torch.tensor(-1.0 - -3.0)).item())


def test_check_finite_names_the_input():
    with pytest.raises(ValueError, match="old_log_probs"):
        check_finite("old_log_probs", torch.tensor([[0.0, float("nan")]]))
