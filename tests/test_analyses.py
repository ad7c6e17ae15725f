"""amir-eval analyses on synthetic dumps with known answers; log-prob analyses with a tiny local model."""

import json
import math

import pandas as pd
import pytest
import torch

from amir_verl.cpu.toy_task import make_assets
from amir_verl.evaluation import analyses
from amir_verl.evaluation.cli import main
from amir_verl.evaluation.passk import EvaluationError, Sample


def dump(path, rows):
    """A verl validation dump as amir-verl's reward fills it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, (problem, source, correct, confidence, prompt, response) in enumerate(rows):
        lines.append(json.dumps({"input": prompt, "output": response, "gts": "", "score": float(correct), "step": 5,
                                 "acc": float(correct), "data_source": source, "problem_id": problem,
                                 "confidence": confidence, "uid": f"{problem}x_{i}_0"}))
    path.write_text("\n".join(lines) + "\n")


def test_calibration_by_hand(tmp_path, capsys):
    rows = [("p1", "openai/gsm8k", True, 0.9, "q", "a"), ("p1", "openai/gsm8k", False, 0.9, "q", "b"),
            ("p2", "openai/gsm8k", True, 0.15, "q", "c"), ("p2", "openai/gsm8k", False, -1.0, "q", "d")]
    dump(tmp_path / "run" / "5.jsonl", rows)
    assert main(["calibration", "--run", f"AMIR={tmp_path / 'run'}", "--out", str(tmp_path / "out")]) == 0
    brier = ((1 - 0.9) ** 2 + (0 - 0.9) ** 2 + (1 - 0.15) ** 2) / 3
    ece = 2 / 3 * abs(0.5 - 0.9) + 1 / 3 * abs(1.0 - 0.15)
    out = capsys.readouterr().out
    assert f"Brier {brier:.4f}" in out and f"ECE {ece:.4f}" in out and "without confidence: 1" in out
    table = pd.read_csv(tmp_path / "out" / "calibration.csv")
    assert table["count"].sum() == 3 and (tmp_path / "out" / "calibration.png").stat().st_size > 1000


def test_lengths_by_hand(tmp_path):
    rows = [("p1", "openai/gsm8k", True, 0.5, "q", "one two"), ("p1", "openai/gsm8k", False, 0.5, "q", "a b c d e f"),
            ("p2", "openai/gsm8k", False, 0.5, "q", "a b c d")]
    dump(tmp_path / "run.jsonl", rows)
    assert main(["lengths", "--run", f"X={tmp_path / 'run.jsonl'}", "--out", str(tmp_path / "out")]) == 0
    table = pd.read_csv(tmp_path / "out" / "lengths.csv")
    assert table.set_index("correct").loc[False, "mean"] == 5.0 and table.set_index("correct").loc[True, "mean"] == 2.0
    assert (tmp_path / "out" / "lengths.png").exists()


def test_coverage_table2_by_hand(tmp_path):
    def run(name, solved):
        rows = [(p, "math-ai/aime25", p in solved, 0.5, "q", "r") for p in ("a", "b", "c", "d") for _ in range(2)]
        dump(tmp_path / f"{name}.jsonl", rows)
        return f"{name}={tmp_path / f'{name}.jsonl'}"

    args = ["coverage", "--run", run("base", {"a"}), "--run", run("GRPO", {"a", "b"}), "--run", run("AMIR", {"a", "c"}),
            "--out", str(tmp_path / "out")]
    assert main(args) == 0
    row = pd.read_csv(tmp_path / "out" / "coverage.csv").iloc[0]
    assert (row["problems"], row["solvable_base"], row["solvable_GRPO"], row["solvable_AMIR"]) == (4, 1, 2, 2)
    assert (row["solvable_all"], row["solvable_none"], row["only_AMIR"], row["only_GRPO"]) == (1, 1, 1, 1)
    assert (tmp_path / "out" / "coverage.png").exists()
    patterns = pd.read_csv(tmp_path / "out" / "coverage_patterns.csv").set_index("pattern")["problems"]
    # solvable by some run: a (all), b (GRPO only), c (AMIR only)
    assert (patterns["YYY"], patterns["NYN"], patterns["NNY"], patterns["NNN"]) == (1, 1, 1, 0)
    assert patterns.sum() == 3


def test_coverage_refuses_runs_over_different_problems():
    a = [Sample("p1", "s", True)]
    b = [Sample("p2", "s", True)]
    with pytest.raises(EvaluationError, match="do not cover the same problems"):
        analyses.coverage({"a": a, "b": b})


@pytest.fixture(scope="module")
def toy_model(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("toy"), n_train=2, n_test=2)["model"]


def test_margin_and_perplexity_match_a_direct_forward(toy_model, tmp_path, capsys):
    model, tokenizer = analyses.load_model(toy_model)
    rows = [("p1", "openai/gsm8k", True, 0.5, "q1: 3+4=?\nA: ", "7"), ("p1", "openai/gsm8k", False, 0.5,
            "q1: 3+4=?\nA: ", "12"), ("p2", "openai/gsm8k", True, 0.5, "q2: 1+1=?\nA: ", "2")]
    dump(tmp_path / "run.jsonl", rows)

    def direct(prompt, response):
        ids = tokenizer(prompt + response)["input_ids"]
        n = len(tokenizer(prompt)["input_ids"])
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
        return float(sum(lp[t - 1, ids[t]] for t in range(n, len(ids))) / (len(ids) - n))

    assert main(["margin", "--run", f"AMIR={tmp_path / 'run.jsonl'}", "--model", toy_model,
                 "--out", str(tmp_path / "m")]) == 0
    margin = pd.read_csv(tmp_path / "m" / "margin.csv")
    assert list(margin["problem_id"]) == ["p1"]  # p2 has no incorrect response
    expected = direct("q1: 3+4=?\nA: ", "7") - direct("q1: 3+4=?\nA: ", "12")
    assert margin["margin"].iloc[0] == pytest.approx(expected, abs=1e-5)

    assert main(["perplexity", "--run", f"AMIR={tmp_path / 'run.jsonl'}", "--model", toy_model,
                 "--out", str(tmp_path / "p")]) == 0
    ppl = pd.read_csv(tmp_path / "p" / "perplexity.csv")
    assert list(ppl["stratum"]) == ["mixed", "mixed", "all correct"]
    assert ppl["perplexity"].iloc[2] == pytest.approx(math.exp(-direct("q2: 1+1=?\nA: ", "2")), rel=1e-5)
    assert (tmp_path / "m" / "margin.png").exists() and (tmp_path / "p" / "perplexity.png").exists()


def test_synthetic_example_runs_every_command(tmp_path):
    """examples/synthetic_eval.py (the source of docs/eval_examples) keeps working."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "synthetic_eval.py"
    out = subprocess.run([sys.executable, str(script), "--out", str(tmp_path)], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    for name in ("calibration", "lengths", "coverage", "margin", "perplexity"):
        assert (tmp_path / f"{name}.png").stat().st_size > 1000 and (tmp_path / f"{name}.csv").exists()
    assert "| AIME 2025 |" in (tmp_path / "table1.md").read_text()
