"""The toy study as a user runs it, at its smallest: 2 seeds of 2 steps, a checkpoint every step, validated at the
end (``python -m amir_verl.study --task toy --seeds 2 --steps 2 -- trainer.save_freq=1 trainer.test_freq=2``).

The study makes its setting (the cold-started model and the copy-digit data) once, trains each seed's GRPO /
AMIR-GRPO pair through the demo's real ``main_ppo`` runs, scores every checkpoint of both runs on the one probe set,
and reports. Checked: a progress line per finished seed; every run's probe scores at every checkpoint equal a plain
recomputation from that checkpoint's saved weights with transformers; the report's probe tables cover steps 0, 1
and 2 over both seeds; the same command again reads everything back and trains nothing. (The statistics and the
report's arithmetic are checked by hand in tests/test_study.py and tests/test_probes.py.)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from amir_verl.study import probes, toy_setting
from tests.e2e.support import load_policy
from tests.support import plain_scores

pytestmark = pytest.mark.e2e

# a curve of three checkpoints; each run's start-up, not its steps, is most of its time
SEEDS, STEPS, SAVE_EVERY = 2, 2, 1
TIMEOUT_S = 1200


def study(workdir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "amir_verl.study", "--task", "toy", "--seeds", str(SEEDS), "--steps",
                           str(STEPS), "--workdir", str(workdir), "--", f"trainer.save_freq={SAVE_EVERY}",
                           f"trainer.test_freq={STEPS}"], capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def toy_study(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    workdir = tmp_path_factory.mktemp("study") / "toy"
    return workdir, study(workdir)


def test_the_toy_study_trains_scores_every_checkpoint_and_reports(toy_study):
    workdir, done = toy_study
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for seed in range(SEEDS):
        assert f"[study] seed {seed} done in" in done.stdout
    model = {"model": str(workdir / toy_setting.SETTING_FOLDER / "model")}
    checkpoints = list(range(0, STEPS + 1, SAVE_EVERY))
    for seed in range(SEEDS):
        folder = workdir / f"seed_{seed}"
        probe_set = probes.ProbeSet.load(folder / probes.PROBE_FILE)
        assert len(probe_set.prompts) == toy_setting.VALIDATION_ROWS
        for run in probes.DEMO_RUNS:
            scores = probes.read_scores(folder / run / probes.SCORES_FILE, probe_set)
            assert list(scores) == checkpoints
            for step in checkpoints:  # step 0: the shared starting model
                plain = plain_scores(load_policy(model, folder / run, step), probe_set)
                assert scores[step].margin == pytest.approx(plain["margin"], abs=1e-5), (seed, run, step)
                assert scores[step].pair_accuracy == pytest.approx(plain["pair_accuracy"]), (seed, run, step)
    report = (workdir / "study.md").read_text()
    for step in checkpoints:
        assert f"\n| {step} | {SEEDS} |" in report
    assert (workdir / "study.png").exists() and (workdir / "study_probes.csv").exists()


def test_the_same_command_reads_the_study_back_and_trains_nothing(toy_study):
    workdir, _ = toy_study
    report = (workdir / "study.md").read_text()
    again = study(workdir)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("done earlier") == SEEDS and "training GRPO" not in again.stdout
    assert (workdir / "study.md").read_text() == report
