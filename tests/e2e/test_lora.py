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

import math
from pathlib import Path

import pytest
import torch

from amir_verl.metrics import NUM_PAIRS, PREF_LOSS, ROLLOUT_PROBS_DIFF_MAX
from amir_verl.step_batch import FIELD_REF_SEQ_LOGP
from tests.e2e.support import BETA, DELTA, pairs_by_definition, pref_objective, response_log_probs, seq_mean
from tests.support import REPO


# ---- the runs -----------------------------------------------------------------------------------------

def recipe_lora_overrides() -> list[str]:
    """The LoRA, reference and KL settings of ``recipes/config/paper_common.yaml``, as overrides."""
    from omegaconf import OmegaConf

    recipe = OmegaConf.load(REPO / "recipes" / "config" / "paper_common.yaml").actor_rollout_ref
    return [
        f"actor_rollout_ref.model.lora_rank={recipe.model.lora_rank}",
        f"actor_rollout_ref.model.lora_alpha={recipe.model.lora_alpha}",
        f"actor_rollout_ref.actor.use_kl_loss={recipe.actor.use_kl_loss}",
        f"actor_rollout_ref.actor.kl_loss_coef={recipe.actor.kl_loss_coef}",
        f"actor_rollout_ref.actor.kl_loss_type={recipe.actor.kl_loss_type}",
        f"actor_rollout_ref.rollout.load_format={recipe.rollout.load_format}",
        f"actor_rollout_ref.rollout.layered_summon={recipe.rollout.layered_summon}",
    ]


def lora_command(assets, workdir: Path, steps: int, amir: list[str]):
    """main_ppo on the toy task with the overrides ``amir`` (AMIR and LoRA; later overrides win, so the
    recipe's ``kl_loss_coef`` replaces the toy run's 0), a checkpoint every step and the probe, which
    records in ``workdir/probe``."""
    from tests.e2e.probe import probed
    from tests.e2e.support import train_command

    return probed(train_command(assets, workdir, steps, amir, save_freq=1), workdir, REPO)


# ---- independent recomputation ------------------------------------------------------------------------

def base_model(assets):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32).eval()


def load_checkpoint(assets, workdir: Path, step: int):
    """verl's actor checkpoint ``global_step_<step>`` (world size 1) -> (PeftModel, its state dict).

    The adapter config is rebuilt from the checkpoint's ``lora_train_meta.json`` and verl's default target
    modules; ``load_state_dict(strict=True)`` then needs every saved tensor to have its place."""
    import json

    from peft import LoraConfig, get_peft_model

    folder = workdir / "checkpoints" / f"global_step_{step}" / "actor"
    meta = json.loads((folder / "lora_train_meta.json").read_text())
    state = {name: tensor.to_local() if hasattr(tensor, "to_local") else tensor
             for name, tensor in torch.load(folder / "model_world_size_1_rank_0.pt", weights_only=False).items()}
    model = get_peft_model(base_model(assets), LoraConfig(r=meta["r"], lora_alpha=meta["lora_alpha"],
                                                          target_modules="all-linear", task_type="CAUSAL_LM"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {name for name in missing if name.endswith("lm_head.weight")} if model.config.tie_word_embeddings else set()
    assert set(missing) == tied and not unexpected, (missing, unexpected)
    return model.eval(), state


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).abs() / b.abs().clamp(min=1e-12)).max())


def check_lora_run_with_reference(assets, workdir: Path, metrics: dict, records: dict) -> float:
    """Every check of a 3-step ``amir.reference=ref`` LoRA run; returns the largest relative l_ref error."""
    base = base_model(assets)
    base_state = base.state_dict()
    models = {0: base}  # the adapter starts with lora_B = 0: the step-1 policy is the base model
    states = {}
    for step in sorted(records):
        models[step], states[step] = load_checkpoint(assets, workdir, step)
    worst = 0.0
    for step, record in sorted(records.items()):
        # l_ref AMIR used == the base model without adapter, recomputed here
        l_ref = seq_mean(response_log_probs(base, record), record)
        used = torch.tensor(record[FIELD_REF_SEQ_LOGP])
        worst = max(worst, relative_error(used, l_ref))
        torch.testing.assert_close(used, l_ref, rtol=1e-5, atol=0.0)
        # the policy at the step's start: the previous step's checkpoint reproduces verl's old log-probs
        l_theta_tokens = response_log_probs(models[step - 1], record)
        for mine, verls in zip(l_theta_tokens, record["old_log_probs"]):
            torch.testing.assert_close(mine, torch.tensor(verls), rtol=1e-5, atol=1e-6)
        l_theta = seq_mean(l_theta_tokens, record)
        if step > 1:  # the adapter has moved the policy away from the reference
            assert float((l_theta - l_ref).abs().max()) > 1e-4, step
        pairs = pairs_by_definition(record)
        assert metrics[step][NUM_PAIRS] == len(pairs) > 0
        assert metrics[step][PREF_LOSS] == pytest.approx(-float(pref_objective(l_theta, l_ref, pairs)), rel=1e-5)
    # the rollout served the trained adapter: its log-probs are the actor's after every update
    assert all(metrics[step][ROLLOUT_PROBS_DIFF_MAX] < 1e-5 for step in records)
    # only adapter weights change: every base tensor is bit-identical after each step
    for step, state in states.items():
        for name, tensor in state.items():
            if "lora_" not in name:
                key = name.removeprefix("base_model.model.").replace(".base_layer", "")
                assert torch.equal(tensor, base_state[key]), (step, name)
    last, before = max(states), max(states) - 1
    moved = [name for name in states[last] if "lora_B" in name and not torch.equal(states[last][name], states[before][name])]
    assert moved, "no adapter weight changed in the last step"
    return worst


@pytest.fixture(scope="module")
def lora_runs(assets, tmp_path_factory):
    """Two LoRA runs side by side -> {run: (workdir, verl's console metrics by step, the probe's records by step)}."""
    from amir_verl.run_config import amir_overrides
    from tests.e2e.support import GSPO_FLAGS, train_side_by_side

    runs = {  # run -> (steps, overrides)
        # AMIR-GSPO with amir.reference=ref (AMIR-GRPO with LoRA is the reference-free run; the reference
        # path does not depend on the base loss)
        "amir_gspo": (3, GSPO_FLAGS + amir_overrides("amir_gspo", reference="ref", beta_dpo=BETA, delta_r=DELTA)
                      + recipe_lora_overrides()),
        "ref_free": (2, amir_overrides("amir_grpo", reference="ref_free", beta_dpo=BETA, delta_r=DELTA)
                     + recipe_lora_overrides()
                     + ["actor_rollout_ref.model.lora.merge=True", "actor_rollout_ref.rollout.layered_summon=False"]),
    }
    root = tmp_path_factory.mktemp("lora")
    metrics = train_side_by_side({name: lora_command(assets, root / name, steps, overrides)
                                  for name, (steps, overrides) in runs.items()})
    results = {}
    for name, (steps, _) in runs.items():
        assert sorted(metrics[name]) == list(range(1, steps + 1)), name
        records = {step: torch.load(root / name / "probe" / f"step_{step}.pt") for step in range(1, steps + 1)}
        results[name] = (root / name, metrics[name], records)
    return results


@pytest.mark.e2e
def test_lora_reference_is_the_base_model_and_only_the_adapter_trains(assets, lora_runs):
    """AMIR-GSPO, 3 steps with the recipe's LoRA settings and amir.reference=ref: l_ref == the base model's
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
