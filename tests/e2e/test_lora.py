"""The paper's setup end to end: LoRA (the recipe's rank, alpha and verl's default target modules), the
reference = the base model with the adapters off, through verl 0.9.1's real ``main_ppo`` on the CPU backend.

How verl 0.9.1 does it (read from its source, checked here by the results): with ``model.lora_rank > 0``
the V1 trainer sets ``ref_in_actor`` and builds no reference worker; ``_compute_ref_log_prob`` asks the
actor with ``no_lora_adapter=True``, which ``TrainingWorker.infer_batch`` turns into
``engine.disable_adapter()``. After each update the actor sends the rollout either the adapter's tensors
and PEFT config (``model.lora.merge=False``, the default; ``rollout.layered_summon`` gathers them one FSDP
unit at a time) or full merged weights (``merge=True``); the ``hf`` rollout serves both
(:mod:`amir_verl.cpu.hf_rollout`).

verl's rollout dump keeps decoded text only, so each run records AMIR's own inputs with the probe of
:mod:`tests.e2e.probe`: per step, the token ids, verl's old and reference log-probs, the rewards and the
l_ref AMIR stored for the actor. The test then recomputes everything with transformers and peft from the base
model and verl's checkpoints. Run alone with ``python -m pytest tests/e2e/test_lora.py``.
"""

from __future__ import annotations

import json
import math
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from amir_verl.metrics import LAMBDA, NUM_PAIRS, PREF_LOSS, REWARD, ROLLOUT_PROBS_DIFF_MAX
from amir_verl.step_batch import FIELD_REF_SEQ_LOGP
from amir_verl.run_config import amir_overrides
from tests.e2e.support import (BASE_METRICS, BETA, DELTA, GSPO_FLAGS, assert_same, base_model,
                               check_lora_run_with_reference, pairs_by_definition, pref_objective,
                               recipe_lora_overrides, seq_mean, train_command, train_side_by_side)
from tests.support import REPO


# ---- the runs -----------------------------------------------------------------------------------------

def lora_command(assets, workdir: Path, steps: int, amir: list[str]):
    """main_ppo on the toy task with the overrides ``amir`` (AMIR and LoRA; later overrides win, so the
    recipe's ``kl_loss_coef`` replaces the toy run's 0), a checkpoint every step and the probe, which
    records in ``workdir/probe``."""
    from tests.e2e.probe import probed

    return probed(train_command(assets, workdir, steps, amir, save_freq=1), workdir, REPO)


RESUMED_FROM = 2  # the amir_gspo run's checkpoint the resume test restarts from


# run -> (steps, overrides)
LORA_RUNS = {
    # AMIR-GSPO with amir.reference=ref (AMIR-GRPO with LoRA is the reference-free run; the reference path does
    # not depend on the base loss); 4 steps and lambda's bounds apart, so that lambda moves: the resume test below
    # restarts it from its step-2 checkpoint
    "amir_gspo": (RESUMED_FROM + 2, GSPO_FLAGS + amir_overrides("amir_gspo", reference="ref", beta_dpo=BETA, delta_r=DELTA,
                                                                lambda_init=0.02, lambda_min=0.005, lambda_max=0.5)
                  + recipe_lora_overrides()),
    "ref_free": (2, amir_overrides("amir_grpo", reference="ref_free", beta_dpo=BETA, delta_r=DELTA)
                 + recipe_lora_overrides()
                 + ["actor_rollout_ref.model.lora.merge=True", "actor_rollout_ref.rollout.layered_summon=False"]),
}


# stock GSPO with the same LoRA settings, one step: the AMIR-GSPO switch's check is on step 1, where it and the
# amir_gspo run have the same weights (the adapter starts with lora_B = 0) and the same rollouts
STOCK_GSPO = GSPO_FLAGS + ["actor_rollout_ref.actor.policy_loss.loss_mode=gspo"] + recipe_lora_overrides()


@pytest.fixture(scope="module")
def lora_runs(assets, tmp_path_factory):
    """The LoRA runs and stock GSPO side by side, and the amir_gspo run restarted from its step-2 checkpoint as soon
    as that checkpoint is written (:func:`restart_from_checkpoint`, beside the wave's last steps) -> {run:
    (workdir, verl's console metrics by step, the probe's records by step (none for stock GSPO: the probe records
    the AMIR trainer))}, the restarted run under ``"resumed"``."""
    root = tmp_path_factory.mktemp("lora")
    commands = {name: lora_command(assets, root / name, steps, overrides) for name, (steps, overrides) in LORA_RUNS.items()}
    commands["gspo"] = train_command(assets, root / "gspo", 1, STOCK_GSPO, save_freq=1)
    wave_ended = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        resumed = pool.submit(restart_from_checkpoint, assets, root / "amir_gspo", root / "resumed", wave_ended)
        try:
            metrics = train_side_by_side(commands)
        finally:
            wave_ended.set()
        metrics["resumed"] = resumed.result()
    results = {"gspo": (root / "gspo", metrics["gspo"], {})}
    for name, (steps, _) in LORA_RUNS.items():
        assert sorted(metrics[name]) == list(range(1, steps + 1)), name
        records = {step: torch.load(root / name / "probe" / f"step_{step}.pt") for step in range(1, steps + 1)}
        results[name] = (root / name, metrics[name], records)
    results["resumed"] = (root / "resumed", metrics["resumed"], {})
    return results


def restart_from_checkpoint(assets, full_dir: Path, resumed_dir: Path, wave_ended: threading.Event):
    """Once the run in ``full_dir`` has written its ``RESUMED_FROM`` checkpoint (verl writes
    ``latest_checkpointed_iteration.txt`` after the checkpoint), that checkpoint copied into the fresh
    ``resumed_dir`` and the run started there for all of its steps: verl's ``resume_mode=auto`` finds it, as a
    user restarts a stopped run. Returns the restarted run's metrics by step (None if the wave ended first)."""
    latest = full_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    while not (latest.exists() and latest.read_text().strip().isdigit() and int(latest.read_text()) >= RESUMED_FROM):
        if wave_ended.wait(1.0):
            return None
    checkpoint = f"global_step_{RESUMED_FROM}"
    (resumed_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(full_dir / "checkpoints" / checkpoint, resumed_dir / "checkpoints" / checkpoint)
    (resumed_dir / "checkpoints" / "latest_checkpointed_iteration.txt").write_text(str(RESUMED_FROM))
    steps, overrides = LORA_RUNS["amir_gspo"]
    return train_side_by_side({"resumed": lora_command(assets, resumed_dir, steps, overrides)})["resumed"]


@pytest.mark.e2e
def test_amir_gspo_switch_runs_and_its_base_part_is_gspo(lora_runs):
    (_, gspo, _), (_, amir, _) = lora_runs["gspo"], lora_runs["amir_gspo"]
    # step 1: same weights and rollouts, so the policy-gradient part (actor/pg_loss) is GSPO's
    assert_same(gspo, amir, ["actor/pg_loss", REWARD, "actor/pg_clipfrac"], [1])
    assert amir[1][NUM_PAIRS] > 0 and amir[1][LAMBDA] > 0
    assert amir[1]["actor/grad_norm"] != pytest.approx(gspo[1]["actor/grad_norm"], rel=1e-6)  # the term acted


@pytest.mark.e2e
def test_lora_reference_is_the_base_model_and_only_the_adapter_trains(assets, lora_runs):
    """AMIR-GSPO, 4 steps with the recipe's LoRA settings and amir.reference=ref: l_ref == the base model's
    length-normalised log-prob (rel 1e-5), amir/pref_loss == -J_pref recomputed with the adapter at the
    step's start, base weights bit-identical, each checkpoint reproduces the next step's log-probs."""
    workdir, metrics, records = lora_runs["amir_gspo"]
    worst = check_lora_run_with_reference(assets, workdir, metrics, records)
    print(f"amir_gspo: largest relative error of l_ref against the base model: {worst:.2e}")


@pytest.mark.e2e
def test_lora_reference_free_with_merged_adapter_sync(lora_runs):
    """amir.reference=ref_free (the official code's choice) with LoRA, the adapter merged into the weights
    the rollout gets (lora.merge=True): l_ref = 0, amir/pref_loss from verl's old log-probs, the rollout
    generates with the merged weights of the updated actor."""
    _, metrics, records = lora_runs["ref_free"]
    for step, record in records.items():
        assert record[FIELD_REF_SEQ_LOGP] == [0.0] * len(record["keys"])
        l_theta = seq_mean([torch.tensor(v) for v in record["old_log_probs"]], record)
        pairs = pairs_by_definition(record)
        assert metrics[step][NUM_PAIRS] == len(pairs) > 0
        assert metrics[step][PREF_LOSS] == pytest.approx(
            -float(pref_objective(l_theta, torch.zeros_like(l_theta), pairs)), rel=1e-5)
    # The rollout follows the trained actor: verl hands merged weights over in bfloat16, so the rollout's
    # token probabilities differ from the actor's by rounding, far less than the update moved them from
    # the base model (verl's reference log-probs, which it still computes for the KL loss).
    moved = max(float((torch.tensor(old).exp() - torch.tensor(ref).exp()).abs().max())
                for old, ref in zip(records[2]["old_log_probs"], records[2]["ref_log_prob"]))
    assert metrics[2][ROLLOUT_PROBS_DIFF_MAX] < moved / 10, moved


@pytest.mark.e2e
def test_a_lora_run_resumed_from_its_checkpoint_restores_lambda_and_continues_identically(lora_runs):
    """The amir_gspo run restarted from verl's step-2 checkpoint in a fresh workdir (verl's ``resume_mode=auto``
    finds it): the adapter, the optimizer, the dataloader and the lambda controller come back, so steps 3 and 4
    equal the uninterrupted run's: verl's metrics, lambda, the pairs and pref_loss, and the probe's records
    (the same responses, the same old and reference log-probs)."""
    _, full, full_records = lora_runs["amir_gspo"]
    resumed_dir, resumed, _ = lora_runs["resumed"]
    assert resumed is not None, "the amir_gspo run wrote no step-2 checkpoint"
    steps = max(full)
    lambdas = [full[s][LAMBDA] for s in sorted(full)]
    assert len(set(lambdas)) > 1, lambdas  # lambda moved, so restoring it matters
    state = json.loads((resumed_dir / "checkpoints" / f"global_step_{RESUMED_FROM}" / "amir_state.json").read_text())
    # the controller picks each step's lambda before its update, from the saved value and that step's signal
    assert state["lambda_controller"]["value"] == pytest.approx(full[RESUMED_FROM][LAMBDA])

    later = list(range(RESUMED_FROM + 1, steps + 1))
    assert sorted(resumed) == later
    assert_same(full, resumed, BASE_METRICS + [LAMBDA, PREF_LOSS, NUM_PAIRS], later)
    for step in later:  # the same samples (in any order: they enter verl's batch as they finish)
        mine, theirs = torch.load(resumed_dir / "probe" / f"step_{step}.pt"), full_records[step]
        assert sorted(sample for sample, _ in by_sample(mine)) == sorted(sample for sample, _ in by_sample(theirs)), step
        expected = dict(by_sample(theirs))
        for sample, log_probs in by_sample(mine):
            torch.testing.assert_close(log_probs, expected[sample], rtol=1e-5, atol=1e-6)


def by_sample(record: dict) -> list[tuple[tuple, torch.Tensor]]:
    """A probe record's samples, each as ((prompt ids, response ids), its old and reference log-probs stacked
    (2, response tokens)); a list, so that a response sampled twice counts twice."""
    return [((tuple(prompt), tuple(response)), torch.tensor([old, ref])) for prompt, response, old, ref
            in zip(record["prompts"], record["responses"], record["old_log_probs"], record["ref_log_prob"])]


# ---- the hf rollout's adapter sync, without main_ppo ----------------------------------------------------

@pytest.fixture
def hf_server(assets):
    """An ``hf`` rollout server on the toy model, outside Ray (as verl's replica builds it)."""
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import HFModelConfig, RolloutConfig

    from amir_verl.cpu.hf_rollout import HFRolloutServer

    model_config = omega_conf_to_dataclass(
        OmegaConf.create({"_target_": "verl.workers.config.HFModelConfig", "path": assets["model"]}), HFModelConfig)
    srv = HFRolloutServer(RolloutConfig(name="hf", prompt_length=32, response_length=5, seed=3), model_config, 0)
    srv.set_global_steps(0)
    return srv


def test_hf_server_serves_a_lora_adapter_and_refuses_a_partial_or_changed_one(hf_server, assets):
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    from tests.support import generate

    srv = hf_server
    adapted = get_peft_model(base_model(assets), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                           task_type="CAUSAL_LM")).eval()
    torch.manual_seed(0)
    for name, param in adapted.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.5)  # a trained-looking adapter (peft starts lora_B at 0)
    adapter = get_peft_model_state_dict(adapted)
    config = adapted.peft_config["default"].to_dict()
    srv.update_lora(config, adapter)

    prompt = [5, 12, 6, 13, 14]
    out = generate(srv, prompt)
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        adapted_lp = torch.log_softmax(adapted(input_ids=ids).logits[0, len(prompt) - 1 : -1], -1)
        base_lp = torch.log_softmax(base_model(assets)(input_ids=ids).logits[0, len(prompt) - 1 : -1], -1)
    tokens = torch.tensor(out.token_ids)[:, None]
    torch.testing.assert_close(torch.tensor(out.log_probs), adapted_lp.gather(-1, tokens).squeeze(-1),
                               rtol=1e-4, atol=1e-5)
    assert not torch.allclose(adapted_lp, base_lp, atol=1e-3)  # the adapter is what made the difference

    partial = dict(adapter)
    dropped = next(name for name in partial if "lora_A" in name)
    del partial[dropped]
    with pytest.raises(RuntimeError, match="missing"):
        srv.update_lora(config, partial)
    with pytest.raises(RuntimeError, match="config changed"):
        srv.update_lora({**config, "r": 8}, adapter)
    assert math.isfinite(generate(srv, prompt).log_probs[0])  # the server still answers
