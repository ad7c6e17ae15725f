"""The CPU paper pipeline's pieces (no launch): its overrides leave every algorithm key of the paper recipes as
written, its generated data passes through data_prep into the parquet the recipes read, and its summary and
evaluation stage, on runs built to hit each case (no pair, nothing to measure, identical or departed
responses, a failing analysis), say what the files show."""

import math
import os
import random

import pytest
from omegaconf import OmegaConf

from amir_verl.paper_pipeline import EVAL_BENCHMARKS
from amir_verl.paper_pipeline.pipeline import CPU_OVERRIDES, ROLLOUTS, SIZES, rollout_settings
from amir_verl.paper_pipeline.data import raw_record, word_problem, worked_answer
from amir_verl.datasets import SOURCES, to_row
from amir_verl.reward import compute_score
from amir_verl.reward.template import parse_response
from amir_verl.demo.toy_task import make_assets
from amir_verl.metrics import LAMBDA, NUM_PAIRS, PREF_LOSS, PREF_TERM, REWARD
from amir_verl.paper_pipeline.report import Evaluated, pair_figures, summary
from amir_verl import run_figures
from tests.support import compose_recipe, verl_dump

# Paths of the composed config that define the algorithm: what the overrides must not change. An entry ending
# in "." or "_" is a prefix; any other is that key and everything under it.
ALGORITHM_KEYS = (
    "algorithm.",  # advantage estimator, KL in reward
    "amir.",
    "trainer.v1.trainer_mode",
    "actor_rollout_ref.actor.policy_loss.",
    "actor_rollout_ref.actor.loss_agg_mode",
    "actor_rollout_ref.actor.clip_ratio_",
    "actor_rollout_ref.actor.clip_ratio",
    "actor_rollout_ref.actor.use_kl_loss",
    "actor_rollout_ref.actor.kl_loss_",
    "actor_rollout_ref.actor.entropy_coeff",
    "actor_rollout_ref.actor.optim.",
    "actor_rollout_ref.actor.ppo_epochs",
    "actor_rollout_ref.model.lora_",
    "actor_rollout_ref.model.lora.",
    "actor_rollout_ref.model.target_modules",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.rollout.temperature",
    "actor_rollout_ref.rollout.top_p",
    "actor_rollout_ref.rollout.top_k",
    "actor_rollout_ref.rollout.val_kwargs.",
    "reward.reward_manager.",
    "reward.custom_reward_function.",
    "data.max_prompt_length",
    "data.filter_overlong_prompts",
    "data.truncation",
    "data.val_files",
    "data.train_files",
)


def is_algorithm_key(path: str) -> bool:
    return any(path.startswith(key) if key.endswith((".", "_")) else path == key or path.startswith(key + ".")
               for key in ALGORITHM_KEYS)


def differences(a, b, path=""):
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in a.keys() | b.keys() for d in differences(a.get(k), b.get(k), f"{path}.{k}" if path else k)]
    return [] if a == b else [path]


def test_every_size_sets_the_same_keys():
    """So that the check below, composed with one size, holds for every size."""
    assert len({tuple(o.split("=")[0] for o in size.overrides()) for size in SIZES.values()}) == 1


@pytest.mark.parametrize("rollout", ROLLOUTS)
@pytest.mark.parametrize("variant", ["grpo", "amir_grpo", "gspo", "amir_gspo"])
def test_the_pipelines_cpu_overrides_touch_no_algorithm_key_of_the_recipe(variant, rollout, monkeypatch):
    monkeypatch.setenv("AMIR_OUTPUT", "/tmp/out")
    as_written = OmegaConf.to_container(compose_recipe(variant, "/models/smollm2"))
    on_cpu = OmegaConf.to_container(compose_recipe(variant, "/models/smollm2", [
        *CPU_OVERRIDES, *rollout_settings(rollout)[0], *SIZES["test"].overrides()]))
    changed = sorted(differences(as_written, on_cpu))
    touched = [path for path in changed if is_algorithm_key(path)]
    assert not touched, touched
    # and the overrides do what they are for (the check above is not vacuous)
    assert "data.train_batch_size" in changed and on_cpu["actor_rollout_ref"]["rollout"]["name"] == rollout
    assert ("actor_rollout_ref.rollout.name" in changed) == (rollout != "vllm")  # the recipe's own engine is vLLM
    assert on_cpu["actor_rollout_ref"]["rollout"]["val_kwargs"]["n"] == 8 and on_cpu["actor_rollout_ref"]["rollout"]["n"] == 8
    assert on_cpu["actor_rollout_ref"]["model"]["lora_rank"] == 16


def test_the_algorithm_check_sees_a_changed_algorithm_key(monkeypatch):
    monkeypatch.setenv("AMIR_OUTPUT", "/tmp/out")
    as_written = OmegaConf.to_container(compose_recipe("amir_grpo", "/m"))
    changed = OmegaConf.to_container(compose_recipe("amir_grpo", "/m", ["actor_rollout_ref.rollout.val_kwargs.n=2",
                                                                       "+amir.beta_dpo=0.5"]))
    assert sorted(p for p in differences(as_written, changed) if is_algorithm_key(p)) == [
        "actor_rollout_ref.rollout.val_kwargs.n", "amir.beta_dpo"]


@pytest.mark.parametrize("benchmark", ["gsm8k", *EVAL_BENCHMARKS])
def test_generated_problems_convert_and_their_worked_answer_earns_full_correctness(benchmark):
    rng = random.Random(3)
    problem = word_problem(rng)
    row = to_row(SOURCES[benchmark], raw_record(benchmark, problem, 0, rng), SOURCES[benchmark].splits[-1], 0)
    golds = list(row["reward_model"]["ground_truth"])
    response = worked_answer(problem)
    if benchmark == "aqua_rat":  # the gold is the option's letter
        response = response.replace(f"<answer> {problem.answer} </answer>", f"<answer> {golds[0]} </answer>")
    assert parse_response(response).format_ok
    score = compute_score(row["data_source"], response, golds)
    assert score["acc"] == 1.0, (benchmark, golds, response, score)


# ---- the summary and the evaluation stage on runs built to hit each case ------------------------------------

RUN_PAIR = ("grpo", "amir_grpo")
SMALL = SIZES["test"]


def fake_run(work, variant, rollouts: dict[int, list[tuple[str, str]]], adapter="/adapters/init", answer="a"):
    """A run's folder as the pipeline leaves it: rollout dumps (prompt, response per row), the last validation's
    dump (every response ``answer``), hydra's record."""
    folder = work / "outputs" / f"smollm2-135m_{variant}"
    for step, rows in rollouts.items():
        verl_dump(folder / "rollout", step, [{"input": p, "output": r, "score": 1.0, "uid": f"u{i}"}
                                              for i, (p, r) in enumerate(rows)])
    validation = [{"input": "q", "output": answer, "score": 1.0, "data_source": source, "problem_id": problem}
                  for source, problems in (("openai/gsm8k", 2), ("math-ai/aime25", 1))
                  for problem in range(problems) for _ in range(8)]
    verl_dump(folder / "validation", SMALL.steps, validation)
    (folder / "hydra" / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create({"actor_rollout_ref": {"model": {"lora_adapter_path": adapter}}}),
                   folder / "hydra" / ".hydra" / "config.yaml")


@pytest.fixture(scope="module")
def merged_pair(tmp_path_factory):
    """Two model folders whose effective weights differ by 0.25 in one tensor (a power of two: exact)."""
    import shutil

    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("merged")
    model = make_assets(root / "assets", n_train=2, n_test=2)["model"]
    shutil.copytree(model, root / "grpo")
    shutil.copytree(model, root / "amir_grpo")
    weights = load_file(str(root / "amir_grpo" / "model.safetensors"))
    key = next(k for k in weights if "q_proj" in k)
    weights[key] = weights[key] + 0.25
    save_file(weights, str(root / "amir_grpo" / "model.safetensors"), metadata={"format": "pt"})
    return {"grpo": root / "grpo", "amir_grpo": root / "amir_grpo"}


def step_metrics(pairs: list[int]) -> dict[int, dict[str, float]]:
    return {step: {REWARD: 0.5, NUM_PAIRS: n, PREF_LOSS: math.log(2) + (0.001 * step if n else 0.0), PREF_TERM: 0.0,
                   LAMBDA: 0.01} for step, n in enumerate(pairs, start=1)}


def test_a_run_without_pairs_and_an_analysis_with_nothing_to_measure_are_reported_as_such(tmp_path, merged_pair):
    rows = [("p1", "r1"), ("p2", "r2")]
    for variant in RUN_PAIR:
        fake_run(tmp_path, variant, {1: rows, 2: rows})
    metrics = {"grpo": {0: {"val-core/openai/gsm8k/acc/mean@8": 0.5}, **step_metrics([0, 0])},
               "amir_grpo": step_metrics([0, 0])}
    outputs = {"margin_grpo": Evaluated("", not_measured="no problem has both a correct and an incorrect response"),
               "calibration_grpo": Evaluated("")}
    text = summary(tmp_path, [RUN_PAIR], metrics, outputs, SMALL, merged_pair)
    assert ("- Start: GRPO and AMIR-GRPO loaded the same initial adapter (/adapters/init); their step-1 rollouts "
            "are identical in 2 of 2 responses.") in text
    assert "- AMIR-GRPO mined 0, 0 pairs at steps 1-2; amir/pref_loss minus log 2 per step: -, -." in text
    assert "largest effective weight difference, AMIR-GRPO against GRPO, is 2.50e-01" in text
    assert "- AMIR-GRPO mined no pair, so its preference term was zero and it trained as GRPO did." in text
    assert "- amir-eval margin: not measured: no problem has both a correct and an incorrect response" in text
    assert "- GRPO: preference margin (merged model, amir-eval margin) -, pair accuracy -;" in text
    assert "moves a benchmark's accuracy by 6.2 to 12.5 points" in text  # 16 and 8 samples
    assert "| openai/gsm8k | 0.500 | - | - |" in text  # one validation before training, the GRPO run's


def test_the_figures_for_the_study_are_the_files_means(tmp_path):
    """pair_figures against the margin CSV, the calibration output and verl's metrics, by hand; and
    summary.json writes a missing figure (NaN or None) as null."""
    results = tmp_path / "results"
    results.mkdir()
    (results / "margin_GRPO_vs_AMIR-GRPO.csv").write_text(
        "benchmark,problem_id,n_correct,n_incorrect,margin,pair_accuracy,run\n"
        "gsm8k,1,1,1,0.2,1.0,GRPO\ngsm8k,2,2,1,-0.4,0.5,GRPO\ngsm8k,1,1,1,0.5,1.0,AMIR-GRPO\n")
    calibration = Evaluated("GRPO: Brier (stated) 0.1250 over 2  Brier (missing as 1) 0.5625 over 4  x\n"
                            "AMIR-GRPO: Brier (stated) nan over 0  Brier (missing as 1) 1.0000 over 4  x\n")
    val = {"val-core/openai/gsm8k/acc/mean@8": 0.5, "val-core/aime25/acc/mean@8": 0.0}
    metrics = {"grpo": {1: {REWARD: 0.1}, 2: {REWARD: 0.3, **val}},
               "amir_grpo": {1: {REWARD: 0.2}, 2: {REWARD: 0.4, "val-core/openai/gsm8k/acc/mean@8": 1.0}}}
    figures = pair_figures(tmp_path, *RUN_PAIR, metrics, {"margin_grpo": Evaluated(""), "calibration_grpo": calibration},
                           SMALL)
    assert figures["GRPO"] == {run_figures.REWARD: 0.3, run_figures.VALIDATION_ACCURACY: 0.25,
                               run_figures.MARGIN: pytest.approx(-0.1), run_figures.PAIR_ACCURACY: 0.75,
                               run_figures.BRIER: 0.125}
    assert figures["AMIR-GRPO"][run_figures.MARGIN] == 0.5 and figures["AMIR-GRPO"][run_figures.VALIDATION_ACCURACY] == 1.0
    assert math.isnan(figures["AMIR-GRPO"][run_figures.BRIER])
    run_figures.write_summary(tmp_path, "smollm2-135m", figures, {})
    assert run_figures.read_summary(tmp_path)["runs"]["AMIR-GRPO"][run_figures.BRIER] is None
    not_measured = {"margin_grpo": Evaluated("", not_measured="no problem has both")}
    assert pair_figures(tmp_path, *RUN_PAIR, metrics, not_measured, SMALL)["GRPO"][run_figures.MARGIN] is None
    with pytest.raises(ValueError, match="figures"):
        run_figures.write_summary(tmp_path, "t", {"GRPO": {run_figures.REWARD: 1.0}}, {})


def test_the_verdict_follows_every_response_generated_after_the_first_update(tmp_path, merged_pair):
    """Training from step 2 on and the last validation: a difference in either is a departure (on SmolLM2 at lr
    1e-3 the step-2 rollouts and the validation differed while the last step's rollouts were identical); and no
    verdict from responses where the runs' step-1 rollouts differ."""
    rows = [("p1", "r1"), ("p2", "r2")]
    metrics = {"grpo": step_metrics([0, 0]), "amir_grpo": step_metrics([3, 1])}
    fake_run(tmp_path / "same", "grpo", {1: rows, 2: rows})
    fake_run(tmp_path / "same", "amir_grpo", {1: rows, 2: rows})
    text = summary(tmp_path / "same", [RUN_PAIR], metrics, {}, SMALL, merged_pair)
    assert "amir/pref_loss minus log 2 per step: +1.00e-03, +2.00e-03." in text
    assert "- Identical responses, AMIR-GRPO against GRPO: step 2: 2 of 2; the step-2 validation: 24 of 24." in text
    assert ("- The preference term entered AMIR-GRPO's loss, but within 2 steps it did not change what the policy "
            "generates: every response of training step 2 and of the step-2 validation is GRPO's.") in text
    fake_run(tmp_path / "moved", "grpo", {1: rows, 2: rows})
    fake_run(tmp_path / "moved", "amir_grpo", {1: rows[::-1], 2: [("p1", "r1"), ("p2", "other")]}, adapter="/adapters/b")
    text = summary(tmp_path / "moved", [RUN_PAIR], metrics, {}, SMALL, merged_pair)
    assert "- AMIR-GRPO's policy departed from GRPO's: 1 of 2 responses differ at step 2." in text
    assert "loaded different initial adapters (/adapters/b, /adapters/init)" in text
    assert "step-1 rollouts are identical in 2 of 2 responses" in text  # the same samples, dumped in another order
    fake_run(tmp_path / "validation", "grpo", {1: rows, 2: rows})
    fake_run(tmp_path / "validation", "amir_grpo", {1: rows, 2: rows}, answer="b")
    text = summary(tmp_path / "validation", [RUN_PAIR], metrics, {}, SMALL, merged_pair)
    assert "- AMIR-GRPO's policy departed from GRPO's: 24 of 24 responses differ at the step-2 validation." in text
    # runs that do not sample alike (on verl's vllm rollout, step 1 differs from the same weights): no verdict
    fake_run(tmp_path / "sampling", "grpo", {1: rows, 2: rows})
    fake_run(tmp_path / "sampling", "amir_grpo", {1: [("p1", "r1"), ("p2", "other")], 2: rows}, answer="b")
    text = summary(tmp_path / "sampling", [RUN_PAIR], metrics, {}, SMALL, merged_pair)
    assert "step-1 rollouts are identical in 1 of 2 responses" in text
    assert ("- The responses cannot tell whether AMIR-GRPO changed what the policy generates: their step-1 rollouts, "
            "sampled before any update, already differ in 1 of 2, so the two runs do not sample alike") in text
    assert "policy departed from GRPO's:" not in text and "did not change what the policy generates" not in text


def test_the_evaluation_stage_reports_nothing_to_measure_and_stops_on_a_real_failure(tmp_path, merged_pair):
    """amir-eval itself, as the pipeline runs it: every validation response correct, so margin has no problem
    with both outcomes (exit 3): reported, no margin file, the other analyses done; a missing dump is a failure
    of the stage, named."""
    from amir_verl.paper_pipeline.pipeline import PipelineError, evaluate

    rows = [{"input": "q1: 3+4=?\nA: ", "output": "7", "score": 1.0, "acc": 1.0, "data_source": "openai/gsm8k",
             "problem_id": "p1", "confidence": 0.9, "brier": 0.01, "uid": f"p1_{i}_0"} for i in range(4)]  # k up to 4
    for variant in RUN_PAIR:
        for step in (0, SMALL.steps):
            verl_dump(tmp_path / "outputs" / f"smollm2-135m_{variant}" / "validation", step, rows)
    outputs = evaluate(tmp_path, [RUN_PAIR], merged_pair, merged_pair["grpo"])
    assert outputs["margin_grpo"].not_measured == ("no problem has both a correct and an incorrect response in any "
                                                   "run: no margin")
    assert not list((tmp_path / "results").glob("margin_*"))
    assert all(outputs[f"{a}_grpo"].not_measured is None for a in ("passk", "calibration", "lengths", "coverage", "perplexity"))
    assert (tmp_path / "results" / "perplexity_GRPO_vs_AMIR-GRPO.csv").exists()
    import shutil

    shutil.rmtree(tmp_path / "outputs" / "smollm2-135m_amir_grpo" / "validation")
    with pytest.raises(PipelineError, match=r"^amir-eval passk failed \(exit 2\): amir-eval: error: .*full log: "):
        evaluate(tmp_path, [RUN_PAIR], merged_pair, merged_pair["grpo"])


def test_the_vllm_rollout_without_vllm_is_refused_naming_the_extra(tmp_path, capsys, monkeypatch):
    from amir_verl.paper_pipeline import pipeline

    monkeypatch.setattr(pipeline, "vllm_installed", lambda: False)
    assert pipeline.main(["--workdir", str(tmp_path / "w"), "--rollout", "vllm"]) == 2
    err = capsys.readouterr().err
    assert "cpu-vllm" in err and pipeline.VLLM_INSTALL in err
    assert not (tmp_path / "w").exists()  # refused before any stage


def test_a_vllm_run_gets_the_engines_overrides_after_the_cpu_settings_and_its_environment(tmp_path):
    from amir_verl.cpu.settings import vllm_rollout_env, vllm_rollout_settings
    from amir_verl.paper_pipeline.pipeline import run_command

    hf, vllm = (run_command("amir_grpo", tmp_path, tmp_path, tmp_path, SIZES["test"], ["x=1"], tmp_path / "log", rollout)
                for rollout in ("hf", "vllm"))
    assert vllm.cmd == [*hf.cmd[:4 + len(CPU_OVERRIDES)], *vllm_rollout_settings(), *hf.cmd[4 + len(CPU_OVERRIDES):]]
    assert {k: vllm.env[k] for k in vllm_rollout_env()} == vllm_rollout_env()
    assert all(hf.env.get(k) == os.environ.get(k) for k in vllm_rollout_env())  # the hf run's: only what it inherits


# cores -> {rollout: threads per run}: an hf pair trains side by side, a vllm pair one run at a time
THREADS = {1: {"hf": "1", "vllm": "1"}, 2: {"hf": "1", "vllm": "2"}, 3: {"hf": "1", "vllm": "3"},
           8: {"hf": "4", "vllm": "8"}}


@pytest.mark.parametrize("affinity", [True, False], ids=["linux", "no-affinity-call"])
@pytest.mark.parametrize("cores", list(THREADS))
def test_each_run_gets_the_cores_shared_among_the_runs_training_at_once_unless_the_user_set_threads(
        tmp_path, monkeypatch, cores, affinity):
    from amir_verl.paper_pipeline.pipeline import run_command

    if affinity:  # the cores this process may use
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
        monkeypatch.setattr(os, "cpu_count", lambda: 64)
    else:  # macOS has no sched_getaffinity: the machine's cores
        monkeypatch.delattr(os, "sched_getaffinity", raising=False)
        monkeypatch.setattr(os, "cpu_count", lambda: cores)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    def threads(rollout: str) -> str:
        command = run_command("grpo", tmp_path, tmp_path, tmp_path, SIZES["test"], [], tmp_path / "log", rollout)
        return command.env["OMP_NUM_THREADS"]

    assert {rollout: threads(rollout) for rollout in ROLLOUTS} == THREADS[cores]
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert {threads(rollout) for rollout in ROLLOUTS} == {"5"}


def test_ray_leaves_a_set_omp_num_threads_to_its_workers(monkeypatch):
    """What the pipeline's threads rely on: Ray sets OMP_NUM_THREADS in a worker (to its CPUs, 1 for an actor
    without num_cpus) only where the environment has not (ray._private.utils.set_omp_num_threads_if_unset, which
    returns whether it set it)."""
    from ray._private.utils import set_omp_num_threads_if_unset

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert set_omp_num_threads_if_unset() is False and os.environ["OMP_NUM_THREADS"] == "3"


def test_the_summary_names_each_runs_rollout_engine_from_its_composed_config(tmp_path):
    from amir_verl.paper_pipeline import experiment
    from amir_verl.paper_pipeline.report import ROLLOUT_ENGINES, rollout_engines

    for variant, name in (("grpo", "hf"), ("amir_grpo", "vllm")):
        record = tmp_path / "outputs" / experiment(variant) / "hydra" / ".hydra"
        record.mkdir(parents=True)
        (record / "config.yaml").write_text(f"actor_rollout_ref:\n  rollout:\n    name: {name}\n")
    assert rollout_engines(tmp_path, ["grpo", "amir_grpo"]) == (
        f"Rollout engine: GRPO: {ROLLOUT_ENGINES['hf']}; AMIR-GRPO: {ROLLOUT_ENGINES['vllm']}.")
    assert rollout_engines(tmp_path, ["grpo"]) == f"Rollout engine (every run): {ROLLOUT_ENGINES['hf']}."


@pytest.mark.parametrize("rollout", ROLLOUTS)
def test_each_pair_trains_side_by_side_on_the_hf_server_and_one_run_at_a_time_on_vllm(tmp_path, monkeypatch, rollout):
    from amir_verl.paper_pipeline import pipeline

    launches = []
    monkeypatch.setattr(pipeline, "run_main_ppo_together", lambda commands, timeout: launches.append(list(commands)))
    pairs = [("grpo", "amir_grpo"), ("gspo", "amir_gspo")]
    pipeline.train(tmp_path, pairs, tmp_path, tmp_path, tmp_path, SIZES["test"], [], rollout=rollout)
    expected = {"hf": [list(pair) for pair in pairs], "vllm": [[v] for pair in pairs for v in pair]}
    assert launches == expected[rollout]


@pytest.mark.parametrize("installed", [True, False])
def test_auto_picks_vllm_where_it_is_installed_and_a_named_engine_is_kept(monkeypatch, installed):
    from amir_verl.paper_pipeline import pipeline

    monkeypatch.setattr(pipeline, "vllm_installed", lambda: installed)
    assert pipeline.chosen_rollout("auto") == ("vllm" if installed else "hf")
    assert [pipeline.chosen_rollout(engine) for engine in ROLLOUTS] == list(ROLLOUTS)


def test_the_train_filter_keeps_one_epoch_of_the_first_prompts_with_both_outcomes_under_the_start(tmp_path):
    """filter_train against each row's samples drawn on their own (sampled_probe_set, one row at a time): the
    first steps x prompts_per_step rows, in file order, with 2 to 6 of 8 correct, a chunk of rows at a time;
    then a filter that keeps fewer than one epoch's rows asks for more epochs, and one that keeps fewer than a
    step's is refused. The toy's random model, graded by the parity of the response's characters' sum."""
    import dataclasses

    import pyarrow.parquet as pq

    from amir_verl.demo.toy_task import make_dataset, make_model, make_tokenizer
    from amir_verl.paper_pipeline.pipeline import PipelineError, Size, filter_train
    from amir_verl.study.probes import sampled_probe_set

    model_dir = tmp_path / "model"
    make_model(model_dir, make_tokenizer(model_dir), seed=3)
    train = make_dataset(tmp_path / "data" / "gsm8k", n_train=16, n_test=1)["train"]
    rows = pq.read_table(train).to_pylist()
    size = Size(steps=3, prompts_per_step=2, response_tokens=6, train_problems=16, gsm8k_test_problems=1,
                eval_problems=1, cold_start_steps=1, train_filter_samples=8)

    def grade(data_source, text, ground_truth, extra_info):
        return {"acc": float(sum(map(ord, text)) % 2 == 0)}

    correct = [sum(r.correct for r in sampled_probe_set(model_dir, [row], 8, 6, seed=5, grade=grade,
                                                        keep_without_both=True).prompts[0].responses) for row in rows]
    qualifying = [k for k, c in enumerate(correct) if 2 <= c <= 6]
    assert len(qualifying) >= 6, correct  # the grade splits the samples of enough rows for this check
    overrides = filter_train(tmp_path, tmp_path / "data", model_dir, size, seed=5, grade=grade, chunk=5)
    out = tmp_path / "data" / "train_filtered.parquet"
    assert overrides == [f"data.train_files={out}", "trainer.total_epochs=1"]
    assert pq.read_table(out).to_pylist() == [rows[k] for k in qualifying[:6]]
    assert pq.read_table(out).schema == pq.read_table(train).schema

    longer = dataclasses.replace(size, steps=len(qualifying))  # one epoch would need twice the rows that qualify
    overrides = filter_train(tmp_path, tmp_path / "data", model_dir, longer, seed=5, grade=grade)
    assert overrides[1] == f"trainer.total_epochs={-(-len(qualifying) // (len(qualifying) // 2))}"
    assert pq.read_table(out).num_rows == len(qualifying)

    with pytest.raises(PipelineError, match="0 of 16 training prompts hold both outcomes"):
        filter_train(tmp_path, tmp_path / "data", model_dir, size, seed=5, grade=lambda *a: {"acc": 0.0})
