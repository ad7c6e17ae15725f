"""End to end through verl 0.9.1's real ``python -m verl.trainer.main_ppo`` on the CPU backend.

Each test launches main_ppo (Ray, TransferQueue, FSDP2 actor and reference, the ``hf`` rollout,
reward workers, V1 sample balancing, checkpoints) on the toy task, and reads verl's console metrics.
Run them alone with ``python -m pytest -m e2e``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from statistics import fmean
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch

from amir_verl import run_figures
from amir_verl.cpu.launch import GRACE_S, LoggedCommand, read_verl_metrics, run_main_ppo, verl_metrics_path
from amir_verl.cpu.settings import OPENMP_ENV
from amir_verl.demo.quickstart import DEFAULT_STEPS, DEFAULT_WORKDIR, RUNS, run_overrides
from amir_verl.demo.report import NO_BRIER, SUMMARY_WINDOW
from amir_verl.demo.toy_task import make_assets
from amir_verl.run_config import amir_overrides
from amir_verl.metrics import LAMBDA, MARGIN, NUM_PAIRS, PAIR_ACCURACY, PAIRED_SEQUENCES_MIN, PREFIX, PREF_LOSS, PREF_TERM, PREF_TERM_MIN, REWARD, ROLLOUT_PROBS_DIFF_MAX
from tests.e2e.support import BAD_CONFIGS, BASE_METRICS, assert_same, train_command, train_side_by_side
from tests.support import REPO, readme_commands, sigint_as_from_a_terminal

pytestmark = pytest.mark.e2e


# stock GRPO: the demo's overrides without any of amir_overrides' (no AMIR key, no reference model, no KL), so that
# the demo's grpo run differs from it by exactly amir_overrides(...) (quickstart.RUNS)
GRPO_BASE: list[str] = []


@dataclass
class InterruptedQuickstart:
    """The quickstart stopped by Ctrl-C once its step 1 was on the console."""

    workdir: Path
    started: list[psutil.Process]  # its processes when the signal went: main_ppo, Ray's GCS and raylet, the workers
    started_commands: list[str]
    started_openmp: list[dict[str, str | None] | None]  # the OPENMP_ENV keys of each one's environment then (None: ended)
    stop_s: float  # from the signal to its exit
    returncode: int
    out: str
    err: str


@pytest.fixture(scope="module")
def independent_runs(assets, tmp_path_factory) -> dict[str, tuple[Path, dict[int, dict[str, float]]]]:
    """The runs that need nothing from each other, side by side: the 2-rank run and the quickstart that Ctrl-C
    stops after its step 1 (:func:`interrupted_quickstart`), which uses the calibrated reward manager on the way.
    {run: (its workdir, its metrics by step)}; the interrupted quickstart's record under ``"interrupted"``. Each
    test below builds its run's command next to it; selecting any of them runs both. (The AMIR-GSPO switch is
    checked on the LoRA runs, tests/e2e/test_lora.py.)"""
    root = tmp_path_factory.mktemp("runs")
    with ThreadPoolExecutor(1) as pool:
        interrupted = pool.submit(interrupted_quickstart, root / "interrupted")
        dp2 = train_side_by_side({"dp2": dp2_command(assets, root / "dp2")})["dp2"]
        stopped = interrupted.result()
    quickstart_metrics = read_verl_metrics(verl_metrics_path(stopped.workdir / "grpo" / "main_ppo.log"))
    return {"dp2": (root / "dp2", dp2), "calibrated": (stopped.workdir / "grpo", quickstart_metrics),
            "interrupted": stopped}


DP2_BETA, DP2_DELTA, DP2_LAMBDA = 0.5, 0.05, 0.05  # pairs from step 1 on the toy reward's format credit


def dp2_command(assets, workdir: Path) -> LoggedCommand:
    return train_command(
        assets, workdir, 1,
        amir_overrides("amir_grpo", reference="ref_free", beta_dpo=DP2_BETA, delta_r=DP2_DELTA, lambda_rule="fixed",
                       lambda_init=DP2_LAMBDA)
        + [f"trainer.rollout_data_dir={workdir / 'rollouts'}", "actor_rollout_ref.model.use_remove_padding=True",
           "actor_rollout_ref.actor.ppo_mini_batch_size=4",  # 8 prompts per step: 2 optimizer steps
           "actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=64",
           "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
           "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=64",
           "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True", "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=64"],
        n_gpus=2, micro_batch=4,
    )


def test_two_ranks_two_mini_batches_and_micro_batches_report_the_brute_force_preference_loss(assets, independent_runs):
    """2 data-parallel ranks, 2 mini-batches (optimizer steps) per step, packed sequences (remove padding)
    and dynamic micro-batches of at most 64 tokens (about 3 samples) over groups of 8: groups split
    everywhere. verl's logged amir/pref_loss at step 1 equals J_pref recomputed from the dumped rollouts by
    definition.

    The actor loss logs, per optimizer step, the term it added (``actor/amir_pref_term``: verl averages it
    over the optimizer steps; ``..._min``: the smallest) and the paired sequences it held
    (``actor/amir_paired_sequences_min``: the fewest). Decided from the weight lambda * M * dp / P before
    running: an optimizer step receives a positive share exactly when it holds a paired sequence, and the
    shares average to about lambda * (-J_pref) (each is its sequences' part of the whole-batch term, times
    M = 2; the second step's sequences have moved by one optimizer step). Without the factor M the average
    would be half that. (Not on a resumed run: which samples share a mini-batch follows the order in which
    rollouts finish, so two runs with several mini-batches differ beyond float summation order.)"""
    workdir, metrics = independent_runs["dp2"]
    beta, delta, lam, dump = DP2_BETA, DP2_DELTA, DP2_LAMBDA, workdir / "rollouts"
    m = metrics[1]
    assert m[NUM_PAIRS] > 0
    assert "AMIR: 2 mini-batch(es) x 1 epoch(s) per step" in (workdir / "main_ppo.log").read_text()
    assert m[LAMBDA] == lam
    assert (m[PREF_TERM_MIN] > 0) == (m[PAIRED_SEQUENCES_MIN] > 0)
    assert m[PREF_TERM] == pytest.approx(lam * m[PREF_LOSS], rel=0.15)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(assets["model"])
    model = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32).eval()
    rows = [json.loads(line) for line in (dump / "1.jsonl").read_text().splitlines()]
    groups: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        prompt = tokenizer(row["input"])["input_ids"]
        response = tokenizer(row["output"])["input_ids"]
        if len(response) < 4:  # generation stopped at <eos>, which the dump's decoding dropped
            response = response + [tokenizer.eos_token_id]
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        token_logp = logp[len(prompt) - 1 :].gather(-1, ids[0, len(prompt) :, None]).squeeze(-1)
        groups.setdefault(row["uid"].rsplit("_", 2)[0], []).append((row["score"], float(token_logp.mean())))
    terms = [
        torch.nn.functional.logsigmoid(torch.tensor(beta * (li - lj)))
        for members in groups.values()
        for ri, li in members
        for rj, lj in members
        if ri - rj > delta
    ]
    assert len(terms) == metrics[1][NUM_PAIRS]
    assert metrics[1][PREF_LOSS] == pytest.approx(-float(torch.stack(terms).mean()), rel=1e-4)


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_bad_amir_config_fails_before_training_naming_the_fix(bad_config_runs, name):
    returncode, log = bad_config_runs.result()[name]
    assert returncode != 0
    assert re.search(BAD_CONFIGS[name][1], log)
    assert "step:1" not in log and "Loading weights" not in log  # nothing trained, no model loaded
    assert "ray init kwargs" not in log  # stopped on the driver, before Ray started


CALIBRATED = ["reward.reward_manager.name=amir_calibrated", "+reward.reward_kwargs.w_fmt=0.2", "trainer.test_freq=1"]


def test_calibrated_reward_manager_runs_in_verls_reward_loop(independent_runs):
    """reward.reward_manager.name=amir_calibrated (the interrupted quickstart's, after ``--``) resolves in verl's
    reward-loop workers (plugin loaded there too) and its extra fields reach validation. RAY_ADDRESS names a
    Ray that does not exist: the CPU overrides start the run's own Ray anyway."""
    _, metrics = independent_runs["calibrated"]
    assert metrics[1][REWARD] >= 0.0  # the toy model never writes the template: score ~0
    keys = set(metrics[1])
    assert any(k.endswith("/brier/mean@4") for k in keys) and any(k.endswith("/format/mean@4") for k in keys)


def quickstart(workdir: Path, *args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "amir_verl.demo.quickstart", "--workdir", str(workdir), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def read_jsonl(path: Path) -> dict[int, dict]:
    return {row["step"]: row for row in map(json.loads, path.read_text().splitlines())}


def readme_demo() -> tuple[list[str], int, str]:
    """The README's demo command (its first code block's first command, after the install), the steps it
    trains, and the table the demo's page (docs/quickstart.md) says it prints."""
    demo = readme_commands()[0].split("&&")[-1].split()
    assert demo[:3] == ["python", "-m", "amir_verl.demo.quickstart"], demo
    table = re.search(r"^\| run \| steps \|.*?(?=\n\n)", (REPO / "docs" / "quickstart.md").read_text(), re.S | re.M)[0]
    return [sys.executable, *demo[1:]], DEFAULT_STEPS, table


def test_the_readmes_demo_prints_the_readmes_table_on_a_quiet_console_and_its_grpo_is_stock_grpo(tmp_path):
    """The demo as a newcomer runs it, the README's command verbatim (CI's run of it: ``.ci/run`` runs only the
    tests): exit 0, no traceback anywhere, one console line per step, both runs from the same model, seeds and
    data order (identical step-1 rollouts), the plot, and the table its page (docs/quickstart.md) shows, byte for byte.

    Its ``grpo`` run is the AMIR trainer with lambda fixed at 0, from the documented overrides (``amir_overrides``,
    whose ``use_kl_loss=True`` computes reference log-probs with ``kl_loss_coef=0.0``); stock GRPO with the same
    overrides and none of those (no reference, no KL) matches its first 3 steps, so the demo's GRPO is GRPO and its
    margin is GRPO's."""
    command, steps, readme_table = readme_demo()
    proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    workdir = tmp_path / DEFAULT_WORKDIR
    # stock GRPO beside it, from assets made the same way (the same seeds)
    assets, stock_steps = make_assets(tmp_path / "stock_assets"), 3
    run_main_ppo(run_overrides(assets, tmp_path / "stock", stock_steps, 0, GRPO_BASE), log_path=tmp_path / "stock.log",
                 timeout=900)
    stock = read_verl_metrics(verl_metrics_path(tmp_path / "stock.log"))
    out, err = proc.communicate(timeout=1800)
    assert proc.returncode == 0, err[-3000:] + out[-3000:]
    assert err == "" and "Traceback" not in out
    step_lines = 0
    for run in ("grpo", "amir_grpo"):
        assert "Traceback" not in (workdir / run / "main_ppo.log").read_text()  # shutdown included
        lines = [line for line in out.splitlines() if line.startswith(f"[{run}] step ")]
        assert [line.split()[2] for line in lines] == [f"{s}/{steps}" for s in range(steps + 1)]
        step_lines += len(lines)
    assert len(out.splitlines()) - step_lines < 22  # verl's metric dump went to the logs
    grpo, amir = (read_jsonl(workdir / run / "metrics.jsonl") for run in ("grpo", "amir_grpo"))
    assert_same(grpo, amir, [REWARD, "response_length/mean"], [1])  # the same step-1 rollouts
    assert all(grpo[s][LAMBDA] == 0.0 < amir[s][LAMBDA] for s in range(1, steps + 1))
    assert any(grpo[s][NUM_PAIRS] > 0 for s in range(1, steps + 1))  # the term was there, weighted 0
    # the hf rollout got the updated weights: its log-probs match the actor's after updates too
    assert all(grpo[s][ROLLOUT_PROBS_DIFF_MAX] < 1e-5 for s in range(2, steps + 1))
    assert (workdir / "quickstart.png").read_bytes()[:4] == b"\x89PNG"
    printed = (workdir / "summary.md").read_text().strip()
    assert printed in out
    assert printed == readme_table, f"the demo printed\n{printed}\ndocs/quickstart.md shows\n{readme_table}"
    summary = run_figures.read_summary(workdir)  # what the study reads: the table's figures
    figures = summary["runs"]
    for row in printed.splitlines()[2:]:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        run = figures[cells[0]]
        assert cells[2].split(" -> ")[1] == f"{run[run_figures.REWARD]:.3f}"
        assert cells[3].split(" -> ")[1] == f"{run[run_figures.VALIDATION_ACCURACY]:.3f}"
        assert cells[4] == f"{run[run_figures.MARGIN]:+.3f}" and cells[5] == f"{run[run_figures.PAIR_ACCURACY]:.2f}"
        assert run[run_figures.BRIER] is None
    assert summary["not_measured"] == {run_figures.BRIER: NO_BRIER}
    for run, (label, _) in RUNS.items():  # each figure by its definition, from the run's metrics
        logged = read_jsonl(workdir / run / "metrics.jsonl")
        with_pairs = [logged[s] for s in range(1, steps + 1) if logged[s][NUM_PAIRS]][-SUMMARY_WINDOW:]
        assert with_pairs, "the toy task mines pairs from step 1 on"
        last_val = logged[max(s for s, m in logged.items() if any(k.startswith("val-core/") for k in m))]
        assert figures[label] == pytest.approx({
            run_figures.REWARD: fmean([logged[s][REWARD] for s in range(steps - SUMMARY_WINDOW + 1, steps + 1)]),
            run_figures.VALIDATION_ACCURACY: fmean([v for k, v in last_val.items()
                                                   if k.startswith("val-core/") and "/acc/mean@" in k]),
            run_figures.MARGIN: fmean([m[MARGIN] for m in with_pairs]),
            run_figures.PAIR_ACCURACY: fmean([m[PAIR_ACCURACY] for m in with_pairs]),
            run_figures.BRIER: None}), label

    for made in ("model/model.safetensors", "data/train.parquet", "data/test.parquet"):
        assert (workdir / made).read_bytes() == (tmp_path / "stock_assets" / made).read_bytes(), made
    assert not any(key.startswith(PREFIX) for key in stock[1])
    assert "actor/kl_loss" not in stock[1]  # stock GRPO computes no KL; the grpo run's is weighted 0
    assert_same(stock, grpo, [key for key in BASE_METRICS if key != "actor/kl_loss"], range(1, stock_steps + 1))


def openmp_settings(process: psutil.Process) -> dict[str, str | None] | None:
    """The OPENMP_ENV keys of ``process``'s environment, None if it has ended."""
    try:
        return {key: process.environ().get(key) for key in OPENMP_ENV}
    except psutil.NoSuchProcess:
        return None


def interrupted_quickstart(workdir: Path) -> InterruptedQuickstart:
    """``quickstart --runs grpo --steps 40 -- <the calibrated reward>`` with RAY_ADDRESS naming a Ray that does
    not exist, sent SIGINT as a terminal's Ctrl-C once step 1 is on its console."""
    environment = {key: value for key, value in os.environ.items() if key not in OPENMP_ENV}  # main_ppo_env's to set
    proc = quickstart(workdir, "--runs", "grpo", "--steps", "40", "--", *CALIBRATED, preexec_fn=sigint_as_from_a_terminal,
                      env=dict(environment, RAY_ADDRESS="127.0.0.1:9"))
    for line in proc.stdout:
        if line.startswith("[grpo] step  1/40"):
            break
    else:
        pytest.fail(f"no step 1: {proc.stderr.read()[-3000:]}")
    started = psutil.Process(proc.pid).children(recursive=True)
    started_commands = [" ".join(p.cmdline()) for p in started]
    started_openmp = [openmp_settings(p) for p in started]
    proc.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C sends the quickstart (main_ppo has its own session)
    start = time.monotonic()
    out, err = proc.communicate(timeout=120)
    return InterruptedQuickstart(workdir, started, started_commands, started_openmp, time.monotonic() - start,
                                 proc.returncode, out, err)


def test_quickstart_ctrl_c_stops_promptly_leaves_nothing_running_and_says_where_the_results_are(independent_runs):
    stopped = independent_runs["interrupted"]
    assert any("verl.trainer.main_ppo" in command for command in stopped.started_commands)
    # bounded by the launcher, not by the machine's pace: SIGTERM, then SIGKILL after GRACE_S
    assert stopped.stop_s < 2 * GRACE_S + 20
    assert stopped.returncode == 130
    assert "Traceback" not in stopped.out + stopped.err
    assert "interrupted during grpo at step " in stopped.err and str(stopped.workdir) in stopped.err
    assert 1 in read_jsonl(stopped.workdir / "grpo" / "metrics.jsonl")  # the partial results are where it says
    assert still_running(stopped.started, within_s=30) == []  # killed processes vanish once the kernel has reaped them


def test_every_process_of_a_cpu_run_waits_in_openmp_as_the_cpu_settings_say(independent_runs):
    """The quickstart, started without OPENMP_ENV's keys, gives them to main_ppo (``main_ppo_env``), and Ray gives
    them to every worker it starts for verl: each process that runs torch has them. (Ray starts its own agents,
    ``ray::DashboardAgent`` and the like, with an environment of its own; they run no torch.)"""
    stopped = independent_runs["interrupted"]
    settings = {}  # process (main_ppo, or a Ray worker's actor class) -> its OPENMP_ENV keys
    for command, openmp in zip(stopped.started_commands, stopped.started_openmp):
        name = "main_ppo" if "verl.trainer.main_ppo" in command else command.split()[0].split(".")[0]
        if (name == "main_ppo" or name.startswith("ray::")) and not name.endswith("Agent") and openmp is not None:
            settings.setdefault(name, []).append(openmp)
    assert {"main_ppo", "ray::TaskRunnerV1", "ray::WorkerDict"} <= set(settings), stopped.started_commands
    assert {name: each for name, each in settings.items() if any(openmp != OPENMP_ENV for openmp in each)} == {}


def still_running(processes: list[psutil.Process], within_s: float) -> list[psutil.Process]:
    """Those of ``processes`` that are still running (not gone, not a zombie) after waiting up to ``within_s``."""
    def running(process: psutil.Process) -> bool:
        try:
            return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + within_s
    while (alive := [p for p in processes if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive
