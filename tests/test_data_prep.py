"""data_prep: each source's raw schema -> parquet -> prompt -> reward, through the real scripts; the
recipe's own file lists loaded together through verl's RLHFDataset; bad input stops with one line."""

import csv
import json
import random
import runpy
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from amir_verl.demo.toy_task import make_dataset
from amir_verl.datasets import ROW_SCHEMA, SOURCES, DataPrepError, prepare
from amir_verl.reward import compute_score
from amir_verl.reward.template import INSTRUCTION
from tests.support import compose_recipe
from tests.support import REPO, load_like_main_ppo, word_tokenizer

GSM8K_SCRIPT, BENCHMARKS_SCRIPT = REPO / "data_prep" / "gsm8k.py", REPO / "data_prep" / "benchmarks.py"

# source -> (raw records in the dataset's own hub schema, the golds each must get (decided from the
# source's rule: gsm8k the number after ####, commas dropped; olympiadbench every final answer, $ stripped;
# aqua the letter; livemathbench $ stripped), the right answer to write for record 0, a wrong one)
FIXTURES = {
    "gsm8k": ([{"question": "Ann has 3 apples and buys 1,200 more. How many?", "answer": "3+1200=1203\n#### 1,203"},
               {"question": "Bob has 2 pens and loses 1. How many?", "answer": "2-1=1\n#### 1"}],
              [["1203"], ["1"]], "1,203 apples", "1,202"),
    "aime25": ([{"id": "I-1", "problem": "Find the sum of all bases b > 9 ...", "answer": "70"},
                {"id": "I-2", "problem": "Find the number of ordered pairs ...", "answer": "117"}],
               [["70"], ["117"]], "\\boxed{70}", "71"),
    "olympiadbench": ([{"id": 1606, "question": "Find the smallest n.", "context": None,
                        "final_answer": ["$4$", "$n=4$"], "unit": None},
                       {"id": 1607, "question": "Find all x.", "context": "Let x be real.",
                        "final_answer": ["$1$", "$-1$", "$x=\\pm 1$"], "unit": None},
                       {"id": 1608, "question": "Compute the area.", "context": None,
                        "final_answer": ["$12$"], "unit": "cm^2"}],
                      [["4", "n=4"], ["1", "-1", "x=\\pm 1"], ["12"]], "4", "5"),
    "amc23": ([{"id": 0, "question": "What is 1/2 + 1/4?", "answer": 0.75, "url": "x"},
               {"id": 1, "question": "What is 3 + 4?", "answer": 7.0, "url": "y"}],
              [["0.75"], ["7.0"]], "\\frac{3}{4}", "\\frac{2}{3}"),
    "minerva": ([{"question": "Compute the ratio.", "answer": "\\frac{1}{2}"},
                 {"question": "Compute the period in days.", "answer": "365"}], [["\\frac{1}{2}"], ["365"]],
                "0.5", "0.25"),
    "aqua_rat": ([{"question": "A train covers 60 km in 1.5 h. Its speed?",
                   "options": ["A)30", "B)40", "C)45", "D)50", "E)60"], "rationale": "60/1.5=40", "correct": "B"},
                  {"question": "2 + 2?", "options": ["A)3", "B)4", "C)5", "D)6", "E)7"], "rationale": "",
                   "correct": "b"}],
                 [["B"], ["B"]], "B) 40", "C"),
    "livemathbench": ([{"question": "Find x.", "answer": "$\\sqrt{2}$", "question_type": "Problem-Solving"},
                       {"question": "Find y.", "answer": "3", "question_type": "Problem-Solving"}],
                      [["\\sqrt{2}"], ["3"]], "\\sqrt{2}", "\\sqrt{3}"),
}


def respond(answer):
    return f"<think> work </think> <answer> {answer} </answer> <confidence> 0.9 </confidence>"


def write_raw(path: Path, records: list[dict]) -> Path:
    """Records in the file kind its suffix names (jsonl, json array, csv, parquet), as the hub ships them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".csv":
        with path.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(records[0]))
            writer.writeheader()
            writer.writerows(records)
    elif path.suffix == ".parquet":
        import pyarrow as pa

        pq.write_table(pa.Table.from_pylist(records), path)
    elif path.suffix == ".json":
        path.write_text(json.dumps(records, indent=1))
    else:
        path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def run_script(script: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True,
                          timeout=120, cwd=REPO)


def same_schema(path: Path) -> bool:
    return pq.read_schema(path).remove_metadata().equals(ROW_SCHEMA)


@pytest.mark.parametrize("name", list(FIXTURES))
def test_raw_records_to_parquet_to_prompt_to_reward(name, tmp_path):
    records, golds, right, wrong = FIXTURES[name]
    source = SOURCES[name]
    split = source.splits[-1]
    raw = write_raw(tmp_path / "raw" / "data.jsonl", records)
    messages = []
    counts = prepare(name, tmp_path / "out", local=[f"{split}={raw}"], splits=[split], log=messages.append)
    assert counts == {split: len(records)} and f"{split}: {len(records)} rows written" in messages[0]

    path = tmp_path / "out" / f"{split}.parquet"
    assert same_schema(path)
    rows = pq.read_table(path).to_pylist()
    assert [row["reward_model"] for row in rows] == [{"style": "rule", "ground_truth": g} for g in golds]
    assert [row["extra_info"]["index"] for row in rows] == list(range(len(records)))
    assert [row["extra_info"]["split"] for row in rows] == [split] * len(records)
    row = rows[0]
    assert row["data_source"] == source.hf_id and row["ability"] == "math"
    assert row["extra_info"]["id"] == str(records[0].get("id", 0))
    content = row["prompt"][0]["content"]
    question = records[0].get("question", records[0].get("problem"))
    assert content.endswith(INSTRUCTION) and question in content and row["extra_info"]["question"] in content
    if name == "aqua_rat":
        assert "B) 40" in content
    gold = row["reward_model"]["ground_truth"]
    assert compute_score(row["data_source"], respond(right), gold)["acc"] == 1.0
    assert compute_score(row["data_source"], respond(wrong), gold)["acc"] == 0.0


# where each source's raw files lie in the composition test: the hub's own layouts and file kinds
RAW_LAYOUT = {
    "gsm8k": ["main/train-00000-of-00001.parquet", "main/test-00000-of-00001.parquet"],
    "aime25": ["test.jsonl"],
    "olympiadbench": ["OE_TO_maths_en_COMP/train-00000-of-00001.parquet"],
    "amc23": ["test.json"],
    "minerva": ["test/part.csv"],
    "aqua_rat": ["raw/test-00000-of-00001.parquet"],
    "livemathbench": ["v202412_AMC_en/test.jsonl"],
}


@pytest.fixture(scope="module")
def recipe_data(tmp_path_factory):
    """Every file the paper recipes read, made by the real data_prep scripts (their main(), as run from
    the shell) from raw hub-schema fixtures, into the layout the README gives: $AMIR_DATA/gsm8k,
    $AMIR_DATA/eval/<benchmark>. Returns (AMIR_DATA, {(data_source, split, id): golds})."""
    root = tmp_path_factory.mktemp("recipe_data")
    expected = {}
    for name, (records, golds, _, _) in FIXTURES.items():
        source = SOURCES[name]
        for relative, split in zip(RAW_LAYOUT[name], source.splits):
            write_raw(root / "raw" / name / relative, records)
            for index, (record, gold) in enumerate(zip(records, golds)):
                expected[(source.hf_id, split, str(record.get("id", index)))] = gold
        if name == "gsm8k":
            argv = [str(GSM8K_SCRIPT), "--out", str(root / "data" / "gsm8k"), "--local", str(root / "raw" / name)]
        else:
            argv = [str(BENCHMARKS_SCRIPT), "--benchmark", name, "--out", str(root / "data" / "eval" / name),
                    "--local", str(root / "raw" / name)]
        script_argv = sys.argv
        sys.argv = argv
        try:
            runpy.run_path(argv[0], run_name="__main__")
        finally:
            sys.argv = script_argv
    return root / "data", expected


@pytest.fixture(scope="module")
def recipe_config(recipe_data):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AMIR_DATA", str(recipe_data[0]))
        return compose_recipe("amir_grpo", "unused/model")


def test_recipe_train_and_val_files_load_through_verl_with_every_gold(recipe_data, recipe_config, tmp_path):
    from verl.utils.dataset.rl_dataset import collate_fn

    data_root, expected = recipe_data
    files = [recipe_config.data.train_files, *recipe_config.data.val_files]
    assert all(str(f).startswith(str(data_root)) and Path(f).exists() for f in files), files
    assert all(same_schema(Path(f)) for f in files)
    tokenizer = word_tokenizer(tmp_path / "tokenizer")

    seen = {}
    for listed, is_train in ((recipe_config.data.val_files, False), (recipe_config.data.train_files, True)):
        dataset = load_like_main_ppo(listed, recipe_config, tokenizer, is_train)
        items = [dataset[i] for i in range(len(dataset))]
        for item in items:
            info = item["extra_info"]
            key = (item["data_source"], info["split"], info["id"])
            assert key not in seen or seen[key] == item["reward_model"]["ground_truth"]
            seen[key] = item["reward_model"]["ground_truth"]
            assert item["raw_prompt"][0]["content"].endswith(INSTRUCTION)
        batch = collate_fn(items)
        assert len(batch["reward_model"]) == len(items) == len(dataset)
        assert [r["ground_truth"] for r in batch["reward_model"]] == [i["reward_model"]["ground_truth"] for i in items]
    assert seen == expected  # every item of every source, none filtered, each with all its golds
    assert seen[("Hothan/OlympiadBench", "train", "1607")] == ["1", "-1", "x=\\pm 1"]


def test_any_subset_of_the_recipe_files_loads_together(recipe_config, tmp_path):
    """datasets concatenates files whose features all equal the first file's. Every file the recipes list
    (and the toy task's, which the CPU tests train on) has exactly ROW_SCHEMA, so any subset aligns; verl
    loads all of them at once, in reverse order, and seeded random subsets to show it."""
    toy = make_dataset(tmp_path / "toy", n_train=4, n_test=2)
    files = [recipe_config.data.train_files, *recipe_config.data.val_files, *map(str, toy.values())]
    assert all(same_schema(Path(f)) for f in files)
    tokenizer = word_tokenizer(tmp_path / "tokenizer")
    sizes = {f: pq.read_metadata(f).num_rows for f in files}
    rng = random.Random(0)
    subsets = [files, files[::-1], *(rng.sample(files, rng.randint(1, len(files) - 1)) for _ in range(4))]
    for subset in subsets:
        dataset = load_like_main_ppo(subset, recipe_config, tokenizer, is_train=False)
        assert len(dataset) == sum(sizes[f] for f in subset)
        assert all(isinstance(dataset[i]["reward_model"]["ground_truth"], list) for i in range(len(dataset)))


def test_gsm8k_script_end_to_end(tmp_path):
    train = write_raw(tmp_path / "raw" / "a.jsonl", FIXTURES["gsm8k"][0][:1])
    test = write_raw(tmp_path / "raw" / "b.jsonl", FIXTURES["gsm8k"][0])
    out = run_script(GSM8K_SCRIPT, "--out", tmp_path / "out", "--local", f"train={train}", f"test={test}")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "gsm8k train: 1 rows written" in out.stdout and "gsm8k test: 2 rows written" in out.stdout
    assert pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()[0]["reward_model"]["ground_truth"] == ["1203"]
    assert pq.read_table(tmp_path / "out" / "test.parquet").num_rows == 2


def test_benchmarks_script_rejects_local_with_all(tmp_path):
    out = run_script(BENCHMARKS_SCRIPT, "--benchmark", "all", "--out", tmp_path, "--local", tmp_path)
    assert out.returncode != 0 and "single --benchmark" in out.stderr


GOOD_AIME = '{"id": "I-1", "problem": "Find x.", "answer": "70"}\n'


def bad_inputs(raw: Path) -> dict:
    """case -> (script arguments after --out, bytes of each raw file, the parts the one error line must name).
    Files are written relative to ``raw``; {raw} in the arguments is that folder."""
    return {
        "column renamed (question for problem)": (
            ["--benchmark", "aime25", "--local", "{raw}"],
            {"test.jsonl": GOOD_AIME.replace("problem", "question").encode()},
            ["test.jsonl line 1", "no column 'problem'", "question"]),
        "gsm8k without answer": (
            ["--local", "{raw}"],
            {"train.jsonl": b'{"question": "q"}\n', "test.jsonl": b'{"question": "q"}\n'},
            ["train.jsonl line 1", "no column 'answer'"]),
        "record without an answer, other split fine": (
            ["--local", "{raw}"],
            {"train.jsonl": b'{"question": "q", "answer": "#### 3"}\n',
             "test.jsonl": b'{"question": "q", "answer": "#### 3"}\n\n{"question": "r", "answer": "no marker"}\n'},
            ["test.jsonl line 3", "column 'answer'", "####"]),
        "null answer": (
            ["--benchmark", "amc23", "--local", "{raw}"],
            {"test.jsonl": b'{"question": "q", "answer": 1}\n{"question": "r", "answer": null}\n'},
            ["test.jsonl line 2", "column 'answer' is empty"]),
        "empty file": (
            ["--benchmark", "aime25", "--local", "{raw}"], {"test.jsonl": b""}, ["test.jsonl", "empty file"]),
        "not UTF-8": (
            ["--benchmark", "aime25", "--local", "{raw}"],
            {"test.jsonl": GOOD_AIME.encode() + b'{"id": "I-2", "problem": "caf\xe9", "answer": "1"}\n'},
            ["test.jsonl line 2", "column 'problem'", "not UTF-8"]),
        "malformed JSON line": (
            ["--benchmark", "aime25", "--local", "{raw}"],
            {"test.jsonl": (GOOD_AIME * 2 + '{"id": "I-3", "problem": "x", "answer": \n').encode()},
            ["test.jsonl line 3", "not valid JSON"]),
        "JSON line that is not a record": (
            ["--benchmark", "aime25", "--local", "{raw}"], {"test.jsonl": GOOD_AIME.encode() + b"[1, 2]\n"},
            ["test.jsonl line 2", "not a JSON object"]),
        "broken parquet": (
            ["--benchmark", "aime25", "--local", "{raw}"], {"test.parquet": b"PAR1 not really"},
            ["test.parquet", "not a readable parquet file"]),
        "folder with only test for gsm8k's train": (
            ["--local", "{raw}"], {"test.jsonl": b'{"question": "q", "answer": "#### 3"}\n'},
            ["no 'train' split", "--local train=PATH"]),
        "gsm8k given only its test file": (
            ["--local", "test={raw}/test.jsonl"], {"test.jsonl": b'{"question": "q", "answer": "#### 3"}\n'},
            ["no 'train' split", "names only test"]),
        "a single file without its split": (
            ["--benchmark", "aime25", "--local", "{raw}/test.jsonl"], {"test.jsonl": GOOD_AIME.encode()},
            ["test.jsonl", "needs its split", "--local test="]),
        "a split that is not written": (
            ["--benchmark", "aime25", "--local", "test={raw}/test.jsonl", "train={raw}/test.jsonl"],
            {"test.jsonl": GOOD_AIME.encode()}, ["split 'train'", "not being written"]),
    }


@pytest.mark.parametrize("case", list(bad_inputs(Path("."))))
def test_bad_input_stops_with_one_line_and_writes_nothing(case, tmp_path):
    raw = tmp_path / "raw"
    arguments, files, named = bad_inputs(raw)[case]
    for relative, content in files.items():
        (raw / relative).parent.mkdir(parents=True, exist_ok=True)
        (raw / relative).write_bytes(content)
    script = BENCHMARKS_SCRIPT if "--benchmark" in arguments else GSM8K_SCRIPT
    out = run_script(script, "--out", tmp_path / "out", *(a.replace("{raw}", str(raw)) for a in arguments))
    assert out.returncode == 1, (out.returncode, out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("data_prep error: "), out.stderr
    assert all(part in lines[0] for part in named), (named, lines[0])
    assert not (tmp_path / "out").exists()  # not even a partial file or an empty folder


def test_missing_local_path_is_a_clear_error(tmp_path):
    with pytest.raises(DataPrepError, match="does not exist"):
        prepare("aime25", tmp_path / "out", local=[tmp_path / "nowhere"])
    with pytest.raises(DataPrepError, match="does not exist"):
        prepare("aime25", tmp_path / "out", local=[f"test={tmp_path / 'nowhere.jsonl'}"])
