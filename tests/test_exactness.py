"""Exactness of the shipped actor loss against brute-force autograd (issues 2 and 9).

For one on-policy update (one mini-batch, one epoch) the gradient accumulated over any split of the
step batch across data-parallel ranks and micro-batches must equal the gradient of
``pg_loss + lambda * (-J_pref)`` over the whole batch, pg_loss being verl's own base loss and J_pref
computed by its definition, for any base loss of verl's registry under ``loss_mode=amir``.
"""

from dataclasses import replace
from functools import partial

import pytest
import torch

from amir_verl.actor_loss import amir_ppo_loss
from amir_verl.config import AmirConfig
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
from verl.workers.utils.losses import ppo_loss

from tests.support import brute_force_gradient, whole_batch_base_loss
from amir_verl.testing import (
    Layout,
    actor_config,
    amir_step_fields,
    brute_force_pref_objective,
    extra_info_for,
    grads,
    make_step_batch,
    plain_metrics,
    run_actor_update,
    tiny_model,
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

# base loss modes whose verl loss is itself independent of the split (normalised by the global batch
# through agg_loss), with the options some of them need
SPLIT_INVARIANT_BASES = {
    "vanilla": {}, "gspo": {}, "cispo": {}, "gpg": {}, "dppo_tv": {}, "dppo_kl": {}, "sapo": {},
    "dro": {"dro_beta": 0.5},
}
# verl's own loss depends on the split (geo_mean: a plain mean over the micro-batch; clip_cov / kl_cov:
# a top-k of the micro-batch's tokens), so AMIR's exact claim there is: base gradient at that split
# plus the whole-batch preference gradient
SPLIT_DEPENDENT_BASES = {"geo_mean": {}, "clip_cov": {}, "kl_cov": {}}
AGGREGATIONS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
# seq-mean-token-sum-norm divides by the padded width unless loss_scale_factor is set (verl's advice);
# fixed here so that the whole-batch loss does not depend on how wide a micro-batch happens to be
LOSS_SCALE_FACTOR = {"seq-mean-token-sum-norm": 16}
# each (base, aggregation) case runs at one of these layouts, in turn, to keep the suite fast
CYCLED_LAYOUTS = [
    ("dp2-micro4", Layout(dp=2, micro_batch_size=4, seed=2)),
    ("dp3-dynamic-bsz", Layout(dp=3, max_token_len=30, seed=7)),
    ("dp4-micro3", Layout(dp=4, micro_batch_size=3, seed=8)),
]
ANY_BASE_CASES = [
    pytest.param(base, agg, CYCLED_LAYOUTS[i % len(CYCLED_LAYOUTS)][1],
                 id=f"{base}-{agg}-{CYCLED_LAYOUTS[i % len(CYCLED_LAYOUTS)][0]}")
    for i, (base, agg) in enumerate((b, a) for b in sorted(SPLIT_INVARIANT_BASES) for a in AGGREGATIONS)
]


@pytest.fixture(scope="module")
def models():
    return tiny_model(seed=0), tiny_model(seed=1)


def make_batch(models, seed=0):
    model, ref = models
    # 20 real samples in 5 groups (one of size 1, one with an empty response) + 4 V1 filler samples
    return make_step_batch(model, ref, [6, 1, 5, 4, 4], seed=seed, num_padding=4, empty_response_at=3)


def base_config(base_mode, agg="token-mean", **options):
    return actor_config(base_mode, agg, loss_scale_factor=LOSS_SCALE_FACTOR.get(agg), **options)


def amir_update(model, batch, amir, config, layout, fields, lambda_reg=LAMBDA):
    loss_fn = partial(amir_ppo_loss, config=config, beta_dpo=amir.beta_dpo)
    model.zero_grad()
    outputs = run_actor_update(model, batch, loss_fn, layout, extra_info_for(fields, lambda_reg), fields)
    return grads(model), outputs


def assert_grads_close(actual, expected):
    # float64 model, but Qwen2's RMSNorm and rotary embedding compute in float32, so two mathematically
    # equal gradients differ by float32 rounding (~1e-8 here); the preference part is ~1e-1.
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-7)


def test_a_separate_async_later_local_update_is_the_anchored_surrogate_not_the_exact_gradient(models):
    """verl's separate_async local update j >= 1 restores pi_old = theta_0 to compute old_log_probs, so the
    driver freezes every partner at theta_0 while the actor trains theta_j. The update is then the gradient
    of the anchored surrogate (each pair member live against its partner at theta_0) plus verl's base loss at
    ratio theta_j / theta_0, and NOT the exact gradient of lambda * (-J_pref(theta_j)): the README documents
    it as such, and this test states the difference instead of hiding it."""
    import copy

    model0, _ = models
    batch = make_batch(models)  # old log-probs at theta_0
    amir = AmirConfig(delta_r=0.5, beta_dpo=0.5)
    fields = amir_step_fields(batch, amir)
    model1 = copy.deepcopy(model0)  # theta_1: the weights after local update 0
    with torch.no_grad():
        generator = torch.Generator().manual_seed(9)
        for p in model1.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    config = base_config("vanilla")
    actual, _ = amir_update(model1, batch, amir, config, Layout(dp=2, micro_batch_size=4, seed=2), fields)

    model1.zero_grad()
    anchored = brute_force_pref_objective(model1, batch.ref_log_probs, batch, amir,
                                          frozen_partner_log_probs=batch.old_log_probs)
    (whole_batch_base_loss(model1, batch, config) + LAMBDA * (-anchored)).backward()
    assert_grads_close(actual, grads(model1))

    exact, _, _ = brute_force_gradient(model1, batch, amir, config, LAMBDA)
    gap = torch.cat([(a - e).flatten() for a, e in zip(actual, exact)]).norm()
    assert float(gap / torch.cat([e.flatten() for e in exact]).norm()) > 1e-2


@pytest.mark.parametrize("base", [("vanilla", "token-mean"), ("gspo", "seq-mean-token-mean")], ids=["grpo", "gspo"])
@pytest.mark.parametrize("reference", ["ref", "ref_free"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gradient_equals_brute_force(models, base, reference, layout):
    model, _ = models
    batch = make_batch(models)
    amir = AmirConfig(reference=reference, delta_r=0.5, beta_dpo=0.5)
    fields = amir_step_fields(batch, amir)
    assert fields.num_pairs > 0
    config = base_config(*base)
    expected, j_pref, base_value = brute_force_gradient(model, batch, amir, config, LAMBDA)
    actual, outputs = amir_update(model, batch, amir, config, layout, fields)

    assert fields.stats.pref_loss == pytest.approx(-float(j_pref), rel=1e-10)
    assert_grads_close(actual, expected)
    # the shares of all micro-batches add up to the whole loss, preference term included
    total = sum(float(loss) for loss, _ in outputs) / layout.dp
    assert total == pytest.approx(base_value + LAMBDA * -float(j_pref), rel=1e-9, abs=1e-12)


TOOL_OUTPUT_LAYOUTS = [LAYOUTS[1], LAYOUTS[2], LAYOUTS[5]]  # micro-batches, two ranks, dynamic batch size


@pytest.mark.parametrize("base", [("vanilla", "token-mean"), ("gspo", "seq-mean-token-mean")], ids=["grpo", "gspo"])
@pytest.mark.parametrize("layout", TOOL_OUTPUT_LAYOUTS)
def test_tool_output_tokens_inside_responses_are_left_out_exactly(models, base, layout):
    """Multi-turn agent loops: verl's agent loop sets response_mask to 0 on a tool's output between the model's
    turns. l(o) and |o| then run over the model's own tokens only, in the driver's fields and in the actor's loss:
    the update equals the brute force whose l(o) is the masked mean, and differs from one that counts every token."""
    model, _ = models
    batch = make_step_batch(*models, [6, 1, 5, 4, 4], seed=21, num_padding=4, tool_outputs=True, max_response=12)
    holes = sum(int((batch.response_mask(i) == 0).sum()) for i in range(len(batch)) if not batch.is_padding[i])
    assert holes > 10
    amir = AmirConfig(delta_r=0.5, beta_dpo=0.5)
    fields = amir_step_fields(batch, amir)
    assert fields.num_pairs > 0
    config = base_config(*base)
    expected, j_pref, _ = brute_force_gradient(model, batch, amir, config, LAMBDA)
    actual, _ = amir_update(model, batch, amir, config, layout, fields)
    assert fields.stats.pref_loss == pytest.approx(-float(j_pref), rel=1e-10)
    assert_grads_close(actual, expected)

    every_token = brute_force_pref_objective(model, batch.ref_log_probs, replace(batch, masks=None), amir)
    assert abs(float(every_token) - float(j_pref)) > 1e-3  # the masks matter: a test that ignored them would fail


@pytest.mark.parametrize("base_mode,agg,layout", ANY_BASE_CASES)
def test_any_base_loss_gradient_equals_brute_force(models, base_mode, agg, layout):
    """loss_mode=amir on each split-invariant verl loss and aggregation: exact whole-batch gradient."""
    model, _ = models
    batch = make_batch(models, seed=11)
    amir = AmirConfig(delta_r=0.5, beta_dpo=0.5)
    fields = amir_step_fields(batch, amir)
    config = base_config(base_mode, agg, **SPLIT_INVARIANT_BASES[base_mode])
    expected, _, _ = brute_force_gradient(model, batch, amir, config, LAMBDA)
    actual, _ = amir_update(model, batch, amir, config, layout, fields)
    assert_grads_close(actual, expected)


@pytest.mark.parametrize("base_mode", sorted(SPLIT_DEPENDENT_BASES))
def test_split_dependent_base_loss_gets_exactly_the_whole_batch_term(models, base_mode):
    model, _ = models
    batch = make_batch(models, seed=12)
    amir = AmirConfig(delta_r=0.5, beta_dpo=0.5)
    fields = amir_step_fields(batch, amir)
    config = base_config(base_mode, **SPLIT_DEPENDENT_BASES[base_mode])
    layout = Layout(dp=2, micro_batch_size=4, seed=2)
    model.zero_grad()
    torch.manual_seed(5)  # clip_cov picks among its candidate tokens at random: the same picks in both runs
    run_actor_update(model, batch, partial(ppo_loss, config=config), layout, {})
    base = grads(model)
    model.zero_grad()
    (-LAMBDA * brute_force_pref_objective(model, batch.ref_log_probs, batch, amir)).backward()
    pref = grads(model)
    torch.manual_seed(5)
    actual, _ = amir_update(model, batch, amir, config, layout, fields)
    assert_grads_close(actual, [b + p for b, p in zip(base, pref, strict=True)])


def test_every_registered_verl_loss_is_covered():
    """A loss mode verl adds later must be placed in one of the lists above (or refused as a base)."""
    from amir_verl.run_config import AMIR_LOSS_MODES, UNSUPPORTED_BASE_MODES

    covered = {*SPLIT_INVARIANT_BASES, *SPLIT_DEPENDENT_BASES, *AMIR_LOSS_MODES, *UNSUPPORTED_BASE_MODES}
    assert set(POLICY_LOSS_REGISTRY) == covered


def test_the_driver_chunks_exactly_the_modes_proven_split_invariant_here():
    """The driver evaluates the modes of SPLIT_INVARIANT_BASE_MODES in chunks of sequences: each must be one
    whose split gradient the tests above prove equal to the whole batch's."""
    from amir_verl.run_config import SPLIT_INVARIANT_BASE_MODES

    assert set(SPLIT_INVARIANT_BASE_MODES) == set(SPLIT_INVARIANT_BASES)


@pytest.mark.parametrize("base", [("vanilla", "token-mean"), ("gspo", "seq-mean-token-mean")], ids=["grpo", "gspo"])
def test_lambda_zero_equals_base_mode_exactly(models, base):
    """lambda = 0: loss, gradient and every base metric are bit-identical to the base mode's."""
    model, _ = models
    batch = make_batch(models, seed=3)
    amir = AmirConfig()
    fields = amir_step_fields(batch, amir)
    assert fields.num_pairs > 0
    config = base_config(*base)
    layout = Layout(dp=2, micro_batch_size=3, seed=9)

    model.zero_grad()
    base_out = run_actor_update(model, batch, partial(ppo_loss, config=config), layout, {})
    base_grads = grads(model)
    amir_grads, amir_out = amir_update(model, batch, amir, config, layout, fields, lambda_reg=0.0)

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
    config = base_config("vanilla")
    model.zero_grad()
    run_actor_update(model, batch, partial(ppo_loss, config=config), layout, {})
    base = grads(model)
    actual, out = amir_update(model, batch, amir, config, layout, fields, lambda_reg=0.05)
    assert all(torch.isfinite(loss) for loss, _ in out)
    for a, b in zip(actual, base, strict=True):
        assert torch.equal(a, b)


def test_the_amir_registry_entries_are_not_the_loss():
    """Reached through verl's ppo_loss with an AMIR mode (no base config), the run fails loudly."""
    with pytest.raises(RuntimeError, match="trainer_mode=amir"):
        POLICY_LOSS_REGISTRY["amir"](torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2))
