"""amir-eval: the pass@k estimator against exact enumeration, and the CLI on synthetic dumps."""

import itertools
import json
import math
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from amir_verl.evaluation.cli import main
from amir_verl.evaluation.passk import EvaluationError, Sample, benchmark_pass_at_k, pass_at_k


@given(st.integers(1, 9).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_equals_exact_enumeration_of_k_subsets(nck):
    n, c, k = nck
    outcomes = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    exact = sum(any(outcomes[i] for i in subset) for subset in subsets) / len(subsets)
    assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


@pytest.mark.parametrize("n,c,k", [(0, 0, 1), (4, 5, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_fewer_samples_than_k_names_the_problem():
    samples = [Sample("p1", "openai/gsm8k", True)] * 4 + [Sample("p2", "openai/gsm8k", False)] * 2
    with pytest.raises(EvaluationError, match=r"problem 'p2' of openai/gsm8k has 2 sample\(s\), fewer than k=4"):
        benchmark_pass_at_k(samples, [1, 4])


def write_verl_dump(folder, step, outcomes_by_problem, source="openai/gsm8k"):
    """A verl validation dump (``<step>.jsonl``) as amir-verl's reward fills it."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for problem, outcomes in outcomes_by_problem.items():
        for session, correct in enumerate(outcomes):
            lines.append(json.dumps({
                "input": f"question {problem}", "output": f"<answer>{int(correct)}</answer>", "gts": "1",
                "score": float(correct), "step": step, "acc": float(correct), "pred": str(int(correct)),
                "data_source": source, "problem_id": problem, "confidence": 0.5,
                "uid": f"{problem}uuid_{session}_0",
            }))
    (folder / f"{step}.jsonl").write_text("\n".join(lines) + "\n")


def test_cli_table1_on_synthetic_dumps(tmp_path, capsys):
    # base: p1 1/4 correct, p2 0/4; other: p1 3/4, p2 1/4 (GSM8K); AIME: base 0/4, other 4/4
    write_verl_dump(tmp_path / "grpo", 50, {"p1": [1, 0, 0, 0], "p2": [0, 0, 0, 0]})
    write_verl_dump(tmp_path / "grpo", 10, {"p1": [0, 0, 0, 0], "p2": [0, 0, 0, 0]})  # older step: ignored
    write_verl_dump(tmp_path / "amir", 50, {"p1": [1, 1, 1, 0], "p2": [0, 0, 1, 0]})
    aime_base, aime_amir = tmp_path / "grpo_aime.jsonl", tmp_path / "amir_aime.jsonl"
    write_verl_dump(tmp_path / "a", 1, {"q1": [0, 0, 0, 0]}, source="math-ai/aime25")
    write_verl_dump(tmp_path / "b", 1, {"q1": [1, 1, 1, 1]}, source="math-ai/aime25")
    for run in ("grpo", "amir"):
        lines = (tmp_path / run / "50.jsonl").read_text()
        extra = (tmp_path / ("a" if run == "grpo" else "b") / "1.jsonl").read_text()
        (aime_base if run == "grpo" else aime_amir).write_text(lines + extra)

    assert main(["passk", "--base", f"GRPO={aime_base}", "--other", f"AMIR={aime_amir}", "--k", "1", "2", "4",
                 "--out", str(tmp_path / "table1")]) == 0
    out = capsys.readouterr().out
    base_p1 = [pass_at_k(4, 1, k) for k in (1, 2, 4)]
    other_p1 = [pass_at_k(4, 3, k) for k in (1, 2, 4)]
    other_p2 = [pass_at_k(4, 1, k) for k in (1, 2, 4)]
    for i, k in enumerate((1, 2, 4)):
        b, o = 100 * base_p1[i] / 2, 100 * (other_p1[i] + other_p2[i]) / 2
        assert f"{b:.1f} -> {o:.1f} ({o - b:+.1f})" in out
    assert "| AIME 2025 | 0.0 -> 100.0 (+100.0)" in out
    csv_lines = (tmp_path / "table1.csv").read_text().splitlines()
    assert csv_lines[0] == "benchmark,k,GRPO_pass_at_k_pct,AMIR_pass_at_k_pct,gain_pts" and len(csv_lines) == 1 + 2 * 3
    assert (tmp_path / "table1.md").read_text().startswith("| Benchmark (GRPO -> AMIR)")

    # a dump folder uses its latest step
    assert main(["passk", "--base", f"GRPO={tmp_path / 'grpo'}", "--k", "1"]) == 0
    assert f"| GSM8K | {100 * pass_at_k(4, 1, 1) / 2:.1f} |" in capsys.readouterr().out


@pytest.mark.parametrize(
    "lines,message",
    [
        ([{"problem_id": "p", "data_source": "s", "response": "r"}], r"missing field\(s\) \['correct'\]"),
        ([{"problem_id": "p", "data_source": "s", "response": "r", "correct": 1, "sample_id": 0}] * 2,
         r"duplicate sample id \('p', 0\) \(first at line 1\)"),
        ([{"problem_id": "p", "data_source": "s", "response": "r", "correct": "yes"}], "correctness must be"),
        ([{"input": "q", "output": "o", "score": 1.0}], "without 'acc'"),
    ],
)
def test_bad_input_names_the_problem(tmp_path, capsys, lines, message):
    path = tmp_path / "samples.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines))
    assert main(["passk", "--base", f"X={path}", "--k", "1"]) == 2
    assert __import__("re").search(message, capsys.readouterr().err)


def test_problem_ids_are_per_benchmark(tmp_path, capsys):
    path = tmp_path / "s.jsonl"
    path.write_text("\n".join(json.dumps({"problem_id": "0", "data_source": src, "response": "r", "correct": ok})
                               for src, ok in (("openai/gsm8k", True), ("math-ai/aime25", False))))
    assert main(["passk", "--base", f"X={path}", "--k", "1"]) == 0
    out = capsys.readouterr().out
    assert "| GSM8K | 100.0 |" in out and "| math-ai/aime25 | 0.0 |" not in out and "| AIME 2025 | 0.0 |" in out


def test_console_script_is_installed(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps({"problem_id": "p", "data_source": "openai/gsm8k", "response": "r", "correct": True}))
    out = subprocess.run([sys.executable, "-m", "amir_verl.evaluation.cli", "passk", "--base", f"X={path}", "--k", "1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "| GSM8K | 100.0 |" in out.stdout
