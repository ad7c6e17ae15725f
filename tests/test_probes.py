"""The probe instrument of the study (amir_verl/study/probes.py) against an independent computation, and the curve
statistics (amir_verl/study/statistics.py) against a hand computation with t quantiles from a printed table.

- The toy's probe set: every validation prompt as verl renders it, with the ten digits, the task's answer the one
  correct response.
- A probe set's scores (margin, pair accuracy, ...) equal plain loops over ``model(input_ids).logits`` with
  ``log_softmax``, one unpadded sequence at a time, on multi-token responses of different lengths (the batched
  scoring pads on the left and keeps only the last logits).
- A run's checkpoints: a verl-layout checkpoint folder (``global_step_<N>/actor/model_world_size_1_rank_0.pt``
  and ``huggingface/config.json``) of perturbed weights scores as those weights do, recomputed from the weights
  with transformers; step 0 is the starting model.
"""

import math
import random
from dataclasses import asdict

import pytest
import torch

from amir_verl.demo.toy_task import make_dataset, make_model, make_rows, make_tokenizer
from amir_verl.study import probes
from amir_verl.study.statistics import (
    compare_curves,
    detectable_difference,
    exact_detectable_difference,
    minimum_detectable_difference,
    paired_area,
    paired_curve,
    paired_difference,
    paired_t_power,
    trapezoid_area,
)
from tests.support import T_975, plain_mean_log_probs, plain_scores
from tests.support import paired_t_by_hand as by_hand

# t(0.80, df) from a printed table of Student's t distribution (the power quantile of the detectable difference)
T_80 = {1: 1.376, 2: 1.061, 3: 0.978, 7: 0.896}


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """The toy's tokenizer and a tiny random Qwen2 (the demo's model), saved; its validation file."""
    root = tmp_path_factory.mktemp("toy")
    tokenizer = make_tokenizer(root / "model")
    model = make_model(root / "model", tokenizer, seed=3).eval()
    data = make_dataset(root / "data", n_train=4, n_test=6)
    return {"root": root, "tokenizer": tokenizer, "model": model, "model_dir": root / "model", "test": data["test"]}


def assert_scores_match(score: probes.ProbeScore, plain: dict[str, float]) -> None:
    assert score.prompts == plain["prompts"]
    for name in ("margin", "correct_log_prob", "incorrect_log_prob"):
        assert getattr(score, name) == pytest.approx(plain[name], abs=1e-5), name
    for name in ("pair_accuracy", "top_correct"):  # counts of orderings: exact unless two scores tie within 1e-6
        assert getattr(score, name) == pytest.approx(plain[name]), name


def test_the_toy_probe_set_is_every_validation_prompt_with_the_ten_digits(toy):
    probe_set = probes.toy_probe_set(toy["test"], toy["tokenizer"])
    rows = make_rows(6, "test", 1)  # what make_dataset wrote for the test split (seed + 1)
    assert len(probe_set.prompts) == len(rows) == 6
    for prompt, row in zip(probe_set.prompts, rows):
        question = row["prompt"][0]["content"]
        a, b = map(int, question.split(": ")[1].rstrip("=?").split("+"))
        assert toy["tokenizer"].decode(list(prompt.prompt_ids)) == f"{question}\nA: "  # the chat template's prompt
        assert [r.text for r in prompt.responses] == list("0123456789")
        assert [r.text for r in prompt.responses if r.correct] == [str((a + b) % 10)]
        assert all(len(r.token_ids) == 1 for r in prompt.responses) and prompt.has_both


def test_the_toy_probe_rows_are_every_sum_once(toy):
    rows = probes.toy_probe_rows()
    questions = [row["prompt"][0]["content"] for row in rows]
    assert len(set(questions)) == 100
    sums = {q.split(": ")[1] for q in questions}
    assert sums == {f"{a}+{b}=?" for a in range(10) for b in range(10)}
    for row, question in zip(rows, questions):
        a, b = map(int, question.split(": ")[1].rstrip("=?").split("+"))
        assert list(row["reward_model"]["ground_truth"]) == [str((a + b) % 10)]
    probe_set = probes.toy_probe_set(rows, toy["tokenizer"])
    assert len(probe_set.prompts) == 100 and all(sum(r.correct for r in p.responses) == 1 for p in probe_set.prompts)


def test_the_toy_probe_scores_equal_a_plain_recomputation(toy):
    probe_set = probes.toy_probe_set(toy["test"], toy["tokenizer"])
    assert_scores_match(probes.score_policy(toy["model"], probe_set), plain_scores(toy["model"], probe_set))


def test_multi_token_responses_of_different_lengths_score_as_unpadded_sequences(toy):
    """Prompts and responses of 1 to 6 tokens, 1 to 4 correct of 5, scored 7 sequences per batch (so batches mix
    lengths and the padding and the kept logits window matter); one prompt all correct (no margin: left out)."""
    rng = random.Random(0)
    vocab = len(toy["tokenizer"])
    prompts = []
    for k in range(6):
        prompt = tuple(rng.randrange(2, vocab) for _ in range(rng.randint(3, 12)))
        correct = [j < (5 if k == 5 else rng.randint(1, 4)) for j in range(5)]
        rng.shuffle(correct)
        responses = tuple(probes.ProbeResponse(tuple(rng.randrange(2, vocab) for _ in range(rng.randint(1, 6))), ok)
                          for ok in correct)
        prompts.append(probes.ProbePrompt(f"p{k}", prompt, responses))
    probe_set = probes.ProbeSet("made-up", "random ids", tuple(prompts))
    score = probes.score_policy(toy["model"], probe_set, batch_size=7)
    assert score.prompts == 5
    assert_scores_match(score, plain_scores(toy["model"], probe_set))
    # the per-response values themselves, batched against unpadded
    batched = probes.response_log_probs(toy["model"], probe_set, batch_size=7)
    for p, values in zip(probe_set.prompts, batched):
        for r, value in zip(p.responses, values):
            assert value == pytest.approx(plain_mean_log_probs(toy["model"], list(p.prompt_ids), list(r.token_ids)),
                                          abs=1e-5)


def test_a_sampled_probe_set_is_the_starting_policys_graded_samples(toy):
    """The real task's builder on the toy (its model, rows and grader, so that it runs in seconds): reproducible
    from its seed, every response graded by the task's rule, cut after the first EOS, and only prompts with
    both outcomes kept unless asked."""
    from amir_verl.demo.toy_task import compute_score

    rows = probes.read_rows(toy["test"])
    build = dict(samples_per_prompt=8, max_new_tokens=4, seed=4, grade=compute_score)  # 3 of 6 with both
    everything = probes.sampled_probe_set(toy["model_dir"], rows, keep_without_both=True, **build)
    assert len(everything.prompts) == len(rows)
    assert probes.sampled_probe_set(toy["model_dir"], rows, keep_without_both=True, **build) == everything
    eos = toy["tokenizer"].eos_token_id
    for prompt, row in zip(everything.prompts, rows):
        assert list(prompt.prompt_ids) == probes.prompt_ids(toy["tokenizer"], list(row["prompt"]))
        assert len(prompt.responses) == 8
        for r in prompt.responses:
            assert 1 <= len(r.token_ids) <= 4 and eos not in r.token_ids[:-1]
            assert r.text == toy["tokenizer"].decode(list(r.token_ids), skip_special_tokens=True)
            verdict = compute_score(row["data_source"], r.text, list(row["reward_model"]["ground_truth"]))
            assert r.correct == (verdict["acc"] == 1)
    kept = probes.sampled_probe_set(toy["model_dir"], rows, **build)
    assert kept.prompts == tuple(p for p in everything.prompts if p.has_both) and kept.prompts
    # each prompt's own stream: the same samples alone or among the others, in any order
    alone = probes.sampled_probe_set(toy["model_dir"], rows[3:4], keep_without_both=True, **build)
    assert alone.prompts[0].responses == everything.prompts[3].responses
    backwards = probes.sampled_probe_set(toy["model_dir"], rows[::-1], keep_without_both=True, **build)
    assert backwards.prompts == everything.prompts[::-1]
    # and no stream shared between prompts, or between seeds
    streams = {probes.prompt_seed(seed, row["prompt"]) for seed in (4, 5) for row in rows}
    assert len(streams) == 2 * len(rows)
    assert_scores_match(probes.score_policy(toy["model"], kept), plain_scores(toy["model"], kept))


def write_verl_checkpoint(checkpoint_dir, step: int, model) -> None:
    """The files of a world-size-1 full-weights verl actor checkpoint that scoring reads."""
    actor = checkpoint_dir / f"global_step_{step}" / "actor"
    (actor / "huggingface").mkdir(parents=True)
    model.config.save_pretrained(actor / "huggingface")
    torch.save({name: tensor.clone() for name, tensor in model.state_dict().items()},
               actor / "model_world_size_1_rank_0.pt")


def test_a_runs_checkpoints_score_as_their_saved_weights(toy, tmp_path):
    probe_set = probes.toy_probe_set(toy["test"], toy["tokenizer"])
    checkpoints = tmp_path / "checkpoints"
    trained = {}
    for step, scale in ((2, 0.05), (4, 0.2)):
        torch.manual_seed(step)
        model = make_model(tmp_path / f"start_{step}", toy["tokenizer"], seed=3).eval()
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(scale * torch.randn_like(parameter))
        write_verl_checkpoint(checkpoints, step, model)
        trained[step] = model
    (checkpoints / "global_step_6" / "actor").mkdir(parents=True)  # a folder without a shard is not a checkpoint
    assert list(probes.run_checkpoints(checkpoints)) == [2, 4]
    scores = probes.score_run(checkpoints, toy["model_dir"], probe_set)
    assert list(scores) == [0, 2, 4]
    assert_scores_match(scores[0], plain_scores(toy["model"], probe_set))  # step 0: the starting model
    for step, model in trained.items():
        assert_scores_match(scores[step], plain_scores(model, probe_set))
    assert scores[4].margin != pytest.approx(scores[0].margin, abs=1e-3)
    with pytest.raises(ValueError, match=r"no checkpoint of step\(s\) \[3\]"):
        probes.score_run(checkpoints, toy["model_dir"], probe_set, steps=[3])
    # the scores file is tied to its probe set
    path = probes.write_scores(tmp_path / probes.SCORES_FILE, probe_set, scores)
    assert probes.read_scores(path, probe_set) == scores
    other = probes.ProbeSet("toy", "one prompt fewer", probe_set.prompts[1:])
    with pytest.raises(ValueError, match="was scored on probe set"):
        probes.read_scores(path, other)


@pytest.mark.parametrize("lora_only, with_adapter", [(False, False), (True, True)])
def test_a_lora_checkpoint_scores_as_its_base_with_the_adapter(toy, tmp_path, lora_only, with_adapter):
    """A LoRA run's checkpoint as verl writes it (the PeftModel's state dict, ``lora_train_meta.json``; with
    ``save_lora_only`` the adapter's tensors only), scored against the unmerged PeftModel's own forward."""
    import json

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(toy["model_dir"], dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    adapter = None
    if with_adapter:  # the run's initial adapter (B = 0), as amir_verl.lora_init writes it
        adapter = tmp_path / "lora_init"
        model.save_pretrained(adapter)
    torch.manual_seed(5)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.add_(0.3 * torch.randn_like(parameter))
    actor = tmp_path / "checkpoints" / "global_step_3" / "actor"
    actor.mkdir(parents=True)
    state = {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k or not lora_only}
    torch.save(state, actor / "model_world_size_1_rank_0.pt")
    (actor / "lora_train_meta.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "task_type": "CAUSAL_LM"}))
    probe_set = probes.toy_probe_set(toy["test"], toy["tokenizer"])
    scores = probes.score_run(tmp_path / "checkpoints", toy["model_dir"], probe_set, adapter=adapter)
    assert_scores_match(scores[3], plain_scores(model.eval(), probe_set))
    assert_scores_match(scores[0], plain_scores(toy["model"], probe_set))
    assert scores[3].margin != pytest.approx(scores[0].margin, abs=1e-3)  # the adapter moved the policy


FSDP2_CHECKPOINT = """
import os, sys, torch
from pathlib import Path
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM
start, actor, plain, port = sys.argv[1:5]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=0, world_size=1)
model = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32)
torch.manual_seed(7)
with torch.no_grad():
    for parameter in model.parameters():
        parameter.add_(0.1 * torch.randn_like(parameter))
model.save_pretrained(plain)  # the weights, as transformers saves them
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)
state = model.state_dict()  # as verl's FSDP2 checkpoint manager saves it: DTensors
assert all(type(t).__name__ == "DTensor" for t in state.values())
Path(actor, "huggingface").mkdir(parents=True)
model.config.save_pretrained(Path(actor, "huggingface"))
torch.save(state, Path(actor, "model_world_size_1_rank_0.pt"))
dist.destroy_process_group()
"""


def test_an_fsdp2_checkpoint_of_dtensors_scores_as_its_weights(toy, tmp_path):
    """A checkpoint written as verl's FSDP2 actor writes it (``fully_shard``, ``state_dict()`` of DTensors,
    world size 1, in a process of its own), scored against the same weights saved by transformers."""
    import socket
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    actor = tmp_path / "checkpoints" / "global_step_1" / "actor"
    done = subprocess.run([sys.executable, "-c", FSDP2_CHECKPOINT, str(toy["model_dir"]), str(actor),
                           str(tmp_path / "plain"), str(port)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    probe_set = probes.toy_probe_set(toy["test"], toy["tokenizer"])
    scores = probes.score_run(tmp_path / "checkpoints", toy["model_dir"], probe_set)
    weights = AutoModelForCausalLM.from_pretrained(tmp_path / "plain", dtype=torch.float32).eval()
    assert_scores_match(scores[1], plain_scores(weights, probe_set))


def test_a_demo_pair_is_scored_on_one_probe_set_and_read_back(toy, tmp_path):
    """The demo's layout: workdir/model, workdir/data/test.parquet, workdir/<run>/checkpoints."""
    import shutil

    workdir = tmp_path / "seed_0"
    shutil.copytree(toy["model_dir"], workdir / "model")
    (workdir / "data").mkdir(parents=True)
    shutil.copy(toy["test"], workdir / "data" / "test.parquet")
    models = {}
    for run, scale in (("grpo", 0.05), ("amir_grpo", 0.1)):
        torch.manual_seed(len(run))
        models[run] = make_model(tmp_path / run, toy["tokenizer"], seed=3).eval()
        with torch.no_grad():
            for parameter in models[run].parameters():
                parameter.add_(scale * torch.randn_like(parameter))
        write_verl_checkpoint(workdir / run / "checkpoints", 5, models[run])
    scores = probes.score_demo_pair(workdir, every_sum=False)
    probe_set = probes.ProbeSet.load(workdir / probes.PROBE_FILE)
    assert probe_set == probes.toy_probe_set(toy["test"], toy["tokenizer"])
    assert scores["grpo"][0] == scores["amir_grpo"][0]  # the shared start
    for run, model in models.items():
        assert list(scores[run]) == [0, 5]
        assert_scores_match(scores[run][5], plain_scores(model, probe_set))
    for run in models:  # scored once: the files are read back
        shutil.rmtree(workdir / run / "checkpoints")
    assert probes.score_demo_pair(workdir, every_sum=False) == scores
    shutil.copytree(toy["model_dir"], tmp_path / "seed_1" / "model")
    assert probes.score_demo_pair(tmp_path / "seed_1", runs=[]) == {}  # the default probe set: every sum
    assert len(probes.ProbeSet.load(tmp_path / "seed_1" / probes.PROBE_FILE).prompts) == 100


def test_probe_curves_feed_the_curve_comparison():
    def score(margin):
        return asdict(probes.ProbeScore(4, margin, 0.5, -1.0, -1.0 - margin, 0.25))

    per_seed = {seed: {"grpo": {0: score(0.0), 10: score(0.1 * seed), 20: score(0.2)},
                       "amir_grpo": {0: score(0.0), 10: score(0.3), 20: score(0.1 + 0.2 * seed)}}
                for seed in range(3)}
    del per_seed[2]["amir_grpo"][20]  # a missing checkpoint
    steps, grpo, amir = probes.probe_curves(per_seed, "margin")
    assert steps == [0, 10, 20] and grpo[1] == [0.0, 0.1, 0.2] and amir[2] == [0.0, 0.3, None]
    comparison = compare_curves(steps, grpo, amir)
    assert comparison.per_checkpoint == tuple(paired_curve(grpo, amir))
    assert comparison.area == paired_area(steps, grpo, amir, average=True) and comparison.area.seeds == 2
    assert comparison.detectable_area == pytest.approx(detectable_difference(comparison.area))
    assert comparison.detectable_per_checkpoint[1] == pytest.approx(detectable_difference(comparison.per_checkpoint[1]))
    with pytest.raises(ValueError, match="not a probe figure"):
        probes.probe_curves(per_seed, "prompts")
    per_seed[0]["grpo"][10]["brier"] = 0.2  # a figure only some checkpoints have: the others are left out
    per_seed[1]["amir_grpo"][20]["brier"] = float("nan")
    assert probes.probe_curves(per_seed, "brier") == ([10], [[0.2], [None], [None]], [[None], [None], [None]])
    with pytest.raises(ValueError, match="no run has the figure"):
        probes.probe_curves(per_seed, "incorrect_response_tokens")


def test_a_probe_set_saves_and_loads_with_its_fingerprint(toy, tmp_path):
    probe_set = probes.toy_probe_set(toy["test"], toy["tokenizer"])
    path = probe_set.save(tmp_path / probes.PROBE_FILE)
    assert probes.ProbeSet.load(path) == probe_set
    text = path.read_text().replace('"correct": true', '"correct": false', 1)
    path.write_text(text)
    with pytest.raises(ValueError, match="fingerprint"):
        probes.ProbeSet.load(path)


# ---- statistics over the curve ----------------------------------------------------------------------------------

STEPS = [0, 5, 10, 20]
GRPO = [[0.0, 0.1, 0.3, 0.2], [0.0, 0.2, 0.1, 0.4], [0.0, 0.0, 0.2, 0.5], [0.0, 0.3, 0.4, 0.3]]
AMIR = [[0.0, 0.2, 0.5, 0.6], [0.0, 0.1, 0.3, 0.3], [0.0, 0.2, 0.2, 0.9], [0.0, 0.3, 0.7, 0.4]]


def test_the_curve_is_a_paired_interval_per_checkpoint():
    curve = paired_curve(GRPO, AMIR)
    assert len(curve) == len(STEPS)
    assert curve[0].mean == 0 and curve[0].low == curve[0].high == 0  # the shared start: no difference
    for k, d in enumerate(curve[1:], start=1):
        mean, half = by_hand([a[k] - g[k] for g, a in zip(GRPO, AMIR)])
        assert d.seeds == 4 and d.mean == pytest.approx(mean) and (d.low + d.high) / 2 == pytest.approx(mean)
        assert (d.high - d.low) / 2 == pytest.approx(half, rel=1e-3)  # t from the table has 4 figures
    # a missing value: that seed is left out at that checkpoint only
    holed = paired_curve([GRPO[0], [0.0, None, 0.1, 0.4]], [AMIR[0], AMIR[1]])
    assert [d.seeds for d in holed] == [2, 1, 2, 2]
    with pytest.raises(ValueError, match="different lengths"):
        paired_curve([[0.1, 0.2]], [[0.1]])


def test_the_area_is_the_trapezoid_rule_and_its_interval_is_paired_over_the_seeds():
    # seed 0's difference curve 0, 0.1, 0.2, 0.4 over steps 0, 5, 10, 20: 5 x 0.05 + 5 x 0.15 + 10 x 0.3 = 4.0
    assert trapezoid_area(STEPS, [a - g for g, a in zip(GRPO[0], AMIR[0])]) == pytest.approx(4.0)
    assert trapezoid_area(STEPS, [0.0, 0.1, 0.2, 0.4], average=True) == pytest.approx(0.2)
    assert math.isnan(trapezoid_area(STEPS, [0.0, None, 0.2, 0.4])) and math.isnan(trapezoid_area([3], [1.0]))
    hand = []
    for g, a in zip(GRPO, AMIR):
        d = [y - x for x, y in zip(g, a)]
        hand.append(sum((STEPS[k + 1] - STEPS[k]) * (d[k] + d[k + 1]) / 2 for k in range(len(STEPS) - 1)))
    area = paired_area(STEPS, GRPO, AMIR)
    mean, half = by_hand(hand)
    assert area.seeds == 4 and area.mean == pytest.approx(mean) and (area.low + area.high) / 2 == pytest.approx(mean)
    assert (area.high - area.low) / 2 == pytest.approx(half, rel=1e-3)
    averaged = paired_area(STEPS, GRPO, AMIR, average=True)  # over the 20 steps spanned
    assert averaged.mean == pytest.approx(mean / 20)
    assert (averaged.high - averaged.low) / 2 == pytest.approx(half / 20, rel=1e-3)
    with pytest.raises(ValueError, match="not increasing"):
        trapezoid_area([0, 5, 5], [1.0, 2.0, 3.0])


@pytest.mark.parametrize("differences", [[0.1, 0.3], [0.2, -0.1, 0.4], [0.1, 0.05, -0.2, 0.3, 0.0, 0.25, 0.1, -0.05]])
def test_the_detectable_difference_is_the_textbook_formula(differences):
    n = len(differences)
    mean = sum(differences) / n
    sd = (sum((d - mean) ** 2 for d in differences) / (n - 1)) ** 0.5
    hand = (T_975[n - 1] + T_80[n - 1]) * sd / n ** 0.5
    d = paired_difference([0.0] * n, differences)
    assert d.sd == pytest.approx(sd)
    assert minimum_detectable_difference(sd, n) == pytest.approx(hand, rel=1e-3)
    assert detectable_difference(d) == pytest.approx(hand, rel=1e-3)
    # the approximation's exact power (noncentral t): 0.8 at 8 seeds, a little less at 2 or 3 (0.73, 0.77)
    assert paired_t_power(hand, sd, n) == pytest.approx({2: 0.731, 3: 0.766, 8: 0.798}[n], abs=2e-3)
    exact = exact_detectable_difference(sd, n)
    assert exact >= hand * 0.999 and paired_t_power(exact, sd, n) == pytest.approx(0.8, abs=1e-9)
    assert paired_t_power(0.0, sd, n) == pytest.approx(0.05, abs=1e-9)  # no difference: the test's level
    assert math.isnan(minimum_detectable_difference(sd, 1))
    assert math.isnan(detectable_difference(paired_difference([0.0], [0.1])))


def test_a_runs_band_is_the_t_interval_of_its_mean():
    from amir_verl.study.statistics import mean_interval

    values = [0.2, 0.5, None, 0.4, 0.9]  # the missing value is left out
    mean, half = by_hand([0.2, 0.5, 0.4, 0.9])
    center, low, high = mean_interval(values)
    assert center == pytest.approx(mean) and (low, high) == pytest.approx((mean - half, mean + half), abs=1e-3)
    assert math.isnan(mean_interval([0.3])[1])


def test_the_study_task_is_probed_on_its_own_rows_from_its_own_starting_model(toy, tmp_path):
    """score_demo_pair with the copy task's validation rows, its grading and a starting model outside the workdir."""
    from amir_verl.study import toy_setting

    rows = toy_setting.validation_rows()[:5]
    (tmp_path / "seed_0" / "grpo").mkdir(parents=True)  # a run that saved no checkpoint
    scores = probes.score_demo_pair(tmp_path / "seed_0", runs=["grpo"], probe_rows=rows,
                                    initial_model=toy["model_dir"], grade=toy_setting.compute_score)
    probe_set = probes.ProbeSet.load(tmp_path / "seed_0" / probes.PROBE_FILE)
    assert [p.prompt for p in probe_set.prompts] == [f"{toy_setting.tag(k)} te: copy {k}" for k in range(5)]
    assert [[r.text for r in p.responses if r.correct] for p in probe_set.prompts] == [[str(k)] for k in range(5)]
    assert list(scores["grpo"]) == [0]  # no checkpoint: the starting model only
    assert_scores_match(scores["grpo"][0], plain_scores(toy["model"], probe_set))
