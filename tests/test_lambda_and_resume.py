"""The lambda rules, the driver's gradient signal, and resuming a run from a checkpoint (issues 2 and 9)."""

import copy
from functools import partial

import numpy as np
import pytest
import torch

from amir_verl.actor_loss import amir_ppo_loss
from amir_verl.config import AmirConfig
from amir_verl.lambda_control import StepSignal
from amir_verl.preference import dpo_logits, length_normalised_log_probs, mine_preference_pairs, preference_objective
from amir_verl import step_batch
from amir_verl.run_config import SPLIT_INVARIANT_BASE_MODES
from amir_verl import metrics
from amir_verl.step_batch import (
    EXTRA_LAMBDA,
    EXTRA_NUM_MINI_BATCHES,
    EXTRA_NUM_PAIRS,
    compute_step_fields,
    driver_step,
    gradient_signal,
    policy_gradient_at_old,
)
from amir_verl.trainer import STATE_FILE, read_amir_state, whole_batch_policy_loss, write_amir_state
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
from amir_verl.testing import (
    Layout,
    actor_config,
    amir_step_fields,
    extra_info_for,
    make_step_batch,
    padded,
    run_actor_update,
    tiny_model,
)


def controller(**overrides):
    return AmirConfig.from_mapping(overrides).make_lambda_controller()


def signal(pg_loss=0.0, pref_loss=0.7, pg_grad_norm=1.0, pref_grad_norm_per_lambda=0.25, num_pairs=4):
    return StepSignal(pg_loss, pref_loss, pg_grad_norm, pref_grad_norm_per_lambda, num_pairs)


# ---------------------------------------------------------------- loss_ratio: the official rule


def test_loss_ratio_reproduces_the_official_trajectory_step_by_step():
    """Hand-computed from the official rule (r = lambda * L_pref / max(1e-9, L_pg); r < 0.3: x1.25 up to
    0.05; r > 0.7: x0.8 down to 0.005; the new lambda is used at once), L_pref = 0.7 throughout."""
    pg_losses = [1e-12, -0.02, 0.0, 0.02, 0.02, 0.02, 0.02, 1e-12, 1e-12, 1e-12, 1e-12, 1e-12] + [1.0] * 10
    expected = [
        0.008, 0.0064, 0.00512,  # L_pg <= 1e-9: r is huge, lambda x0.8
        0.0064,  # r = 0.00512 * 0.7 / 0.02 = 0.1792 < 0.3
        0.008,  # r = 0.0064 * 35 = 0.224
        0.01,  # r = 0.28
        0.01,  # r = 0.35: inside the band
        0.008, 0.0064, 0.00512, 0.005, 0.005,  # down again, clamped at 0.005 (0.8 * 0.00512 = 0.004096)
        0.00625, 0.0078125, 0.009765625, 0.01220703125, 0.0152587890625, 0.019073486328125,
        0.02384185791015625, 0.0298023223876953, 0.0372529029846191, 0.0465661287307739,  # r ~ 0.005 << 0.3
    ]
    c = controller(lambda_rule="loss_ratio")
    used = [c.step(signal(pg_loss=pg)) for pg in pg_losses]
    assert used == pytest.approx(expected, rel=1e-12)
    assert [c.step(signal(pg_loss=1.0)) for _ in range(2)] == [0.05, 0.05]  # clamped at 0.05


def test_steps_without_pairs_and_the_fixed_rule_leave_lambda_alone():
    c = controller(lambda_rule="loss_ratio")
    before = c.state_dict()
    assert c.step(signal(pg_loss=1e-12, pref_loss=0.0, pref_grad_norm_per_lambda=0.0, num_pairs=0)) == 0.01
    assert c.state_dict() == before
    fixed = controller(lambda_rule="fixed", lambda_init=0.3)
    assert [fixed.step(signal(pg_loss=pg)) for pg in (1e-12, 1.0, -3.0)] == [0.3, 0.3, 0.3]


def test_non_finite_signals_raise():
    with pytest.raises(ValueError, match="non-finite pg_loss"):
        signal(pg_loss=float("nan"))
    with pytest.raises(ValueError, match="non-finite pg_grad_norm"):
        signal(pg_grad_norm=float("inf"))


# ---------------------------------------------------------------- grad_share on an on-policy batch


def on_policy_step(seed=0, groups=16, group_size=8, length=12, beta_dpo=0.2):
    """A step batch whose GRPO token-mean loss is 0 on-policy while its advantages are not: equal
    response lengths, group-normalised advantages (sum zero in every group)."""
    gen = torch.Generator().manual_seed(seed)
    n = groups * group_size
    rewards = (torch.rand(n, generator=gen) < 0.4).double()
    uids = [f"g{i // group_size}" for i in range(n)]
    mask = torch.ones(n, length)
    old = -torch.rand(n, length, generator=gen, dtype=torch.float64) * 3
    ref = old + 0.1 * torch.randn(n, length, generator=gen, dtype=torch.float64)
    scores = torch.zeros(n, length)
    scores[:, -1] = rewards.float()
    advantages, _ = compute_grpo_outcome_advantage(scores, mask, np.array(uids, dtype=object))
    amir = AmirConfig(beta_dpo=beta_dpo)
    fields = compute_step_fields(amir, rewards, uids, mask, old, ref)
    loss_fn = whole_batch_policy_loss(actor_config("vanilla", kl_coef=None), n, int(mask.sum()))
    return gradient_signal(loss_fn, fields, old, advantages.double(), mask, beta_dpo), (rewards, uids, mask, old, ref,
                                                                                        advantages, amir)


def test_gradient_signal_equals_brute_force_autograd():
    """pg: verl's vanilla token-mean loss on-policy has gradient -A / (number of tokens) per token;
    pref: autograd of -J_pref by its definition with respect to every token log-prob."""
    s, (rewards, uids, mask, old, ref, advantages, amir) = on_policy_step(seed=1)
    assert abs(s.pg_loss) < 1e-7 and s.num_pairs > 0  # ~0: float32 advantages
    assert s.pg_grad_norm == pytest.approx(float((advantages.double() * mask / mask.sum()).norm()), rel=1e-6)

    logp = old.clone().requires_grad_(True)
    group_ids = torch.tensor([int(u[1:]) for u in uids])
    pairs = mine_preference_pairs(rewards, group_ids, amir.delta_r)
    j = preference_objective(dpo_logits(length_normalised_log_probs(logp, mask), length_normalised_log_probs(ref, mask),
                                        pairs, amir.beta_dpo))
    (grad,) = torch.autograd.grad(-j, logp)
    assert len(pairs) == s.num_pairs
    assert s.pref_loss == pytest.approx(-float(j), rel=1e-10)
    assert s.pref_grad_norm_per_lambda == pytest.approx(float(grad.norm()), rel=1e-10)


def test_on_policy_grad_share_moves_lambda_into_the_band_while_loss_ratio_hits_its_floor():
    s, _ = on_policy_step(seed=2)
    assert abs(s.pg_loss) < 1e-7 and s.pg_grad_norm > 0  # the loss value says nothing, the gradient does
    share = controller()  # grad_share defaults
    rule = share.rule
    assert s.grad_share(rule.lambda_min) < rule.target_low < rule.target_high < s.grad_share(rule.lambda_max)
    lambdas = [share.step(s) for _ in range(40)]
    assert all(rule.lambda_min <= lam <= rule.lambda_max for lam in lambdas)
    assert rule.target_low <= s.grad_share(lambdas[-1]) <= rule.target_high
    assert lambdas[-1] == lambdas[-2]  # settled inside the band

    official = controller(lambda_rule="loss_ratio")
    assert [official.step(s) for _ in range(4)] == pytest.approx([0.008, 0.0064, 0.00512, 0.005])



def test_the_driver_step_is_a_function_of_the_batch_without_a_trainer():
    """driver_step: the fields, the signal, the controller's lambda for this update, what the actor reads and
    the metrics, from tensors alone (the trainer only moves them to and from TransferQueue)."""
    s, (rewards, uids, mask, old, ref, advantages, amir) = on_policy_step(seed=2)
    loss_fn = whole_batch_policy_loss(actor_config("vanilla", kl_coef=None), len(uids), int(mask.sum()))
    share, twin = controller(), controller()
    step = driver_step(amir, share, loss_fn, sequence_rewards=rewards, uids=uids, response_mask=mask,
                       old_log_probs=old, ref_log_probs=ref, advantages=advantages, mini_batch_sequences=32)
    # the base loss sees float32 log-probs and advantages, as verl's actor computes it
    expected = gradient_signal(loss_fn, step.fields, old.float(), advantages.float(), mask, amir.beta_dpo)
    assert step.signal == expected and step.lambda_reg == twin.step(expected) and share.num_updates == 1
    assert step.fields.num_pairs == s.num_pairs and step.signal.pref_loss == s.pref_loss
    assert step.extra_info == {EXTRA_LAMBDA: step.lambda_reg, EXTRA_NUM_PAIRS: s.num_pairs,
                               EXTRA_NUM_MINI_BATCHES: len(uids) // 32}
    m = step.metrics
    assert m[metrics.NUM_PAIRS] == s.num_pairs and m[metrics.PREF_LOSS] == s.pref_loss
    assert m[metrics.LAMBDA] == step.lambda_reg
    assert m[metrics.PREF_GRAD_NORM] == pytest.approx(step.lambda_reg * s.pref_grad_norm_per_lambda)
    assert m[metrics.GRAD_SHARE] == pytest.approx(m[metrics.PREF_GRAD_NORM] / (m[metrics.PREF_GRAD_NORM]
                                                                             + m[metrics.PG_GRAD_NORM]))


def test_grad_share_lowers_lambda_when_the_term_dominates():
    c = controller(lambda_init=5.0)
    strong = signal(pg_grad_norm=0.01, pref_grad_norm_per_lambda=1.0)  # share ~1 at any lambda in range
    lambdas = [c.step(strong) for _ in range(60)]
    assert lambdas[0] == pytest.approx(4.0) and lambdas[-1] == c.rule.lambda_min


# ---------------------------------------------------------------- state


@pytest.mark.parametrize("rule", ["grad_share", "loss_ratio", "fixed"])
def test_state_dict_round_trip(tmp_path, rule):
    c = controller(lambda_rule=rule)
    for pg in (0.3, 1e-12, 0.02):
        c.step(signal(pg_loss=pg, pg_grad_norm=pg + 0.01))
    write_amir_state(str(tmp_path), 3, c)
    fresh = controller(lambda_rule=rule)
    assert read_amir_state(str(tmp_path), fresh)
    assert fresh.state_dict() == c.state_dict()
    assert not read_amir_state(str(tmp_path / "elsewhere"), controller())
    with pytest.raises(KeyError, match="missing"):
        fresh.load_state_dict({"value": 0.1})
    assert (tmp_path / STATE_FILE).exists()


def test_a_checkpoint_of_another_rule_is_refused(tmp_path):
    write_amir_state(str(tmp_path), 1, controller(lambda_rule="loss_ratio"))
    with pytest.raises(ValueError, match="differs"):
        read_amir_state(str(tmp_path), controller(lambda_rule="grad_share"))


# ---------------------------------------------------------------- resume equals an uninterrupted run


def train_steps(model, optimizer, lam, steps, ref_model, amir):
    """AMIR-GRPO updates through verl's loss path, lambda picked per step from the driver's signal;
    returns (lambda used, loss) per step."""
    history = []
    config = actor_config("vanilla", micro=8)
    loss_fn = partial(amir_ppo_loss, config=config, beta_dpo=amir.beta_dpo)
    for step in steps:
        batch = make_step_batch(model, ref_model, [4, 4], seed=100 + step)
        fields = amir_step_fields(batch, amir)
        masks = padded([batch.response_mask(i) for i in range(len(batch))])
        s = gradient_signal(whole_batch_policy_loss(config, len(batch), int(masks.sum())), fields,
                            padded(batch.old_log_probs, masks.shape[1]), padded(batch.advantages, masks.shape[1]),
                            masks, amir.beta_dpo)
        lambda_used = lam.step(s)
        optimizer.zero_grad()
        out = run_actor_update(model, batch, loss_fn, Layout(dp=1, micro_batch_size=8),
                               extra_info_for(fields, lambda_used), fields)
        optimizer.step()
        (loss, _), = out
        history.append((lambda_used, float(loss)))
    return history


@pytest.mark.parametrize("rule", ["grad_share", "loss_ratio"])
def test_resumed_run_continues_with_the_same_lambda_and_loss(tmp_path, rule):
    amir = AmirConfig(beta_dpo=0.5, lambda_rule=rule, lambda_init=0.05)  # a clamp of either rule: it must move
    ref_model = tiny_model(seed=7)
    model = tiny_model(seed=3)
    start = copy.deepcopy(model.state_dict())

    def fresh():
        m = tiny_model(seed=3)
        m.load_state_dict(start)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2), amir.make_lambda_controller()

    m, opt, lam = fresh()
    uninterrupted = train_steps(m, opt, lam, range(5), ref_model, amir)

    m, opt, lam = fresh()
    first = train_steps(m, opt, lam, range(3), ref_model, amir)
    folder = tmp_path / "global_step_3"
    folder.mkdir()
    torch.save({"model": m.state_dict(), "optim": opt.state_dict()}, folder / "actor.pt")
    write_amir_state(str(folder), 3, lam)

    m, opt, lam = fresh()  # a new process: everything restored from the checkpoint
    saved = torch.load(folder / "actor.pt")
    m.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optim"])
    assert read_amir_state(str(folder), lam)
    second = train_steps(m, opt, lam, range(3, 5), ref_model, amir)

    assert first + second == uninterrupted
    assert len({lam_used for lam_used, _ in uninterrupted}) > 1  # lambda did adapt along the way


# ---------------------------------------------------------------- the driver's base-loss gradient in chunks

POLICY_OPTIONS = {"dro": {"dro_beta": 0.5}}


def ragged_step(n=11, width=9, seed=0):
    """(old log-probs, advantages, mask), (n, width), responses of 1..width tokens, per-sequence advantages."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (n,), generator=gen)
    mask = (torch.arange(width)[None] < lengths[:, None]).double()
    old = -torch.rand(n, width, generator=gen, dtype=torch.float64) * 3 * mask
    advantages = torch.randn(n, 1, generator=gen, dtype=torch.float64) * mask
    return old, advantages, mask


@pytest.mark.parametrize("importance_weighted", [False, True])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("mode", sorted(SPLIT_INVARIANT_BASE_MODES))
def test_chunked_base_loss_gradient_equals_the_whole_batch_one(monkeypatch, mode, agg, importance_weighted):
    """Chunks of 3 sequences (the last one of 2) give verl's whole-batch loss value and gradient norm, with
    verl's importance weights (rollout_is) sliced with their sequences."""
    old, advantages, mask = ragged_step()
    weights = (0.5 + torch.rand(old.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
               if importance_weighted else None)
    loss_fn = whole_batch_policy_loss(actor_config(mode, agg, **POLICY_OPTIONS.get(mode, {})), len(old),
                                      int(mask.sum()))
    whole = policy_gradient_at_old(loss_fn, old, advantages, mask, chunked=False, rollout_is_weights=weights)
    monkeypatch.setattr(step_batch, "SIGNAL_CHUNK_TOKENS", 3 * old.shape[1])
    chunked = policy_gradient_at_old(loss_fn, old, advantages, mask, chunked=True, rollout_is_weights=weights)
    assert whole[1] > 0
    assert chunked == pytest.approx(whole, rel=1e-10, abs=1e-15)


def test_chunking_a_split_dependent_mode_would_change_its_gradient(monkeypatch):
    """Why the driver chunks only the listed modes: geo_mean (a mean over its whole input) differs."""
    old, advantages, mask = ragged_step()
    loss_fn = whole_batch_policy_loss(actor_config("geo_mean"), len(old), int(mask.sum()))
    _, whole = policy_gradient_at_old(loss_fn, old, advantages, mask)
    monkeypatch.setattr(step_batch, "SIGNAL_CHUNK_TOKENS", 3 * old.shape[1])
    _, chunked = policy_gradient_at_old(loss_fn, old, advantages, mask, chunked=True)
    assert chunked != pytest.approx(whole, rel=1e-6)
