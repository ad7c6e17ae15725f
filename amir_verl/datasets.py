"""Training and evaluation sets -> the parquet rows verl's ``RLHFDataset`` reads.

Rows follow verl's ``examples/data_preprocess/gsm8k.py`` schema: ``data_source``, ``prompt`` (chat
messages), ``ability``, ``reward_model {style, ground_truth}``, ``extra_info {split, index, ...}``;
prompts come from the one template (:func:`amir_verl.reward.template.build_prompt`), and each
``data_source`` names the correctness rule the reward applies (:mod:`amir_verl.reward.answers`).
The scripts in ``data_prep/`` are thin command lines over this module.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from amir_verl.reward.template import build_prompt


class MissingAnswer(ValueError):
    """A record without a usable gold answer."""


def _text(record: dict, key: str) -> str:
    value = record.get(key)
    if value is None or (isinstance(value, str) and not value.strip()):
        raise MissingAnswer(f"field {key!r} is missing or empty")
    return str(value).strip()


def _strip_dollars(text: str) -> str:
    text = text.strip()
    return text[1:-1].strip() if len(text) > 1 and text.startswith("$") and text.endswith("$") else text


def gsm8k_gold(record: dict) -> str:
    answer = _text(record, "answer")
    if "####" not in answer:
        raise MissingAnswer("field 'answer' has no '#### <number>' line")
    gold = answer.split("####")[-1].strip().replace(",", "")
    if not gold:
        raise MissingAnswer("nothing after '####' in field 'answer'")
    return gold


def olympiad_gold(record: dict) -> list[str]:
    answers = record.get("final_answer")
    if isinstance(answers, str):
        answers = [answers]
    golds = [_strip_dollars(str(a)) for a in (answers or []) if a is not None and str(a).strip()]
    if not golds:
        raise MissingAnswer("field 'final_answer' is missing or empty")
    return golds


def aqua_gold(record: dict) -> str:
    letter = _text(record, "correct").upper()
    if letter not in "ABCDE" or len(letter) != 1:
        raise MissingAnswer(f"field 'correct' is {letter!r}, not an option letter A-E")
    return letter


def olympiad_question(record: dict) -> str:
    context = record.get("context")
    question = _text(record, "question")
    return f"{context.strip()}\n{question}" if isinstance(context, str) and context.strip() else question


@dataclass(frozen=True)
class Source:
    """One dataset: where it lives and how a raw record becomes a prompt and a gold answer."""

    name: str
    hf_id: str
    hf_config: str | None
    splits: tuple[str, ...]
    question: Callable[[dict], str]
    gold: Callable[[dict], object]
    options: Callable[[dict], list[str] | None] = field(default=lambda record: None)

    @property
    def data_source(self) -> str:
        return self.hf_id


def _field(name: str) -> Callable[[dict], str]:
    def read(record: dict) -> str:
        return _text(record, name)

    return read


def _answer_field(name: str, strip_dollars: bool = False) -> Callable[[dict], str]:
    def read(record: dict) -> str:
        value = _text(record, name)
        return _strip_dollars(value) if strip_dollars else value

    return read


def _aqua_options(record: dict) -> list[str]:
    options = record.get("options")
    if not isinstance(options, (list, tuple)) or not options:
        raise MissingAnswer("field 'options' is missing or empty")
    return [re.sub(r"^\s*([A-E])\s*\)\s*", r"\1) ", str(o)) for o in options]


SOURCES: dict[str, Source] = {
    source.name: source
    for source in (
        Source("gsm8k", "openai/gsm8k", "main", ("train", "test"), _field("question"), gsm8k_gold),
        Source("aime25", "math-ai/aime25", None, ("test",), _field("problem"), _answer_field("answer")),
        Source("olympiadbench", "Hothan/OlympiadBench", "OE_TO_maths_en_COMP", ("train",), olympiad_question,
               olympiad_gold),
        Source("amc23", "math-ai/amc23", None, ("test",), _field("question"), _answer_field("answer")),
        Source("minerva", "math-ai/minervamath", None, ("test",), _field("question"), _answer_field("answer")),
        Source("aqua_rat", "deepmind/aqua_rat", "raw", ("test",), _field("question"), aqua_gold, _aqua_options),
        Source("livemathbench", "opencompass/LiveMathBench", "v202412_AMC_en", ("test",), _field("question"),
               _answer_field("answer", strip_dollars=True)),
    )
}


def to_row(source: Source, record: dict, split: str, index: int) -> dict:
    """One raw record -> one verl row; raises :class:`MissingAnswer` (or ValueError) naming the problem."""
    question = source.question(record)
    gold = source.gold(record)
    options = source.options(record)
    return {
        "data_source": source.data_source,
        "prompt": build_prompt(question, options),
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": gold},
        "extra_info": {"split": split, "index": index, "question": question,
                       "id": str(record.get("id", record.get("unique_id", index)))},
    }


def convert(source: Source, records: Iterable[dict], split: str) -> tuple[list[dict], list[str]]:
    """Rows for every usable record, and one message per rejected record (the others are kept)."""
    rows, rejected = [], []
    for index, record in enumerate(records):
        try:
            rows.append(to_row(source, dict(record), split, index))
        except (MissingAnswer, ValueError) as problem:
            ident = record.get("id", record.get("unique_id")) if isinstance(record, dict) else None
            rejected.append(f"{source.name} {split} record {index}" + (f" (id {ident})" if ident is not None else "")
                            + f": {problem}")
    return rows, rejected


def load_records(source: Source, split: str, local: Path | None = None) -> list[dict]:
    """The split's raw records: from the hub by the real dataset id, or from a local file or folder
    (json, jsonl, parquet, csv; a folder is searched for a file named after the split, else all files)."""
    import datasets

    if local is None:
        return list(datasets.load_dataset(source.hf_id, source.hf_config, split=split))
    local = Path(local)
    if local.is_dir():
        files = sorted(p for p in local.rglob("*") if p.suffix in {".json", ".jsonl", ".parquet", ".csv"})
        named = [p for p in files if p.stem == split or p.stem.startswith(f"{split}-") or f"/{split}/" in str(p)]
        files = named or files
    elif local.exists():
        files = [local]
    else:
        raise FileNotFoundError(f"{local} does not exist")
    if not files:
        raise FileNotFoundError(f"no json/jsonl/parquet/csv file under {local}")
    kinds = {p.suffix for p in files}
    if len(kinds) > 1:
        raise ValueError(f"mixed file kinds under {local}: {sorted(kinds)}")
    builder = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}[kinds.pop()]
    return list(datasets.load_dataset(builder, data_files=[str(p) for p in files], split="train"))


def write_parquet(rows: list[dict], path: Path) -> None:
    import pandas as pd

    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path)


def prepare(name: str, out_dir: Path, local: Path | None = None, splits: Iterable[str] | None = None,
            log: Callable[[str], None] = print) -> dict[str, int]:
    """Convert and write ``out_dir/<split>.parquet`` for each split; returns {split: rows written}."""
    source = SOURCES[name]
    counts = {}
    for split in splits or source.splits:
        records = load_records(source, split, local)
        rows, rejected = convert(source, records, split)
        for message in rejected:
            log(f"rejected {message}")
        write_parquet(rows, Path(out_dir) / f"{split}.parquet")
        counts[split] = len(rows)
        log(f"{name} {split}: {len(rows)} rows written to {Path(out_dir) / f'{split}.parquet'}, "
            f"{len(rejected)} rejected, {len(records)} read")
    return counts
