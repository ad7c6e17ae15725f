"""amir-eval: the pass@k estimator against exact enumeration, and reading dumps written by verl's own
``_write_generations`` (V1 trainer): sessions, bad lines, unshared problems, dumps of another reward."""

import itertools
import json
import math
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from verl.protocol import DataProto
from verl.trainer.ppo.core_algos import AdvantageEstimator
from verl.trainer.ppo.v1.trainer_base import PPOTrainer
from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

from amir_verl.evaluation.cli import main
from amir_verl.evaluation.passk import EvaluationError, Sample, benchmark_pass_at_k, pass_at_k
from amir_verl.evaluation.records import final_session_outputs, load_run
from tests.seams import fingerprint
from tests.support import verl_dump


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


def graded(problem, outcomes, source="openai/gsm8k", prompt_uid=None, **fields):
    """amir-verl reward lines of one problem: one single-output session per outcome."""
    prompt_uid = prompt_uid or f"{problem}-uuid"
    return [{"input": f"question {problem}", "output": f"<answer>{int(ok)}</answer>", "score": float(ok),
             "acc": float(ok), "pred": str(int(ok)), "data_source": source, "problem_id": problem,
             "confidence": 0.5, "uid": f"{prompt_uid}_{session}_0", **fields} for session, ok in enumerate(outcomes)]


def write_verl_dump(folder, step, outcomes_by_problem, source="openai/gsm8k"):
    return verl_dump(folder, step, [line for problem, outcomes in outcomes_by_problem.items()
                                    for line in graded(problem, outcomes, source)])


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

    assert main(["passk", "--run", f"GRPO={aime_base}", "--run", f"AMIR={aime_amir}", "--k", "1", "2", "4",
                 "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    base_p1 = [pass_at_k(4, 1, k) for k in (1, 2, 4)]
    other_p1 = [pass_at_k(4, 3, k) for k in (1, 2, 4)]
    other_p2 = [pass_at_k(4, 1, k) for k in (1, 2, 4)]
    for i, k in enumerate((1, 2, 4)):
        b, o = 100 * base_p1[i] / 2, 100 * (other_p1[i] + other_p2[i]) / 2
        assert f"{b:.1f} -> {o:.1f} ({o - b:+.1f})" in out
    assert "| AIME 2025 | 0.0 -> 100.0 (+100.0)" in out and "note:" not in out
    csv_lines = (tmp_path / "out" / "passk_GRPO_vs_AMIR.csv").read_text().splitlines()
    assert csv_lines[0] == "benchmark,k,GRPO_pass_at_k_pct,AMIR_pass_at_k_pct,AMIR_gain_over_GRPO_pts"
    assert len(csv_lines) == 1 + 2 * 3 and csv_lines[-1] == "AIME 2025,4,0.0000,100.0000,+100.0000"
    assert (tmp_path / "out" / "passk_GRPO_vs_AMIR.md").read_text().startswith(
        "| Benchmark (GRPO -> AMIR) | pass@1 | pass@2 | pass@4 |\n|---|---|---|---|\n| GSM8K | ")

    # one run: its pass@k; a dump folder uses its latest step
    assert main(["passk", "--run", f"GRPO={tmp_path / 'grpo'}", "--k", "1", "--out", str(tmp_path / "one")]) == 0
    assert f"| GSM8K | {100 * pass_at_k(4, 1, 1) / 2:.1f} |" in capsys.readouterr().out
    assert (tmp_path / "one" / "passk_GRPO.csv").read_text().splitlines() == ["benchmark,k,GRPO_pass_at_k_pct",
                                                                           "GSM8K,1,12.5000"]
    assert (tmp_path / "one" / "passk_GRPO.md").read_text() == "| Benchmark (GRPO) | pass@1 |\n|---|---|\n| GSM8K | 12.5 |\n"


N4 = {k: math.comb(4, k) for k in (1, 2, 4)}  # C(4, k): the k-subsets of n = 4 samples


def test_three_runs_give_each_runs_pass_at_k_and_its_gain_over_the_first(tmp_path, capsys):
    # n = 4 samples per problem; correct counts c: GSM8K p1/p2 and AIME q1
    counts = {"base": ((1, 0), 0), "GRPO": ((2, 1), 1), "AMIR": ((4, 2), 3)}
    for run, ((p1, p2), q1) in counts.items():
        verl_dump(tmp_path / run, 9, graded("p1", [1] * p1 + [0] * (4 - p1)) + graded("p2", [1] * p2 + [0] * (4 - p2))
                  + graded("q1", [1] * q1 + [0] * (4 - q1), source="math-ai/aime25"))
    # by hand, 1 - C(4 - c, k) / C(4, k) in %: c=0 -> 0; c=1 -> 1 - 3/4, 1 - 3/6, 1 - 0/1; c=2 -> 1 - 2/4,
    # 1 - 1/6, 1; c=3 -> 1 - 1/4, 1 - 0/6, 1; c=4 -> 1. GSM8K is the mean over p1 and p2.
    gsm8k = {"base": (100 * (1 - 3 / N4[1]) / 2, 100 * (1 - 3 / N4[2]) / 2, 100 * (1 - 0 / N4[4]) / 2),
             "GRPO": (100 * ((1 - 2 / N4[1]) + (1 - 3 / N4[1])) / 2, 100 * ((1 - 1 / N4[2]) + (1 - 3 / N4[2])) / 2,
                      100.0),
             "AMIR": (100 * (1 + (1 - 2 / N4[1])) / 2, 100 * (1 + (1 - 1 / N4[2])) / 2, 100.0)}
    aime = {"base": (0.0, 0.0, 0.0), "GRPO": (100 * (1 - 3 / N4[1]), 100 * (1 - 3 / N4[2]), 100.0),
            "AMIR": (100 * (1 - 1 / N4[1]), 100.0, 100.0)}
    assert gsm8k["GRPO"][1] == pytest.approx(200 / 3) and gsm8k["AMIR"][1] == pytest.approx(275 / 3)

    runs = [f"{run}={tmp_path / run}" for run in counts]
    assert main(["passk", *[arg for run in runs for arg in ("--run", run)], "--k", "1", "2", "4",
                 "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert ("| Benchmark (gain over base, points) | base pass@1 | GRPO pass@1 | AMIR pass@1 | base pass@2 | GRPO pass@2 "
            "| AMIR pass@2 | base pass@4 | GRPO pass@4 | AMIR pass@4 |\n" + "|---" * 10 + "|\n") in out
    for name, figures in (("GSM8K", gsm8k), ("AIME 2025", aime)):
        cells = [f"{figures['base'][i]:.1f} | " + " | ".join(f"{figures[run][i]:.1f} ({figures[run][i] - figures['base'][i]:+.1f})"
                                                            for run in ("GRPO", "AMIR")) for i in range(3)]
        assert f"| {name} | " + " | ".join(cells) + " |\n" in out
    assert "| GSM8K | 12.5 | 37.5 (+25.0) | 75.0 (+62.5) | 25.0 | 66.7 (+41.7) | 91.7 (+66.7) | 50.0 | 100.0 (+50.0) " in out

    csv_lines = (tmp_path / "out" / "passk_base_vs_GRPO_vs_AMIR.csv").read_text().splitlines()
    assert csv_lines[0] == ("benchmark,k,base_pass_at_k_pct,GRPO_pass_at_k_pct,AMIR_pass_at_k_pct,"
                            "GRPO_gain_over_base_pts,AMIR_gain_over_base_pts")
    expected = [[name, str(k)] + [f"{figures[run][i]:.4f}" for run in counts]
                + [f"{figures[run][i] - figures['base'][i]:+.4f}" for run in ("GRPO", "AMIR")]
                for name, figures in (("GSM8K", gsm8k), ("AIME 2025", aime)) for i, k in enumerate((1, 2, 4))]
    assert csv_lines[1:] == [",".join(row) for row in expected]
    assert (tmp_path / "out" / "passk_base_vs_GRPO_vs_AMIR.md").read_text() == out[out.index("| Benchmark"):out.index("wrote")]


def test_passk_files_are_named_by_their_runs_and_never_overwritten_silently(tmp_path, capsys):
    write_verl_dump(tmp_path / "a", 1, {"p1": [1, 0]})
    write_verl_dump(tmp_path / "b", 1, {"p1": [1, 1]})
    out = tmp_path / "out"
    assert main(["passk", "--run", f"A={tmp_path / 'a'}", "--k", "1"]) == 0
    assert not out.exists()  # without --out the table is only printed
    pair = ["passk", "--run", f"A={tmp_path / 'a'}", "--run", f"B/x y={tmp_path / 'b'}", "--k", "1", "--out", str(out)]
    assert main(pair) == 0
    assert main(["passk", "--run", f"A={tmp_path / 'a'}", "--k", "1", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["passk_A.csv", "passk_A.md", "passk_A_vs_B-x-y.csv",
                                                      "passk_A_vs_B-x-y.md"]
    capsys.readouterr()
    assert main(pair[:-3] + ["2", "--out", str(out)]) == 2  # same runs, same folder: refused
    err = capsys.readouterr().err
    assert "passk_A_vs_B-x-y.csv" in err and "passk_A_vs_B-x-y.md" in err and "--overwrite" in err
    assert (out / "passk_A_vs_B-x-y.csv").read_text().splitlines()[1] == "GSM8K,1,50.0000,100.0000,+50.0000"
    assert main(pair[:-3] + ["2", "--out", str(out), "--overwrite"]) == 0
    assert (out / "passk_A_vs_B-x-y.csv").read_text().splitlines()[1:] == ["GSM8K,2,100.0000,100.0000,+0.0000"]
    assert (out / "passk_A.csv").read_text().splitlines()[1:] == ["GSM8K,1,50.0000"]


def test_passk_takes_runs_only_as_run(tmp_path, capsys):
    write_verl_dump(tmp_path / "a", 1, {"p1": [1, 0]})
    with pytest.raises(SystemExit) as exit_:
        main(["passk", "--base", f"A={tmp_path / 'a'}", "--k", "1"])
    assert exit_.value.code == 2 and "the following arguments are required: --run" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["passk", "--run", f"A={tmp_path / 'a'}", "--other", f"B={tmp_path / 'a'}"])
    assert "unrecognized arguments: --other" in capsys.readouterr().err
    assert main(["passk", "--run", f"A={tmp_path / 'a'}", "--run", f"A={tmp_path / 'a'}", "--k", "1"]) == 2
    assert "run names must differ" in capsys.readouterr().err


@pytest.mark.parametrize("ks,message", [(["0"], "k must be at least 1, got 0"), (["-2", "1"], "got -2"),
                                        (["1", "5"], r"has 4 sample\(s\), fewer than k=5")])
def test_k_outside_1_to_n_is_a_one_line_error(tmp_path, capsys, ks, message):
    write_verl_dump(tmp_path / "run", 1, {"p1": [1, 0, 0, 0]})
    assert main(["passk", "--run", f"X={tmp_path / 'run'}", "--k", *ks]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and err.count("\n") == 1 and "Traceback" not in err


def test_line_separators_inside_json_strings_are_not_line_breaks(tmp_path):
    response = "step 1\u2028step 2\u0085step 3\u2029\x0c\r end"
    path = verl_dump(tmp_path / "run", 3, graded("p1", [1, 0], output=response) +
                     [dict(line, output="ok") for line in graded("p2", [1, 1])])
    assert "\u2028" in path.read_text(encoding="utf-8")  # verl writes it raw (ensure_ascii=False)
    run = load_run(path)
    assert [s.response for s in run.samples] == [response, response, "ok", "ok"] and run.notes == []


def test_a_cut_off_or_malformed_line_is_named_and_skipped_only_on_request(tmp_path, capsys):
    path = verl_dump(tmp_path / "run", 3, graded("p1", [1, 0]) + graded("p2", [1, 1], output="Lösung ✓"))
    whole = path.read_bytes()
    path.write_bytes(whole[: whole.rindex("✓".encode()) + 1])  # cut inside the 3-byte character
    assert main(["passk", "--run", f"X={path}", "--k", "1"]) == 2
    err = capsys.readouterr().err
    assert f"{path}:4: not UTF-8" in err and err.count("\n") == 1
    assert main(["passk", "--run", f"X={path}", "--k", "1", "--skip-malformed"]) == 0
    out = capsys.readouterr().out
    assert "skipped 1 malformed line(s): 4" in out and "| GSM8K | 75.0 |" in out  # p1 1/2, p2 1/1

    lines = whole.decode().split("\n")
    path.write_text("\n".join(lines[:1] + ['{"input": "q", "output": '] + lines[1:]), encoding="utf-8")
    assert main(["passk", "--run", f"X={path}", "--k", "1"]) == 2
    assert f"{path}:2: not a JSON object" in capsys.readouterr().err
    path.write_text("[1, 2]\n", encoding="utf-8")
    assert main(["passk", "--run", f"X={path}", "--k", "1"]) == 2
    assert f"{path}:1: not a JSON object (a JSON list" in capsys.readouterr().err


def session_lines(problem, sessions):
    """A multi-output agent session per entry of ``sessions``: (outputs, final acc). verl's V1 dump gives
    every output of a session the final output's reward fields."""
    lines = []
    for session, (outputs, ok) in enumerate(sessions):
        for index, text in enumerate(outputs):
            line = graded(problem, [ok])[0]
            lines.append(dict(line, output=text, uid=f"{problem}-uuid_{session}_{index}"))
    return lines


def test_multi_output_sessions_count_once_by_their_final_output(tmp_path, capsys):
    # p1: 4 sessions, 2 correct, the first with three outputs; p2: 4 single-output sessions, 1 correct
    lines = session_lines("p1", [(["a", "b c", "d e f"], 1), (["x"], 0), (["y y", "z"], 1), (["w"], 0)])
    lines += session_lines("p2", [(["q"], 1), (["q"], 0), (["q"], 0), (["q"], 0)])
    path = verl_dump(tmp_path / "run", 7, lines)
    run = load_run(path)
    assert [s.response for s in run.samples if s.problem_id == "p1"] == ["d e f", "x", "z", "w"]
    assert len(run.samples) == 8 and "3 earlier output(s)" in run.notes[0]
    assert main(["passk", "--run", f"X={path}", "--k", "1", "2"]) == 0
    p1, p2 = pass_at_k(4, 2, 2), pass_at_k(4, 1, 2)
    assert f"| GSM8K | {100 * (2 / 4 + 1 / 4) / 2:.1f} | {100 * (p1 + p2) / 2:.1f} |" in capsys.readouterr().out


def test_session_rule_is_verls(tmp_path):
    """``final_session_outputs`` keeps the rows whose reward verl's GRPO advantage uses: each row's
    advantage from ``compute_advantage_for_multi_trajectories`` equals, by hand, the group-normalised
    reward of its session's row that ``final_session_outputs`` picks. Index 10 after 9 and a uid with
    underscores catch a string comparison or a wrong split."""
    keys = ["u_a_0_0", "u_a_0_9", "u_a_0_10", "u_a_1_0", "u_a_2_1", "u_a_2_0", "v_0_0", "v_1_1", "v_1_0", "v_2_0"]
    prompt = ["u_a"] * 6 + ["v"] * 4
    reward = [5.0, 7.0, 1.0, 0.0, 3.0, 9.0, 2.0, 4.0, 8.0, 1.0]
    length = 3
    data = DataProto.from_dict(
        tensors={"token_level_rewards": torch.tensor([[0.0] * (length - 1) + [r] for r in reward]),
                 "response_mask": torch.ones(len(keys), length)},
        non_tensors={"uid": np.array(prompt, dtype=object)})
    verl_adv = compute_advantage_for_multi_trajectories(data, keys, AdvantageEstimator.GRPO).batch["advantages"][:, 0]

    final = final_session_outputs(keys)
    assert final == [2, 3, 4, 6, 7, 9]
    session_of = lambda key: key.rsplit("_", 1)[0]  # noqa: E731
    expected = []
    for key in keys:
        row = next(i for i in final if session_of(keys[i]) == session_of(key))
        group = [reward[i] for i in final if prompt[i] == prompt[row]]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((g - mean) ** 2 for g in group) / (len(group) - 1))
        expected.append((reward[row] - mean) / (std + 1e-6))
    assert verl_adv.tolist() == pytest.approx(expected, abs=1e-5)


def test_verl_validation_dump_layout_is_pinned():
    """The session rule of verl's validation (final output per {uid}_{session}, inline in _validate), its
    copying of the final output's reward fields to every output, and the JSONL writer: amir-eval reads
    what these write. If verl changes them, re-read them against amir_verl/evaluation/records.py."""
    assert fingerprint(PPOTrainer._validate) == "f1d58a70e91d7883"
    assert fingerprint(PPOTrainer._write_generations) == "9dac31a75a9c687e"


def test_problems_one_run_lacks_are_left_out_and_named(tmp_path, capsys):
    # p1..p10: GRPO solves p1..p5 (2/4 each) -> 25.0; AMIR also has p11 (4/4) and AIME q1 that GRPO lacks
    grpo = {f"p{i}": [1, 1, 0, 0] if i <= 5 else [0] * 4 for i in range(1, 11)}
    amir = {f"p{i}": [1, 0, 0, 0] for i in range(1, 11)} | {"p11": [1, 1, 1, 1]}
    write_verl_dump(tmp_path / "grpo", 5, grpo)
    verl_dump(tmp_path / "amir", 5, [line for p, o in amir.items() for line in graded(p, o)] +
              graded("q1", [1, 1, 1, 1], source="math-ai/aime25"))
    args = ["passk", "--run", f"GRPO={tmp_path / 'grpo'}", "--run", f"AMIR={tmp_path / 'amir'}", "--k", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "| GSM8K | 25.0 -> 25.0 (+0.0) |" in out
    assert "note: benchmark AIME 2025 missing from run(s) GRPO" in out
    assert "note: GSM8K: 1 of 11 problem(s) not in every run (1 lacked by GRPO)" in out
    assert "compared over the 10 problem(s) all runs share" in out
    assert main(args + ["--all-problems"]) == 0
    out = capsys.readouterr().out
    assert f"| GSM8K | 25.0 -> {100 * (10 * 0.25 + 1) / 11:.1f} " in out and "kept (--all-problems)" in out


def test_dump_of_another_reward_groups_by_file_and_uid_never_by_prompt_text(tmp_path, capsys):
    """Without data_source/problem_id: the dump's file is the benchmark (or --benchmark-of), the uid's
    prompt part the problem; two prompts with the same text stay two problems."""
    def lines(solved_first):
        return [{"input": "same text", "output": "r", "score": float(ok), "acc": ok, "uid": f"{uid}_{s}_0"}
                for uid, outcomes in (("9f-1", [solved_first, False]), ("9f-2", [False, False]))
                for s, ok in enumerate(outcomes)]

    a, b = verl_dump(tmp_path / "a", 3, lines(True)), verl_dump(tmp_path / "b", 3, lines(False))
    assert main(["passk", "--run", f"A={a}", "--k", "1", "2"]) == 0
    assert f"| {a} | 25.0 | 50.0 |" in capsys.readouterr().out  # two problems: 1/2 and 0/2, not one 1/4
    # same uids in both dumps and one benchmark name: they compare problem by problem
    assert main(["passk", "--run", f"A={a}", "--run", f"B={tmp_path / 'b'}", "--k", "1",
                 "--benchmark-of", f"{a}=amc", "--benchmark-of", f"{tmp_path / 'b'}=amc"]) == 0
    assert "| amc | 25.0 -> 0.0 (-25.0) |" in capsys.readouterr().out
    # without --benchmark-of the two files are two benchmarks
    assert main(["passk", "--run", f"A={a}", "--run", f"B={b}", "--k", "1"]) == 2
    err = capsys.readouterr().err
    assert "share no problem" in err and f"benchmark {a} missing from run(s) B" in err and err.count("\n") == 1


def test_v0_trainer_dump_without_uid_reads_one_sample_per_line(tmp_path, capsys):
    """verl's V0 trainer (RayPPOTrainer) dumps no uid: each line is one sample of the problem the
    reward's problem_id names."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    lines = graded("p1", [1, 1, 0, 0]) + graded("p2", [0, 0, 0, 1])
    extra = {k: [line[k] for line in lines] for k in ("acc", "data_source", "problem_id", "confidence")}
    RayPPOTrainer._write_generations([line["input"] for line in lines], [line["output"] for line in lines],
                                     ["1"] * len(lines), [line["score"] for line in lines], extra, str(tmp_path), 2)
    assert main(["passk", "--run", f"V0={tmp_path}", "--k", "1", "2"]) == 0
    p1, p2 = pass_at_k(4, 2, 2), pass_at_k(4, 1, 2)
    assert f"| GSM8K | {100 * (2 / 4 + 1 / 4) / 2:.1f} | {100 * (p1 + p2) / 2:.1f} |" in capsys.readouterr().out


def test_ground_truth_may_be_a_string_or_a_list(tmp_path):
    path = verl_dump(tmp_path / "run", 1, [dict(line, gts=gts) for line, gts in
                                           zip(graded("p1", [1, 0]), ["12", ["12", "12.0", "\\frac{24}{2}"]])])
    assert [s.correct for s in load_run(path).samples] == [True, False]
    assert json.loads(path.read_text().splitlines()[1])["gts"] == ["12", "12.0", "\\frac{24}{2}"]


@pytest.mark.parametrize(
    "lines,message",
    [
        ([{"problem_id": "p", "data_source": "s", "response": "r"}], r"missing field\(s\) \['correct'\]"),
        ([{"problem_id": "p", "data_source": "s", "response": "r", "correct": 1, "sample_id": 0}] * 2,
         r"duplicate sample id \('p', 0\) \(first at line 1\)"),
        ([{"problem_id": "p", "data_source": "s", "response": "r", "correct": "yes"}], "correctness must be"),
        ([{"input": "q", "output": "o", "score": 1.0}], "without 'acc'"),
        ([{"input": "q", "output": "o", "acc": 1, "uid": "a_0_0"}] * 2,
         r":2: duplicate uid 'a_0_0' \(first at line 1\)"),
        ([{"input": "q", "output": "o", "acc": 1, "uid": "a-0"}], r":1: uid 'a-0' is not verl's"),
        ([{"input": "q", "output": "o", "acc": 1}], "neither problem_id nor uid"),
        ([{"input": "q", "output": "o", "acc": 1, "problem_id": "p"},
          {"problem_id": "p", "data_source": "s", "response": "r", "correct": 1}], ":2: verl dump lines .* mixed"),
    ],
)
def test_bad_input_names_the_problem(tmp_path, capsys, lines, message):
    path = tmp_path / "samples.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines))
    assert main(["passk", "--run", f"X={path}", "--k", "1"]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_problem_ids_are_per_benchmark(tmp_path, capsys):
    path = tmp_path / "s.jsonl"
    path.write_text("\n".join(json.dumps({"problem_id": "0", "data_source": src, "response": "r", "correct": ok})
                               for src, ok in (("openai/gsm8k", True), ("math-ai/aime25", False))))
    assert main(["passk", "--run", f"X={path}", "--k", "1"]) == 0
    out = capsys.readouterr().out
    assert "| GSM8K | 100.0 |" in out and "| math-ai/aime25 | 0.0 |" not in out and "| AIME 2025 | 0.0 |" in out


def test_console_script_is_installed(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps({"problem_id": "p", "data_source": "openai/gsm8k", "response": "r", "correct": True}))
    out = subprocess.run([sys.executable, "-m", "amir_verl.evaluation.cli", "passk", "--run", f"X={path}", "--k", "1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "| GSM8K | 100.0 |" in out.stdout
