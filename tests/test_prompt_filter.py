"""Per-benchmark counts of the prompts verl's filter_overlong_prompts drops (amir_verl.prompt_filter), on the
recipe's own validation files built by data_prep from generated problems, some of them over-long, through
verl's real RLHFDataset; counts compared against each prompt's length computed here."""

import inspect

import pyarrow.parquet as pq
import pytest
import wrapt

from amir_verl.paper_pipeline import EVAL_BENCHMARKS
from amir_verl.paper_pipeline.data import write_raw_datasets
from amir_verl.datasets import prepare
from amir_verl.prompt_filter import PREFIX
from tests.support import load_like_main_ppo, word_tokenizer
from tests.support import compose_recipe

MAX_PROMPT = 200  # words (the test tokenizer's tokens); a generated prompt has about 90, an over-long one 800
OVERLONG = {"gsm8k": 2, "aime25": 1, "livemathbench": 3}


@pytest.fixture(scope="module")
def recipe_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("filter")
    raw = write_raw_datasets(root / "raw", n_train=3, n_gsm8k_test=4, n_eval=2, seed=1, overlong=OVERLONG)
    prepare("gsm8k", root / "data" / "gsm8k", [raw["gsm8k"]])
    for name in EVAL_BENCHMARKS:
        prepare(name, root / "data" / "eval" / name, [raw[name]])
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AMIR_DATA", str(root / "data"))
        config = compose_recipe("grpo", "unused/model", [f"data.max_prompt_length={MAX_PROMPT}"])
    return config, word_tokenizer(root / "tokenizer")


def test_the_plugin_wraps_verls_filter():
    from verl.utils.dataset.rl_dataset import RLHFDataset

    assert isinstance(inspect.getattr_static(RLHFDataset, "maybe_filter_out_long_prompts"), wrapt.FunctionWrapper)


def test_each_benchmarks_dropped_prompts_are_counted_out_of_its_total(recipe_files, capsys):
    config, tokenizer = recipe_files
    expected = {}
    for path in config.data.val_files:
        rows = pq.read_table(path).to_pylist()
        lengths = [len(tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                                     return_dict=True)["input_ids"]) for row in rows]
        expected[rows[0]["data_source"]] = (sum(n > MAX_PROMPT for n in lengths), len(rows))
    assert sorted(d for d, _ in expected.values()) == [0, 0, 0, 0, 1, 2, 3]  # the over-long ones, and only they

    dataset = load_like_main_ppo(config.data.val_files, config, tokenizer, is_train=False)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(PREFIX)]
    assert lines == [f"{PREFIX}: {source}: dropped {dropped} of {total} prompts longer than {MAX_PROMPT} tokens"
                     for source, (dropped, total) in sorted(expected.items())]
    assert len(dataset) == sum(total - dropped for dropped, total in expected.values())


def test_nothing_is_reported_when_the_filter_is_off(recipe_files, capsys):
    config, tokenizer = recipe_files
    config.data.filter_overlong_prompts = False
    try:
        load_like_main_ppo(config.data.val_files, config, tokenizer, is_train=False)
    finally:
        config.data.filter_overlong_prompts = True
    assert PREFIX not in capsys.readouterr().out
