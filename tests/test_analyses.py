"""amir-eval analyses on dumps written by verl's own ``_write_generations``, against hand-computed
numbers; every analysis compares several runs in one figure; log-prob analyses with a tiny local model."""

import math

import pandas as pd
import pytest
import torch

from amir_verl.demo.toy_task import make_assets
from amir_verl.evaluation import analyses
from amir_verl.evaluation.cli import main
from amir_verl.evaluation.passk import NOTHING_TO_MEASURE, Sample
from tests.support import verl_dump


def dump(folder, rows, step=5):
    """A verl validation dump as amir-verl's reward fills it; rows: (problem, source, correct, confidence,
    prompt, response), one single-output session each."""
    return verl_dump(folder, step, [
        {"input": prompt, "output": response, "score": float(correct), "acc": float(correct), "data_source": source,
         "problem_id": problem, "confidence": confidence, "uid": f"{problem}x_{i}_0",
         "brier": 1.0 if confidence < 0 else (correct - confidence) ** 2}  # the reward's rule
        for i, (problem, source, correct, confidence, prompt, response) in enumerate(rows)])


def test_calibration_of_two_runs_by_hand(tmp_path, capsys):
    gsm = "openai/gsm8k"
    a = dump(tmp_path / "a", [("p1", gsm, True, 0.9, "q", "a"), ("p1", gsm, False, 0.9, "q", "b"),
                              ("p2", gsm, True, 0.15, "q", "c"), ("p2", gsm, False, -1.0, "q", "d")])
    b = dump(tmp_path / "b", [("p1", gsm, True, 0.55, "q", "a"), ("p1", gsm, True, 0.55, "q", "b"),
                              ("p2", gsm, False, 0.05, "q", "c"), ("p2", gsm, False, 0.05, "q", "d")])
    out = tmp_path / "out"
    assert main(["calibration", "--run", f"GRPO={a}", "--run", f"AMIR={b}", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    stated_sq = (1 - 0.9) ** 2 + (0 - 0.9) ** 2 + (1 - 0.15) ** 2
    ece_a = 2 / 3 * abs(0.5 - 0.9) + 1 / 3 * abs(1.0 - 0.15)
    assert (f"GRPO: Brier (stated) {stated_sq / 3:.4f} over 3  Brier (missing as 1) {(stated_sq + 1) / 4:.4f} over 4  "
            f"ECE {ece_a:.4f}  without confidence: 1") in text
    b_sq = 2 * 0.45 ** 2 + 2 * 0.05 ** 2
    assert f"AMIR: Brier (stated) {b_sq / 4:.4f} over 4  Brier (missing as 1) {b_sq / 4:.4f} over 4" in text
    assert "counts a response without one as 1, as amir-verl's reward logs brier" in text
    # the reward's own per-response brier (in the dump) averages to the "missing as 1" definition
    assert pd.read_json(a, lines=True)["brier"].mean() == pytest.approx((stated_sq + 1) / 4)
    table = pd.read_csv(out / "calibration_GRPO_vs_AMIR.csv")
    counts = table.pivot(index="bin_lo", columns="run", values="count")
    assert counts["GRPO"].tolist() == [0, 1, 0, 0, 0, 0, 0, 0, 0, 2] and counts["AMIR"].sum() == 4
    assert counts["AMIR"][0.0] == 2 and counts["AMIR"][0.5] == 2
    assert table[table["count"] == 0]["accuracy"].isna().all()  # an empty bin has no accuracy, not 0
    assert (out / "calibration_GRPO_vs_AMIR.png").stat().st_size > 10_000


def test_calibration_needs_a_bin_and_a_stated_confidence(tmp_path, capsys):
    path = dump(tmp_path / "a", [("p1", "openai/gsm8k", True, -1.0, "q", "a")])
    assert main(["calibration", "--run", f"A={path}", "--out", str(tmp_path / "o"), "--bins", "0"]) == 2
    assert "--bins must be at least 1, got 0" in capsys.readouterr().err
    assert main(["calibration", "--run", f"A={path}", "--out", str(tmp_path / "o")]) == NOTHING_TO_MEASURE
    assert "amir-eval: nothing to measure: no sample states a confidence" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_lengths_of_two_runs_by_hand(tmp_path):
    gsm, aime = "openai/gsm8k", "math-ai/aime25"
    a = dump(tmp_path / "a", [("p1", gsm, True, 0.5, "q", "one two"), ("p1", gsm, False, 0.5, "q", "a b c d e f"),
                              ("p2", gsm, False, 0.5, "q", "a b c d"), ("q1", aime, False, 0.5, "q", "x")])
    b = dump(tmp_path / "b", [("p1", gsm, False, 0.5, "q", "a b"), ("p2", gsm, True, 0.5, "q", "a b c"),
                              ("q1", aime, False, 0.5, "q", "x y z")])
    assert main(["lengths", "--run", f"GRPO={a}", "--run", f"AMIR={b}", "--out", str(tmp_path / "out")]) == 0
    table = pd.read_csv(tmp_path / "out" / "lengths_GRPO_vs_AMIR.csv").set_index(["run", "benchmark", "correct"])
    assert table.loc[("GRPO", "GSM8K", False), "mean"] == 5.0 and table.loc[("GRPO", "GSM8K", True), "mean"] == 2.0
    assert table.loc[("AMIR", "GSM8K", False), "mean"] == 2.0 and table.loc[("AMIR", "AIME 2025", False), "mean"] == 3.0
    assert (tmp_path / "out" / "lengths_GRPO_vs_AMIR.png").stat().st_size > 10_000


def coverage_run(tmp_path, name, solved, problems=("a", "b", "c", "d")):
    rows = [(p, "math-ai/aime25", p in solved, 0.5, "q", "r") for p in problems for _ in range(2)]
    return f"{name}={dump(tmp_path / name, rows)}"


def test_coverage_table2_by_hand(tmp_path, capsys):
    out = tmp_path / "out"
    args = ["coverage", "--run", coverage_run(tmp_path, "base", {"a"}), "--run",
            coverage_run(tmp_path, "GRPO", {"a", "b"}), "--run", coverage_run(tmp_path, "AMIR", {"a", "c"}),
            "--out", str(out)]
    assert main(args) == 0
    row = pd.read_csv(out / "coverage_base_vs_GRPO_vs_AMIR.csv").iloc[0]
    assert (row["problems"], row["solvable_base"], row["solvable_GRPO"], row["solvable_AMIR"]) == (4, 1, 2, 2)
    assert (row["solvable_all"], row["solvable_none"], row["only_AMIR"], row["only_GRPO"]) == (1, 1, 1, 1)
    patterns = pd.read_csv(out / "coverage_base_vs_GRPO_vs_AMIR_patterns.csv").set_index("pattern")
    # solvable by some run: a (all), b (GRPO only), c (AMIR only); the paper's order, NNN left out
    assert list(patterns.index) == ["YYY", "YYN", "YNY", "YNN", "NYY", "NYN", "NNY"]
    assert patterns["problems"].to_dict() == {"YYY": 1, "YYN": 0, "YNY": 0, "YNN": 0, "NYY": 0, "NYN": 1, "NNY": 1}
    assert patterns["percent_of_solvable"]["YYY"] == pytest.approx(100 / 3)
    assert (out / "coverage_base_vs_GRPO_vs_AMIR.png").stat().st_size > 10_000
    capsys.readouterr()
    assert main(args) == 2  # a second run to the same --out is refused, not overwritten
    assert "exist(s); --overwrite replaces" in capsys.readouterr().err


def test_coverage_over_shared_problems_names_what_is_left_out(tmp_path, capsys):
    base = coverage_run(tmp_path, "base", {"a", "e"}, problems=("a", "b", "c", "d", "e"))
    args = ["coverage", "--run", base, "--run", coverage_run(tmp_path, "AMIR", {"b"}), "--out", str(tmp_path / "o")]
    assert main(args) == 0
    assert "AIME 2025: 1 of 5 problem(s) not in every run (1 lacked by AMIR)" in capsys.readouterr().out
    patterns = pd.read_csv(tmp_path / "o" / "coverage_base_vs_AMIR_patterns.csv").set_index("pattern")["problems"]
    assert patterns.to_dict() == {"YY": 0, "YN": 1, "NY": 1}  # e left out
    assert main(args + ["--all-problems", "--overwrite"]) == 0
    patterns = pd.read_csv(tmp_path / "o" / "coverage_base_vs_AMIR_patterns.csv").set_index("pattern")["problems"]
    assert patterns.to_dict() == {"YY": 0, "YN": 2, "NY": 1}  # e kept: AMIR lacks it, so has not solved it


def test_preference_margin_and_pair_accuracy_against_every_pair_by_hand():
    """Two problems with both outcomes, one with one only, one NaN score (an empty response, left out)."""
    samples = [Sample("1", "s", True), Sample("1", "s", True), Sample("1", "s", False), Sample("1", "s", False),
               Sample("2", "s", True), Sample("2", "s", False), Sample("2", "s", False),
               Sample("3", "s", True), Sample("3", "s", True)]
    scores = [-1.0, -3.0, -2.0, -4.0, -0.5, -0.2, math.nan, -1.0, -1.0]
    table, summary = analyses.preference_margin(samples, scores)
    by_problem = table.set_index("problem_id")
    # problem 1: pairs (-1,-2) (-1,-4) (-3,-2) (-3,-4): 3 of 4 right; margin -2 - (-3) = 1
    # problem 2: the NaN is left out, one pair (-0.5, -0.2): wrong; margin -0.3
    assert list(by_problem.index) == ["1", "2"]
    assert by_problem.loc["1", "pair_accuracy"] == 0.75 and by_problem.loc["1", "margin"] == pytest.approx(1.0)
    assert by_problem.loc["2", "pair_accuracy"] == 0.0 and by_problem.loc["2", "margin"] == pytest.approx(-0.3)
    assert summary == {"problems_with_both": 2, "mean_margin": pytest.approx(0.35), "mean_pair_accuracy": 0.375}


def test_problem_strata_span_all_runs():
    runs = {"A": [Sample("1", "s", True), Sample("1", "s", True), Sample("2", "s", False), Sample("3", "s", True)],
            "B": [Sample("1", "s", True), Sample("2", "s", False), Sample("3", "s", False)]}
    assert analyses.problem_strata(runs) == {("s", "1"): "all correct in every run",
                                             ("s", "2"): "none correct in any run", ("s", "3"): "mixed"}


@pytest.fixture(scope="module")
def toy_model(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("toy"), n_train=2, n_test=2)["model"]


def test_margin_and_perplexity_match_a_direct_forward(toy_model, tmp_path, capsys):
    model, tokenizer = analyses.load_model(toy_model)
    gsm, q1, q2 = "openai/gsm8k", "q1: 3+4=?\nA: ", "q2: 1+1=?\nA: "
    a = dump(tmp_path / "a", [("p1", gsm, True, 0.5, q1, "7"), ("p1", gsm, False, 0.5, q1, "12"),
                              ("p2", gsm, True, 0.5, q2, "2")])
    b = dump(tmp_path / "b", [("p1", gsm, True, 0.5, q1, "7"), ("p1", gsm, False, 0.5, q1, "9"),
                              ("p2", gsm, True, 0.5, q2, "2")])

    def direct(prompt, response):
        ids = tokenizer(prompt + response)["input_ids"]
        n = len(tokenizer(prompt)["input_ids"])
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
        return float(sum(lp[t - 1, ids[t]] for t in range(n, len(ids))) / (len(ids) - n))

    runs = ["--run", f"GRPO={a}", "--run", f"AMIR={b}"]
    assert main(["margin", *runs, "--model", f"GRPO={toy_model}", "--out", str(tmp_path / "m")]) == 2
    assert "no model for ['AMIR']" in capsys.readouterr().err
    assert main(["margin", *runs, "--model", f"GRPO={toy_model}", "--model", f"AMIR={toy_model}",
                 "--out", str(tmp_path / "m")]) == 0
    margin = pd.read_csv(tmp_path / "m" / "margin_GRPO_vs_AMIR.csv").set_index("run")
    assert list(margin["problem_id"]) == ["p1", "p1"]  # p2 has no incorrect response
    assert margin.loc["GRPO", "margin"] == pytest.approx(direct(q1, "7") - direct(q1, "12"), abs=1e-5)
    assert margin.loc["AMIR", "margin"] == pytest.approx(direct(q1, "7") - direct(q1, "9"), abs=1e-5)
    for run, wrong in (("GRPO", "12"), ("AMIR", "9")):  # one pair per run: ranked right when the margin is > 0
        assert margin.loc[run, "pair_accuracy"] == float(direct(q1, "7") > direct(q1, wrong))
    text = capsys.readouterr().out
    amir_margin = direct(q1, '7') - direct(q1, '9')
    assert (f"AMIR: mean preference margin {amir_margin:.4f}, pair accuracy {float(amir_margin > 0):.3f}, "
            "over 1 problems") in text

    assert main(["perplexity", *runs, "--model", f"GRPO={toy_model}", "--model", f"AMIR={toy_model}",
                 "--out", str(tmp_path / "p")]) == 0
    ppl = pd.read_csv(tmp_path / "p" / "perplexity_GRPO_vs_AMIR.csv")
    assert list(ppl["stratum"]) == ["mixed", "mixed", "all correct in every run"] * 2
    assert ppl["perplexity"].iloc[2] == pytest.approx(math.exp(-direct(q2, "2")), rel=1e-5)
    assert ppl["perplexity"].iloc[4] == pytest.approx(math.exp(-direct(q1, "9")), rel=1e-5)
    for png in (tmp_path / "m" / "margin_GRPO_vs_AMIR.png", tmp_path / "p" / "perplexity_GRPO_vs_AMIR.png"):
        assert png.stat().st_size > 10_000


@pytest.mark.parametrize("command", ["margin", "perplexity"])
def test_a_log_prob_analysis_with_nothing_to_measure_exits_3_and_writes_nothing(toy_model, tmp_path, capsys, command):
    """margin: every problem all correct or all incorrect; perplexity: every response empty. Both are outcomes
    of the data: exit 3 (not 2, bad input), the reason, and no file (not even a header-only CSV)."""
    gsm, q1 = "openai/gsm8k", "q1: 3+4=?\nA: "
    responses = ("", "") if command == "perplexity" else ("7", "12")
    a = dump(tmp_path / "a", [("p1", gsm, True, 0.5, q1, responses[0]), ("p2", gsm, False, 0.5, q1, responses[1])])
    b = dump(tmp_path / "b", [("p1", gsm, True, 0.5, q1, responses[0]), ("p2", gsm, False, 0.5, q1, responses[1])])
    out = tmp_path / "out"
    assert main([command, "--run", f"GRPO={a}", "--run", f"AMIR={b}", "--model", f"GRPO={toy_model}",
                 "--model", f"AMIR={toy_model}", "--out", str(out)]) == NOTHING_TO_MEASURE
    reason = {"margin": "no problem has both a correct and an incorrect response in any run",
              "perplexity": "no response was scored (every response is empty)"}[command]
    assert f"amir-eval: nothing to measure: {reason}" in capsys.readouterr().err
    assert not out.exists()


def test_perplexity_after_margin_reuses_the_cached_scores_of_the_same_model_and_text_only(toy_model, tmp_path, capsys):
    import shutil

    gsm, q1 = "openai/gsm8k", "q1: 3+4=?\nA: "
    a = dump(tmp_path / "a", [("p1", gsm, True, 0.5, q1, "7"), ("p1", gsm, False, 0.5, q1, "12"), ("p2", gsm, True, 0.5, q1, "")])
    b = dump(tmp_path / "b", [("p1", gsm, True, 0.5, q1, "7"), ("p1", gsm, False, 0.5, q1, "9"), ("p2", gsm, True, 0.5, q1, "")])
    other = tmp_path / "other_model"
    shutil.copytree(toy_model, other)
    runs = ["--run", f"GRPO={a}", "--run", f"AMIR={b}", "--model", f"GRPO={toy_model}", "--model", f"AMIR={other}"]
    cache = ["--score-cache", str(tmp_path / "cache")]
    for command in ("margin", "perplexity"):
        assert main([command, *runs, "--out", str(tmp_path / "plain")]) == 0
    capsys.readouterr()
    assert main(["margin", *runs, *cache, "--out", str(tmp_path / "cached")]) == 0
    assert "GRPO: 0 of 3 scores from" in capsys.readouterr().out
    assert main(["perplexity", *runs, *cache, "--out", str(tmp_path / "cached")]) == 0
    out = capsys.readouterr().out
    assert "GRPO: 3 of 3 scores from" in out and "AMIR: 3 of 3 scores from" in out
    for name in ("margin_GRPO_vs_AMIR.csv", "perplexity_GRPO_vs_AMIR.csv"):
        pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "cached" / name), pd.read_csv(tmp_path / "plain" / name))
    # another model content (a weight changed), the same path: scored again, not reused by name
    from safetensors.torch import load_file, save_file

    weights = load_file(str(other / "model.safetensors"))
    first = next(iter(weights))
    weights[first] = weights[first] + 1.0
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    assert main(["margin", *runs, *cache, "--out", str(tmp_path / "changed")]) == 0
    out = capsys.readouterr().out
    assert "GRPO: 3 of 3 scores from" in out and "AMIR: 0 of 3 scores from" in out


def test_synthetic_example_runs_every_command(tmp_path):
    """examples/synthetic_eval.py (the source of docs/eval_examples) keeps working."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "synthetic_eval.py"
    out = subprocess.run([sys.executable, str(script), "--out", str(tmp_path)], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    for name in ("calibration_GRPO_vs_AMIR", "lengths_GRPO_vs_AMIR", "coverage_base_vs_GRPO_vs_AMIR",
                 "margin_GRPO_vs_AMIR", "perplexity_GRPO_vs_AMIR"):
        assert (tmp_path / f"{name}.png").stat().st_size > 10_000 and (tmp_path / f"{name}.csv").exists()
    assert "| AIME 2025 |" in (tmp_path / "passk_GRPO_vs_AMIR.md").read_text()
    assert "| AIME 2025 |" in (tmp_path / "passk_base_vs_GRPO_vs_AMIR.md").read_text()


def test_a_verl_merged_lora_folder_scores_as_the_trained_policy_not_its_base(toy_model, tmp_path):
    """verl's merger writes a LoRA run as base weights + ``lora_adapter/``; load_model must apply the adapter."""
    import shutil

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "merged"
    shutil.copytree(toy_model, folder)
    torch.manual_seed(0)
    trained = get_peft_model(AutoModelForCausalLM.from_pretrained(toy_model, dtype=torch.float32),
                             LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    for name, param in trained.named_parameters():
        if "lora_B" in name:
            param.data.normal_()  # a trained adapter: B != 0
    trained.save_pretrained(folder / analyses.VERL_MERGER_ADAPTER)
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    with torch.no_grad():
        expected = trained(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(toy_model, dtype=torch.float32)(input_ids=ids).logits
        model, _ = analyses.load_model(str(folder))
        got = model(input_ids=ids).logits
    assert not torch.allclose(expected, base, atol=1e-3)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_batched_scoring_equals_each_response_scored_alone(toy_model):
    """Left-padded batches of mixed prompt and response lengths, the last logits only: the same mean
    log-probs as an unpadded forward of each sequence; an empty response is NaN, a missing prompt an error."""
    model, tokenizer = analyses.load_model(toy_model)
    pairs = [("q1: 3+4=?\nA: ", "7"), ("q2: 10+10=?\nA: ", "20 is it"), ("q1: 3+4=?\nA: ", "12"),
             ("q33: 1+1=?\nA: ", ""), ("q4: 9+9=?\nA: ", "18"), ("q5: 2+2=?\nA: ", "4 4 4 4 4")]

    def alone(prompt, response):
        p, r = tokenizer(prompt, add_special_tokens=False)["input_ids"], tokenizer(response, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=torch.tensor([p + r])).logits[0].float(), -1)
        return float(sum(lp[len(p) + t - 1, r[t]] for t in range(len(r))) / len(r))

    for batch_size in (1, 3, 16):
        got = analyses.mean_response_log_probs(model, tokenizer, pairs, batch_size=batch_size)
        assert math.isnan(got[3])
        assert [g for i, g in enumerate(got) if i != 3] == pytest.approx(
            [alone(p, r) for i, (p, r) in enumerate(pairs) if i != 3], abs=1e-5)
    with pytest.raises(analyses.EvaluationError, match="no prompt text"):
        analyses.mean_response_log_probs(model, tokenizer, [("", "7")])
