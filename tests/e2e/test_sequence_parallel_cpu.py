"""Ulysses sequence parallelism (``actor_rollout_ref.actor.ulysses_sequence_parallel_size=2``) through verl 0.9.1's
real ``main_ppo`` on the CPU backend: 2 ranks over gloo in one SP group (data-parallel size 1), packed sequences
(``use_remove_padding=True``, which verl's Ulysses path requires), the reference policy with the same SP size.

verl slices each packed micro-batch's sequence across the SP group, all-to-alls around the attention, gathers the
log-probs over the group before the loss and scales the gathered tensor's gradient by the SP size; AMIR's loss then
sees ``dp_size`` = world / SP = 1. The CPU backend's patch 9 (:mod:`amir_verl.cpu.platform`) gives sdpa attention
the all-to-alls verl gives flash-attention only; without it each rank's attention sees only its slice and the
log-probs of tokens whose context crosses a slice are wrong, silently (a control run of this test's SP run with the
patch made a no-op: old log-probs up to 0.16 off the brute force, and :func:`check_update` fails).

One AMIR-GRPO run with SP 2 for 2 steps, checked by brute force from its probe records and checkpoints, each step
as the async schedules' updates are (:func:`tests.e2e.support.check_update`): verl's old log-probs (the SP forward)
against the step's starting policy, AMIR's reference scores against the initial model, the pairs and ``J_pref`` by
definition, the driver's pg gradient norm, and verl's actor gradient norm (the SP backward, its gradient scaling and
AMIR's normalisation) against the gradient of the whole-batch loss, computed without SP. Beside it, the same run with
SP 1 on one rank: same seeds, one rollout replica in both (the SP run's rollout has tensor-parallel size 2), so the
same samples; its metrics at both steps equal the SP run's up to float summation order.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from amir_verl.cpu.launch import LoggedCommand
from amir_verl.metrics import LAMBDA, NUM_PAIRS, PG_GRAD_NORM, PREF_LOSS, PREF_TERM
from amir_verl.run_config import amir_overrides
from tests.e2e.probe import probed
from tests.e2e.support import (BASE_METRICS, BETA, DELTA, assert_same, check_sync_run, processes_printing, train_command,
                               train_side_by_side)
from tests.support import REPO

pytestmark = pytest.mark.e2e

STEPS, PROMPTS, SP = 2, 8, 2


def sp_command(assets, workdir: Path, sp: int) -> LoggedCommand:
    """AMIR-GRPO on ``sp`` ranks with Ulysses SP ``sp`` (1: one rank, no SP), a checkpoint every step, token-level IS
    weights (:func:`check_update` reads them), the probe recording."""
    command = train_command(assets, workdir, STEPS, amir_overrides("amir_grpo", beta_dpo=BETA, delta_r=DELTA) + [
        "actor_rollout_ref.model.use_remove_padding=True",
        f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp}",
        # one hf rollout replica over all ranks, as on one rank: the hf server seeds each sample by (seed, step,
        # prompt, its count of that prompt), so two replicas would split a group's counts
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={sp}",
        "algorithm.rollout_correction.rollout_is=token",
    ], n_gpus=sp, save_freq=1 if sp > 1 else -1)
    return probed(command, workdir, REPO)


@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory) -> dict[str, tuple[Path, dict[int, dict[str, float]]]]:
    """{"sp2" / "sp1": (its workdir, verl's metrics by step)}, the two runs side by side."""
    root = tmp_path_factory.mktemp("sp")
    commands = {f"sp{sp}": sp_command(assets, root / f"sp{sp}", sp) for sp in (SP, 1)}
    metrics = train_side_by_side(commands)
    return {name: (root / name, metrics[name]) for name in commands}


def test_sequence_parallel_run_is_exact_against_brute_force(assets, runs):
    workdir, metrics = runs[f"sp{SP}"]
    # both ranks ran their attention over the SP group (patch 9 says so once per process)
    log = (workdir / "main_ppo.log").read_text()
    assert len(processes_printing(log, f"Ulysses all-to-all around sdpa attention, SP group of {SP}")) == SP
    records = check_sync_run(assets, workdir, STEPS, PROMPTS, world=SP)
    for step, record in records.items():
        for key in (NUM_PAIRS, PREF_LOSS):  # the console's figures are the probe's: one update per step
            assert metrics[step][key] == pytest.approx(record["metrics"][key], rel=1e-6), (step, key)


def test_sequence_parallel_steps_equal_the_same_steps_without_it(runs):
    """SP 2 on 2 ranks and SP 1 on one rank, from the same model, seeds and data order: the same samples and the same
    updates, step by step (verl's base metrics, the actor's gradient norm, AMIR's pairs, J_pref, lambda and term).
    Step 1's J_pref is log 2 in both (the policy is the reference); step 2's is not. (Seen: grad norms equal to 1e-7
    relative, pg_loss within 2e-8 absolute.)"""
    (sp_dir, sp), (plain_dir, plain) = runs[f"sp{SP}"], runs["sp1"]
    for step in range(1, STEPS + 1):  # the same (prompt, response) samples, in whatever order they finished
        samples = [sorted(zip(map(tuple, record["prompts"]), map(tuple, record["responses"])))
                   for record in (torch.load(d / "probe" / f"step_{step}.pt") for d in (sp_dir, plain_dir))]
        assert samples[0] == samples[1], step
    keys = BASE_METRICS + [NUM_PAIRS, PREF_LOSS, LAMBDA, PREF_TERM, PG_GRAD_NORM]
    for step in range(1, STEPS + 1):
        for key in keys:
            print(f"step {step} {key}: SP {sp[step][key]!r}, no SP {plain[step][key]!r}, "
                  f"diff {abs(sp[step][key] - plain[step][key]):.3e}")
    assert sp[STEPS][PREF_LOSS] != pytest.approx(sp[1][PREF_LOSS], rel=1e-3)  # the policy has left the reference
    assert_same(plain, sp, keys, range(1, STEPS + 1))
