"""The adaptive lambda controller, and resuming a run from a checkpoint (issue 2, item 7)."""

import copy
from functools import partial

import pytest
import torch

from amir_verl.actor_loss import amir_ppo_loss
from amir_verl.config import AmirConfig
from amir_verl.lambda_control import AdaptiveLambdaController
from amir_verl.trainer import STATE_FILE, read_amir_state, write_amir_state
from tests.verl_batch import (
    Layout,
    actor_config,
    amir_step_fields,
    extra_info_for,
    make_step_batch,
    plain_metrics,
    run_actor_update,
    tiny_model,
)


def controller(**overrides):
    return AmirConfig.from_mapping(overrides).make_lambda_controller()


def test_lambda_rises_when_the_preference_share_is_small():
    c = controller()
    assert c.update(pg_loss=1.0, pref_loss=0.7, num_pairs=4) == pytest.approx(0.0125)  # rho ~ 0.007 < 0.3


def test_lambda_falls_when_the_preference_share_is_large():
    c = controller(lambda_init=0.05, lambda_max=0.05)
    assert c.update(pg_loss=0.001, pref_loss=0.7, num_pairs=4) == pytest.approx(0.04)


def test_lambda_stays_inside_its_range():
    c = controller()
    for _ in range(50):
        c.update(1.0, 0.7, 4)
    assert c.value == 0.05
    for _ in range(200):
        c.update(0.0, 100.0, 4)
    assert c.value == 0.005


def test_fixed_lambda_and_steps_without_pairs_leave_the_state_alone():
    fixed = controller(lambda_adaptive=False, lambda_init=0.3)
    assert fixed.update(1.0, 0.7, 4) == 0.3
    c = controller()
    before = c.state_dict()
    assert c.update(1.0, 0.0, num_pairs=0) == 0.01
    assert c.state_dict() == before


def test_a_near_zero_or_negative_pg_loss_cannot_crash_lambda_to_its_floor():
    """The official ratio lambda*L_pref/L_grpo explodes at L_grpo ~ 0; the smoothed share does not."""
    c = controller(lambda_init=0.02)
    for _ in range(20):
        c.update(pg_loss=0.05, pref_loss=0.69, num_pairs=8)  # steady state
    steady = c.value
    c.update(pg_loss=1e-12, pref_loss=0.69, num_pairs=8)
    c.update(pg_loss=-0.01, pref_loss=0.69, num_pairs=8)
    assert c.value >= steady * 0.8**2 and c.value > 0.005


def test_non_finite_losses_raise():
    with pytest.raises(ValueError, match="non-finite"):
        controller().update(float("nan"), 0.5, 3)


def test_state_dict_round_trip(tmp_path):
    c = controller()
    for pg in (0.3, 0.1, 0.02):
        c.update(pg, 0.69, 5)
    write_amir_state(str(tmp_path), 3, c)
    fresh = controller()
    assert read_amir_state(str(tmp_path), fresh)
    assert fresh.state_dict() == c.state_dict()
    assert not read_amir_state(str(tmp_path / "elsewhere"), controller())
    with pytest.raises(KeyError, match="missing"):
        fresh.load_state_dict({"value": 0.1})
    assert (tmp_path / STATE_FILE).exists()


# ---------------------------------------------------------------- resume equals an uninterrupted run


AMIR = AmirConfig(beta_dpo=0.5, lambda_init=0.02, lambda_min=0.005, lambda_max=0.5)


def train_steps(model, optimizer, lam: AdaptiveLambdaController, steps, ref_model):
    """AMIR-GRPO updates through verl's loss path; returns (lambda used, loss) per step."""
    history = []
    loss_fn = partial(amir_ppo_loss, config=actor_config("amir_grpo", micro=8), beta_dpo=AMIR.beta_dpo)
    for step in steps:
        batch = make_step_batch(model, ref_model, [4, 4], seed=100 + step)
        fields = amir_step_fields(batch, AMIR)
        optimizer.zero_grad()
        lambda_used = lam.value
        out = run_actor_update(model, batch, loss_fn, Layout(dp=1, micro_batch_size=8),
                               extra_info_for(fields, len(batch), lambda_used), fields)
        optimizer.step()
        (loss, metrics), = out
        _, pg_values = plain_metrics(metrics)["actor/pg_loss"]
        lam.update(sum(pg_values), fields.stats.pref_loss, fields.num_pairs)
        history.append((lambda_used, float(loss)))
    return history


def test_resumed_run_continues_with_the_same_lambda_and_loss(tmp_path):
    ref_model = tiny_model(seed=7)
    model = tiny_model(seed=3)
    start = copy.deepcopy(model.state_dict())

    def fresh():
        m = tiny_model(seed=3)
        m.load_state_dict(start)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2), AMIR.make_lambda_controller()

    m, opt, lam = fresh()
    uninterrupted = train_steps(m, opt, lam, range(5), ref_model)

    m, opt, lam = fresh()
    first = train_steps(m, opt, lam, range(3), ref_model)
    folder = tmp_path / "global_step_3"
    folder.mkdir()
    torch.save({"model": m.state_dict(), "optim": opt.state_dict()}, folder / "actor.pt")
    write_amir_state(str(folder), 3, lam)

    m, opt, lam = fresh()  # a new process: everything restored from the checkpoint
    saved = torch.load(folder / "actor.pt")
    m.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optim"])
    assert read_amir_state(str(folder), lam)
    second = train_steps(m, opt, lam, range(3, 5), ref_model)

    assert first + second == uninterrupted
    assert len({lam_used for lam_used, _ in uninterrupted}) > 1  # lambda did adapt along the way
