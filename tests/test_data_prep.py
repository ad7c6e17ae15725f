"""data_prep: each source's raw schema -> parquet -> prompt -> reward, through the real scripts."""

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from amir_verl.datasets import SOURCES, prepare
from amir_verl.reward import compute_score
from amir_verl.reward.template import INSTRUCTION

REPO = Path(__file__).resolve().parents[1]

# (source, raw records in the dataset's own schema, the right answer to write for record 0, a wrong one)
FIXTURES = {
    "gsm8k": ([{"question": "Ann has 3 apples and buys 1,200 more. How many?", "answer": "3+1200=1203\n#### 1,203"},
               {"question": "No answer here", "answer": "just a rationale"}], "1,203 apples", "1,202"),
    "aime25": ([{"id": "I-1", "problem": "Find the sum of all bases b > 9 ...", "answer": "70"},
                {"id": "I-2", "problem": "Broken record", "answer": None}], "\\boxed{70}", "71"),
    "olympiadbench": ([{"id": 1606, "question": "Find the smallest n.", "context": None,
                        "final_answer": ["$4$", "$n=4$"], "unit": None},
                       {"id": 1607, "question": "Missing", "final_answer": []}], "4", "5"),
    "amc23": ([{"id": 0, "question": "What is 1/2 + 1/4?", "answer": 0.75, "url": "x"},
               {"id": 1, "question": "Missing", "answer": ""}], "\\frac{3}{4}", "\\frac{2}{3}"),
    "minerva": ([{"question": "Compute the ratio.", "answer": "\\frac{1}{2}"},
                 {"question": "Missing"}], "0.5", "0.25"),
    "aqua_rat": ([{"question": "A train covers 60 km in 1.5 h. Its speed?",
                   "options": ["A)30", "B)40", "C)45", "D)50", "E)60"], "rationale": "60/1.5=40", "correct": "B"},
                  {"question": "Bad letter", "options": ["A)1", "B)2"], "rationale": "", "correct": "Z"}],
                 "B) 40", "C"),
    "livemathbench": ([{"question": "Find x.", "answer": "$\\sqrt{2}$", "question_type": "Problem-Solving"},
                       {"question": "Missing", "answer": None, "question_type": "x"}], "\\sqrt{2}", "\\sqrt{3}"),
}


def respond(answer):
    return f"<think> work </think> <answer> {answer} </answer> <confidence> 0.9 </confidence>"


@pytest.mark.parametrize("name", list(FIXTURES))
def test_raw_records_to_parquet_to_prompt_to_reward(name, tmp_path):
    records, right, wrong = FIXTURES[name]
    source = SOURCES[name]
    split = source.splits[-1]
    raw = tmp_path / "raw" / f"{split}.jsonl"
    raw.parent.mkdir()
    raw.write_text("\n".join(json.dumps(r) for r in records))
    messages = []
    counts = prepare(name, tmp_path / "out", local=raw.parent, splits=[split], log=messages.append)
    assert counts == {split: 1}
    assert any("rejected" in m and "record 1" in m for m in messages), messages  # named, others kept

    table = pd.read_parquet(tmp_path / "out" / f"{split}.parquet")
    assert list(table.columns) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    row = table.iloc[0]
    assert row["data_source"] == source.hf_id and row["ability"] == "math"
    content = row["prompt"][0]["content"]
    assert content.endswith(INSTRUCTION) and records[0].get("question", records[0].get("problem"))[:20] in content
    if name == "aqua_rat":
        assert "B) 40" in content and row["reward_model"]["ground_truth"] == "B"
    gold = row["reward_model"]["ground_truth"]
    gold = list(gold) if not isinstance(gold, str) else gold
    assert compute_score(row["data_source"], respond(right), gold)["acc"] == 1.0
    assert compute_score(row["data_source"], respond(wrong), gold)["acc"] == 0.0


def test_gsm8k_script_end_to_end(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    for split in ("train", "test"):
        (raw / f"{split}.jsonl").write_text(json.dumps(FIXTURES["gsm8k"][0][0]))
    out = subprocess.run([sys.executable, str(REPO / "data_prep" / "gsm8k.py"), "--out", str(tmp_path / "out"),
                          "--local", str(raw)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "gsm8k train: 1 rows written" in out.stdout and "gsm8k test: 1 rows written" in out.stdout
    assert pd.read_parquet(tmp_path / "out" / "train.parquet").iloc[0]["reward_model"]["ground_truth"] == "1203"


def test_benchmarks_script_rejects_local_with_all(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "data_prep" / "benchmarks.py"), "--benchmark", "all", "--out",
                          str(tmp_path), "--local", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "single --benchmark" in out.stderr


def test_missing_local_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        prepare("aime25", tmp_path / "out", local=tmp_path / "nowhere")
