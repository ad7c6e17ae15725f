"""The driver's per-step AMIR fields, bad inputs, and the term after the policy has moved (several
mini-batches or epochs)."""

from functools import partial

import pytest
import torch

from amir_verl.actor_loss import amir_ppo_loss
from amir_verl.config import AmirConfig
from amir_verl.step_batch import compute_step_fields, num_mini_batches, preference_term_weight, session_final_mask
from verl.workers.utils.losses import ppo_loss
from amir_verl.testing import (
    Layout,
    actor_config,
    amir_step_fields,
    extra_info_for,
    make_step_batch,
    padded,
    response_log_probs,
    run_actor_update,
    tiny_model,
)


def simple_inputs(n=4, width=3):
    return dict(
        sequence_rewards=torch.tensor([1.0, 0.0, 1.0, 0.0][:n]),
        uids=["a", "a", "b", "b"][:n],
        response_mask=torch.ones(n, width),
        old_log_probs=-torch.ones(n, width),
        ref_log_probs=-torch.ones(n, width),
    )


@pytest.mark.parametrize("field", ["sequence_rewards", "old_log_probs", "ref_log_probs"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_inputs_raise_naming_the_input(field, bad):
    inputs = simple_inputs()
    inputs[field] = inputs[field].clone()
    inputs[field].view(-1)[1] = bad
    name = {"sequence_rewards": "sequence rewards", "old_log_probs": "old_log_probs", "ref_log_probs": "ref_log_prob"}
    with pytest.raises(ValueError, match=name[field]):
        compute_step_fields(AmirConfig(), **inputs)


def test_non_finite_values_on_padding_positions_are_ignored():
    inputs = simple_inputs()
    inputs["response_mask"][:, 2] = 0
    inputs["old_log_probs"][:, 2] = float("nan")
    assert compute_step_fields(AmirConfig(), **inputs).num_pairs == 2


def test_missing_reference_log_probs_fail_with_the_fix():
    inputs = simple_inputs()
    inputs["ref_log_probs"] = None
    with pytest.raises(ValueError, match=r"use_kl_loss=True.*ref_free"):
        compute_step_fields(AmirConfig(), **inputs)
    fields = compute_step_fields(AmirConfig(reference="ref_free"), **inputs)
    assert torch.equal(fields.ref_seq_logp, torch.zeros(4, dtype=fields.ref_seq_logp.dtype))


def test_padding_filler_and_empty_responses_never_pair():
    inputs = simple_inputs()
    inputs["response_mask"][1] = 0  # empty response in group a
    fields = compute_step_fields(AmirConfig(), **inputs, is_padding=[False, False, False, True])
    assert fields.num_pairs == 0
    assert fields.stats.groups_without_pairs == 2  # group b's only partner is filler; filler is no group
    assert torch.equal(fields.partner_sign, torch.zeros_like(fields.partner_sign))


def test_only_the_final_output_of_each_session_pairs():
    keys = ["u_0_0", "u_0_1", "u_1_0", "v_0_0"]
    assert session_final_mask(keys).tolist() == [False, True, True, True]
    with pytest.raises(ValueError, match="not of verl's form"):
        session_final_mask(["nonsense"])


def test_statistics_do_not_depend_on_batch_order():
    model, ref = tiny_model(0), tiny_model(1)
    batch = make_step_batch(model, ref, [6, 5, 4], seed=8)
    amir = AmirConfig(pair_mode="best_vs_rest", max_pairs_per_group=3)
    base = amir_step_fields(batch, amir)
    perm = torch.randperm(len(batch), generator=torch.Generator().manual_seed(0)).tolist()
    permuted = type(batch)(
        [batch.prompts[i] for i in perm], [batch.responses[i] for i in perm], batch.rewards[perm],
        [batch.uids[i] for i in perm], [batch.keys[i] for i in perm], [batch.is_padding[i] for i in perm],
        [batch.old_log_probs[i] for i in perm], [batch.ref_log_probs[i] for i in perm], [],
    )
    other = amir_step_fields(permuted, amir)
    assert base.stats == other.stats


def test_preference_term_weight():
    """lambda * M * dp / P, decided from its docstring's derivation."""
    assert preference_term_weight(0.1, num_pairs=5, num_mini_batches=1, dp_size=1) == pytest.approx(0.02)
    assert preference_term_weight(0.1, num_pairs=5, num_mini_batches=4, dp_size=1) == pytest.approx(0.08)
    assert preference_term_weight(0.1, num_pairs=5, num_mini_batches=4, dp_size=2) == pytest.approx(0.16)
    assert preference_term_weight(0.1, num_pairs=0, num_mini_batches=4, dp_size=2) == 0.0
    assert preference_term_weight(0.0, num_pairs=5, num_mini_batches=4, dp_size=2) == 0.0
    assert num_mini_batches(16, 4) == 4
    with pytest.raises(ValueError, match="multiple"):
        num_mini_batches(10, 4)


def test_after_the_policy_moved_each_sequence_meets_its_partners_as_they_were():
    """Several mini-batches or epochs: a micro-batch's term uses its own sequences' current l_theta
    and every partner's l at the start of the update (from old_log_probs), in value and gradient."""
    model, ref = tiny_model(0), tiny_model(1)
    batch = make_step_batch(model, ref, [5, 5], seed=21)
    amir = AmirConfig(beta_dpo=0.5)
    fields = amir_step_fields(batch, amir)
    with torch.no_grad():  # the policy moves after the first mini-batch's optimizer step
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    extra = extra_info_for(fields, 0.3)
    scale = 0.3 / fields.num_pairs
    micro = [0, 3, 7]  # the micro-batch at hand; its partners are mostly elsewhere
    sub = type(batch)(*[[getattr(batch, f)[i] for i in micro] if f != "rewards" else batch.rewards[micro]
                         for f in ("prompts", "responses", "rewards", "uids", "keys", "is_padding", "old_log_probs",
                                   "ref_log_probs", "advantages")])
    sub_fields = type(fields)(fields.old_seq_logp[micro], fields.ref_seq_logp[micro], fields.partner_score[micro],
                              fields.partner_sign[micro],
                              fields.stats)

    model.zero_grad()
    run_actor_update(model, sub, partial(ppo_loss, config=actor_config("vanilla")), Layout(dp=1, micro_batch_size=3),
                     extra, sub_fields)
    base = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    fn = partial(amir_ppo_loss, config=actor_config("vanilla"), beta_dpo=amir.beta_dpo)
    (amir_loss, _), = run_actor_update(model, sub, fn, Layout(dp=1, micro_batch_size=3), extra, sub_fields)
    amir_grad = [p.grad.clone() for p in model.parameters()]

    # brute force: python loops over the pairs that touch the micro-batch
    def l(i, live):
        lp = response_log_probs(model, batch.prompts[i], batch.responses[i]) if live else batch.old_log_probs[i]
        return lp.sum() / len(lp) - batch.ref_log_probs[i].sum() / len(lp)

    model.zero_grad()
    total = 0.0
    for k in micro:
        for j in range(len(batch)):
            if j == k or batch.uids[j] != batch.uids[k]:
                continue
            gap = float(batch.rewards[k] - batch.rewards[j])
            if gap > amir.delta_r:
                total = total + torch.nn.functional.logsigmoid(amir.beta_dpo * (l(k, True) - l(j, False).detach()))
            elif -gap > amir.delta_r:
                total = total + torch.nn.functional.logsigmoid(amir.beta_dpo * (l(j, False).detach() - l(k, True)))
    (-scale * total).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    for a, b, e in zip(amir_grad, base, expected, strict=True):
        torch.testing.assert_close(a - b, e, rtol=1e-5, atol=1e-7)
    # value: each pair is shared between its two members, so the micro-batch reports half of each
    base_value = run_actor_update(model, sub, partial(ppo_loss, config=actor_config("vanilla")),
                                  Layout(dp=1, micro_batch_size=3), extra, sub_fields)[0][0]
    assert float(amir_loss - base_value) == pytest.approx(-0.5 * scale * float(total), rel=1e-6)


def test_padded_helper_shapes():
    assert padded([torch.ones(2), torch.ones(3)]).shape == (2, 3)
