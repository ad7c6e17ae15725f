"""Exactness of the shipped actor loss against brute-force autograd (issue 2, item 4).

For one on-policy update (one mini-batch, one epoch) the gradient accumulated over any split of the
step batch across data-parallel ranks and micro-batches must equal the gradient of
``pg_loss + lambda * (-J_pref)`` over the whole batch, J_pref computed by its definition.
"""

from functools import partial

import pytest
import torch

from amir_verl.actor_loss import amir_ppo_loss
from amir_verl.config import AmirConfig
from verl.utils import tensordict_utils as tu
from verl.workers.utils.losses import ppo_loss

from tests.verl_batch import (
    Layout,
    actor_config,
    actor_tensordict,
    amir_step_fields,
    brute_force_pref_objective,
    extra_info_for,
    grads,
    make_step_batch,
    nested,
    plain_metrics,
    run_actor_update,
    tiny_model,
    token_log_probs,
)

LAMBDA = 0.7  # large, so that a wrong preference gradient cannot hide under the policy gradient

LAYOUTS = [
    pytest.param(Layout(dp=1, micro_batch_size=24), id="dp1-one-micro-batch"),
    pytest.param(Layout(dp=1, micro_batch_size=3, seed=1), id="dp1-micro3-shuffled"),
    pytest.param(Layout(dp=2, micro_batch_size=4, seed=2), id="dp2-micro4"),
    pytest.param(Layout(dp=4, micro_batch_size=1, seed=3), id="dp4-micro1"),
    pytest.param(Layout(dp=3, micro_batch_size=2, seed=4), id="dp3-micro2"),
    pytest.param(Layout(dp=2, max_token_len=40, seed=5), id="dp2-dynamic-bsz"),
    pytest.param(Layout(dp=1, max_token_len=25, seed=6), id="dp1-dynamic-bsz-small"),
]

BASE = {"amir_grpo": ("vanilla", "token-mean"), "amir_gspo": ("gspo", "seq-mean-token-mean")}


@pytest.fixture(scope="module")
def models():
    return tiny_model(seed=0), tiny_model(seed=1)


def make_batch(models, seed=0):
    model, ref = models
    # 20 real samples in 5 groups (one of size 1, one with an empty response) + 4 V1 filler samples
    return make_step_batch(model, ref, [6, 1, 5, 4, 4], seed=seed, num_padding=4, empty_response_at=3)


def whole_batch_base_loss(model, batch, loss_mode):
    """verl's base-mode ppo_loss over the whole step batch in one piece (dp 1, one micro-batch)."""
    base_mode, agg = BASE[loss_mode]
    order = list(range(len(batch)))
    td = actor_tensordict(batch, order)
    total_tokens = int(sum(batch.response_mask(i).sum() for i in order))
    tu.assign_non_tensor(td, dp_size=1, batch_num_tokens=total_tokens, global_batch_size=len(batch))
    log_probs = nested([token_log_probs(model, x) for x in td["input_ids"].unbind()])
    base_loss, _ = ppo_loss(actor_config(base_mode, agg), {"log_probs": log_probs}, td)
    return base_loss


def brute_force_gradient(model, batch, amir, loss_mode, lambda_reg):
    model.zero_grad()
    base_loss = whole_batch_base_loss(model, batch, loss_mode)
    j_pref = brute_force_pref_objective(model, batch.ref_log_probs, batch, amir)
    (base_loss + lambda_reg * (-j_pref)).backward()
    return grads(model), j_pref.detach(), float(base_loss)


@pytest.mark.parametrize("loss_mode", ["amir_grpo", "amir_gspo"])
@pytest.mark.parametrize("reference", ["ref", "ref_free"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gradient_equals_brute_force(models, loss_mode, reference, layout):
    model, _ = models
    batch = make_batch(models)
    amir = AmirConfig(reference=reference, delta_r=0.5, beta_dpo=0.5)
    fields = amir_step_fields(batch, amir)
    assert fields.num_pairs > 0
    expected, j_pref, base_value = brute_force_gradient(model, batch, amir, loss_mode, LAMBDA)

    base_mode, agg = BASE[loss_mode]
    loss_fn = partial(amir_ppo_loss, config=actor_config(loss_mode, agg), beta_dpo=amir.beta_dpo)
    model.zero_grad()
    outputs = run_actor_update(model, batch, loss_fn, layout, extra_info_for(fields, len(batch), LAMBDA), fields)
    actual = grads(model)

    assert fields.stats.pref_loss == pytest.approx(-float(j_pref), rel=1e-10)
    # float64 model, but Qwen2's RMSNorm and rotary embedding compute in float32, so two mathematically
    # equal gradients differ by float32 rounding (~1e-8 here); the preference part is ~1e-1.
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-7)
    # the shares of all micro-batches add up to the whole loss, preference term included
    total = sum(float(loss) for loss, _ in outputs) / layout.dp
    assert total == pytest.approx(base_value + LAMBDA * -float(j_pref), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("loss_mode", ["amir_grpo", "amir_gspo"])
def test_lambda_zero_equals_base_mode_exactly(models, loss_mode):
    """lambda = 0: loss, gradient and every base metric are bit-identical to `vanilla` / `gspo`."""
    model, _ = models
    batch = make_batch(models, seed=3)
    amir = AmirConfig()
    fields = amir_step_fields(batch, amir)
    assert fields.num_pairs > 0
    base_mode, agg = BASE[loss_mode]
    layout = Layout(dp=2, micro_batch_size=3, seed=9)

    model.zero_grad()
    base_out = run_actor_update(model, batch, partial(ppo_loss, config=actor_config(base_mode, agg)), layout, {})
    base_grads = grads(model)
    model.zero_grad()
    amir_fn = partial(amir_ppo_loss, config=actor_config(loss_mode, agg), beta_dpo=amir.beta_dpo)
    amir_out = run_actor_update(model, batch, amir_fn, layout, extra_info_for(fields, len(batch), 0.0), fields)
    amir_grads = grads(model)

    for a, b in zip(amir_grads, base_grads, strict=True):
        assert torch.equal(a, b)
    for (la, ma), (lb, mb) in zip(amir_out, base_out, strict=True):
        assert torch.equal(la, lb)
        assert ma.keys() == mb.keys()
        assert plain_metrics(ma) == plain_metrics(mb)


def test_no_pairs_contributes_exactly_nothing(models):
    """All-equal rewards: zero pairs, loss and gradient exactly the base mode's, never NaN."""
    model, ref = models
    batch = make_step_batch(model, ref, [4, 4], seed=5, reward_values=(1.0,))
    amir = AmirConfig()
    fields = amir_step_fields(batch, amir)
    assert fields.num_pairs == 0 and fields.stats.pref_loss == 0.0
    layout = Layout(dp=1, micro_batch_size=4)
    model.zero_grad()
    run_actor_update(model, batch, partial(ppo_loss, config=actor_config("vanilla")), layout, {})
    base = grads(model)
    model.zero_grad()
    fn = partial(amir_ppo_loss, config=actor_config("amir_grpo"), beta_dpo=amir.beta_dpo)
    out = run_actor_update(model, batch, fn, layout, extra_info_for(fields, len(batch), 0.05), fields)
    assert all(torch.isfinite(loss) for loss, _ in out)
    for a, b in zip(grads(model), base, strict=True):
        assert torch.equal(a, b)
