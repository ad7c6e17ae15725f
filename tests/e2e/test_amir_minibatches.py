"""End to end: AMIR-GRPO with 2 mini-batches per step through verl's real ``main_ppo`` (CPU backend).

Each step makes two optimizer steps. The actor loss reports, per optimizer step, the value of the
preference term it added (``actor/amir_pref_term``: verl averages it over the steps;
``actor/amir_pref_term_min``: the smallest step's). Decided from the weight lambda * M * dp / P before
running: every optimizer step receives a positive share, and the shares average to about
lambda * (-J_pref) (each step's term is its sequences' part of the whole-batch term, times M = 2; the
second step's sequences have moved by one optimizer step). Without the factor M the average would be
half that, and a step that missed its share would show a minimum of 0.
"""

from __future__ import annotations

import pytest

from amir_verl.cpu.launch import parse_step_metrics, run_main_ppo
from amir_verl.cpu.quickstart import amir_overrides, cpu_overrides
from amir_verl.cpu.toy_task import make_assets

pytestmark = pytest.mark.e2e

LAMBDA = 0.5
STEPS = 2


def test_every_optimizer_step_receives_its_share_of_the_term(tmp_path):
    assets = make_assets(tmp_path / "toy", n_train=64, n_test=8)
    workdir = tmp_path / "run"
    workdir.mkdir()
    overrides = cpu_overrides(assets, workdir, STEPS, test_freq=-1, prompts_per_step=8) + amir_overrides(
        "amir_grpo", beta_dpo=0.5, lambda_rule="fixed", lambda_init=LAMBDA
    ) + ["actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.val_before_train=False"]
    output = run_main_ppo(overrides, log_path=workdir / "main_ppo.log", timeout=900)
    metrics = parse_step_metrics(output)

    assert "AMIR: 2 mini-batch(es) x 1 epoch(s) per step" in (workdir / "main_ppo.log").read_text()
    assert sorted(metrics) == list(range(1, STEPS + 1))
    with_pairs = [s for s in metrics if metrics[s]["amir/num_pairs"] > 0]
    assert with_pairs, "the toy task produced no pair: the check below would be empty"
    for step in with_pairs:
        m = metrics[step]
        assert m["amir/lambda"] == LAMBDA
        assert m["actor/amir_pref_term_min"] > 0, step
        assert m["actor/amir_pref_term"] == pytest.approx(LAMBDA * m["amir/pref_loss"], rel=0.15), step
        for key in ("amir/grad_share", "amir/pg_grad_norm", "amir/pref_grad_norm"):
            assert key in m, key
