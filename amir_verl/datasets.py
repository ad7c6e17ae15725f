"""Training and evaluation sets -> the parquet rows verl's ``RLHFDataset`` reads, all in ONE schema.

Every row of every source (and the CPU toy task) is made by :func:`make_row` and written with
:data:`ROW_SCHEMA`, so any set of these files concatenates in verl (``datasets`` aligns files only
when their Arrow types are identical)::

    data_source   string                      the correctness rule the reward applies (amir_verl.reward.answers)
    prompt        list<struct<role, content>> chat messages from amir_verl.reward.template.build_prompt
    ability       string                      "math"
    reward_model  struct<style: string, ground_truth: list<string>>   ALL accepted golds, one or more
    extra_info    struct<split: string, index: int64, id: string, question: string>

``extra_info.id`` is the problem id the reward reports (and amir-eval aligns runs by); ``index`` the
record's position in its split.

Input (``prepare(local=...)``, the scripts' ``--local``): a list of specs, each ``SPLIT=PATH`` (a file
or a folder; all its json/jsonl/parquet/csv files are that split) or a bare ``FOLDER``, in which a
split's files are those named ``SPLIT.*`` or ``SPLIT-*.*`` (hub shards such as
``test-00000-of-00001.parquet``) or lying under a ``SPLIT/`` sub-folder. A bare file is refused: its
split must be named. Every split to write must be found; a split is never taken from another's file.

Bad input stops before anything is written, with one :class:`DataPrepError` line naming the file,
the record (``line N`` for json lines and csv, ``record N`` (0-based) for json arrays, parquet and
the hub) and the column: a missing column, an empty value or unusable gold (a record without an
answer is an error, not skipped: an evaluation set that silently loses items changes its
denominator), an empty file, non-UTF-8 bytes, malformed JSON lines. The scripts in ``data_prep/``
are thin command lines over this module.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from amir_verl.reward.template import build_prompt

ROW_SCHEMA = pa.schema([
    ("data_source", pa.string()),
    ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("ability", pa.string()),
    ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.list_(pa.string()))])),
    ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64()), ("id", pa.string()),
                              ("question", pa.string())])),
])
DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv")
_UNDECODED = re.compile("[\udc80-\udcff]")


class DataPrepError(ValueError):
    """Input that cannot become rows; the message is one line naming file, record and column."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class BadRecord(ValueError):
    """One record's problem, in terms of its column; :func:`convert` adds where the record is."""


def make_row(data_source: str, prompt: list[dict[str, str]], golds: Sequence[str], split: str, index: int,
             problem_id: str, question: str, ability: str = "math") -> dict:
    """The one constructor of a row in :data:`ROW_SCHEMA` (``golds``: every accepted answer)."""
    golds = [golds] if isinstance(golds, str) else [str(g) for g in golds]
    if not golds:
        raise BadRecord("no gold answer")
    return {
        "data_source": data_source,
        "prompt": prompt,
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": golds},
        "extra_info": {"split": split, "index": index, "id": str(problem_id), "question": question},
    }


def write_rows(rows: list[dict], path: Path) -> None:
    """``rows`` -> ``path`` in :data:`ROW_SCHEMA`, atomically (a temporary file renamed into place)."""
    table = pa.Table.from_pylist(rows, schema=ROW_SCHEMA)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(handle)
    try:
        pq.write_table(table, temporary)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def _column(record: dict, key: str):
    if key not in record:
        raise BadRecord(f"no column {key!r} (the record has: {', '.join(map(str, record)) or 'nothing'})")
    return record[key]


def _text(record: dict, key: str) -> str:
    value = _column(record, key)
    if value is None or (isinstance(value, str) and not value.strip()):
        raise BadRecord(f"column {key!r} is empty")
    return str(value).strip()


def _strip_dollars(text: str) -> str:
    text = text.strip()
    return text[1:-1].strip() if len(text) > 1 and text.startswith("$") and text.endswith("$") else text


def gsm8k_gold(record: dict) -> str:
    answer = _text(record, "answer")
    if "####" not in answer:
        raise BadRecord("column 'answer' has no '#### <number>' line")
    gold = answer.split("####")[-1].strip().replace(",", "")
    if not gold:
        raise BadRecord("column 'answer' has nothing after '####'")
    return gold


def olympiad_gold(record: dict) -> list[str]:
    answers = _column(record, "final_answer")
    if isinstance(answers, str):
        answers = [answers]
    golds = [_strip_dollars(str(a)) for a in (answers or []) if a is not None and str(a).strip()]
    if not golds:
        raise BadRecord("column 'final_answer' is empty")
    return golds


def aqua_gold(record: dict) -> str:
    letter = _text(record, "correct").upper()
    if letter not in "ABCDE" or len(letter) != 1:
        raise BadRecord(f"column 'correct' is {letter!r}, not an option letter A-E")
    return letter


def olympiad_question(record: dict) -> str:
    context = record.get("context")
    question = _text(record, "question")
    return f"{context.strip()}\n{question}" if isinstance(context, str) and context.strip() else question


@dataclass(frozen=True)
class Source:
    """One dataset: where it lives and how a raw record becomes a prompt and its gold answers."""

    name: str
    hf_id: str
    hf_config: str | None
    splits: tuple[str, ...]
    question: Callable[[dict], str]
    gold: Callable[[dict], str | list[str]]
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
    options = _column(record, "options")
    if not isinstance(options, (list, tuple)) or not options:
        raise BadRecord("column 'options' is not a non-empty list")
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
    """One raw record -> one row; raises :class:`BadRecord` naming the column."""
    question = source.question(record)
    options = source.options(record)
    return make_row(source.data_source, build_prompt(question, options), source.gold(record), split, index,
                    record.get("id", record.get("unique_id", index)), question)


def convert(source: Source, records: Iterable[tuple[str, dict]], split: str) -> list[dict]:
    """Rows of ``(where, record)`` pairs; the first bad record raises :class:`DataPrepError` at ``where``."""
    rows = []
    for index, (where, record) in enumerate(records):
        try:
            rows.append(to_row(source, record, split, index))
        except BadRecord as problem:
            raise DataPrepError(f"{where}: {source.name} {split}: {problem}") from None
    return rows


def read_records(path: Path) -> list[tuple[str, dict]]:
    """The records of one local file as ``(where, record)``: json (an array, or one object a line),
    jsonl, csv (UTF-8) or parquet. Raises :class:`DataPrepError` for anything that is not a record."""
    if path.suffix == ".parquet":
        try:
            rows = pq.read_table(path).to_pylist()
        except (pa.ArrowException, OSError) as error:
            raise DataPrepError(f"{path}: not a readable parquet file ({error})") from None
        records = [(f"{path} record {i}", row) for i, row in enumerate(rows)]
    else:
        # undecodable bytes survive as lone surrogates, so that the record and column holding them can be named
        text = path.read_bytes().decode("utf-8", errors="surrogateescape").removeprefix("\ufeff")
        records = _csv_records(path, text) if path.suffix == ".csv" else _json_records(path, text)
        for where, record in records:
            for column, value in record.items():
                if _undecoded(column) or _undecoded(value):
                    raise DataPrepError(f"{where}: column {column!r} is not UTF-8 text")
    if not records:
        raise DataPrepError(f"{path}: empty file, no records")
    return records


def _undecoded(value) -> bool:
    if isinstance(value, str):
        return _UNDECODED.search(value) is not None
    if isinstance(value, dict):
        return any(_undecoded(k) or _undecoded(v) for k, v in value.items())
    return isinstance(value, list) and any(map(_undecoded, value))


def _json_records(path: Path, text: str) -> list[tuple[str, dict]]:
    if text.lstrip().startswith("["):  # one JSON array of records
        try:
            items = json.loads(text)
        except json.JSONDecodeError as error:
            raise DataPrepError(f"{path} line {error.lineno}: not valid JSON ({error.msg}, column {error.colno})") \
                from None
        records = [(f"{path} record {i}", item) for i, item in enumerate(items)]
    else:  # JSON lines; blank lines skipped
        records = []
        for number, line in enumerate(text.split("\n"), start=1):
            if line.strip():
                try:
                    records.append((f"{path} line {number}", json.loads(line)))
                except json.JSONDecodeError as error:
                    raise DataPrepError(f"{path} line {number}: not valid JSON ({error.msg}, column {error.colno})") \
                        from None
    for where, item in records:
        if not isinstance(item, dict):
            raise DataPrepError(f"{where}: not a JSON object with the dataset's columns")
    return records


def _csv_records(path: Path, text: str) -> list[tuple[str, dict]]:
    reader = csv.DictReader(io.StringIO(text, newline=""))
    try:
        return [(f"{path} line {reader.line_num}", dict(row)) for row in reader]
    except csv.Error as error:
        raise DataPrepError(f"{path} line {reader.line_num}: not valid CSV ({error})") from None


def local_files(specs: Iterable[str | Path], splits: Sequence[str]) -> dict[str, list[Path]]:
    """``--local`` specs -> the files of each split in ``splits`` (module docstring for the rules)."""
    explicit: dict[str, Path] = {}
    folders: list[Path] = []
    for spec in specs:
        split, sep, path = str(spec).partition("=")
        if sep:
            if split in explicit:
                raise DataPrepError(f"--local names split {split!r} twice")
            explicit[split] = Path(path)
        elif Path(spec).is_file():
            raise DataPrepError(f"--local {spec}: a single file needs its split, e.g. --local test={spec}")
        else:
            folders.append(Path(spec))
    for path in [*explicit.values(), *folders]:
        if not path.exists():
            raise DataPrepError(f"--local {path}: does not exist")
    unused = sorted(set(explicit) - set(splits))
    if unused:
        raise DataPrepError(f"--local names split {unused[0]!r}, which is not being written (splits: "
                            f"{', '.join(splits)})")
    files = {}
    for split in splits:
        if split in explicit:
            found = _data_files(explicit[split])
        else:
            found = [p for folder in folders for p in _data_files(folder) if _names_split(p, folder, split)]
        if not found:
            if split in explicit:
                raise DataPrepError(f"--local {split}={explicit[split]}: no json/jsonl/parquet/csv file")
            searched = f"{', '.join(map(str, folders))} has no {split}.*, {split}-*.* or {split}/ data file" \
                if folders else f"names only {', '.join(explicit)}"
            raise DataPrepError(f"--local has no {split!r} split ({searched}); give one with --local {split}=PATH")
        kinds = sorted({p.suffix for p in found})
        if len(kinds) > 1:
            raise DataPrepError(f"split {split!r} has files of several kinds ({', '.join(kinds)}): "
                                f"{', '.join(map(str, found))}")
        files[split] = found
    return files


def _data_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in DATA_SUFFIXES)


def _names_split(path: Path, folder: Path, split: str) -> bool:
    return path.stem == split or path.stem.startswith(f"{split}-") or split in path.relative_to(folder).parts[:-1]


def hub_records(source: Source, split: str) -> list[tuple[str, dict]]:
    import datasets

    records = datasets.load_dataset(source.hf_id, source.hf_config, split=split)
    name = f"hub {source.hf_id}" + (f" ({source.hf_config})" if source.hf_config else "") + f" {split}"
    return [(f"{name} record {i}", dict(record)) for i, record in enumerate(records)]


def prepare(name: str, out_dir: Path, local: Sequence[str | Path] | None = None, splits: Iterable[str] | None = None,
            log: Callable[[str], None] = print) -> dict[str, int]:
    """Convert every split, then write ``out_dir/<split>.parquet`` for each; returns {split: rows}.

    ``local``: ``--local`` specs (module docstring), or None to load the hub's dataset. Every split
    is read and converted before the first file is written, so a :class:`DataPrepError` leaves
    ``out_dir`` untouched."""
    source = SOURCES[name]
    splits = tuple(splits or source.splits)
    files = local_files(local, splits) if local else None
    rows = {}
    for split in splits:
        records = hub_records(source, split) if files is None else \
            [record for path in files[split] for record in read_records(path)]
        rows[split] = convert(source, records, split)
    for split in splits:
        path = Path(out_dir) / f"{split}.parquet"
        write_rows(rows[split], path)
        origin = "the hub" if files is None else ", ".join(map(str, files[split]))
        log(f"{name} {split}: {len(rows[split])} rows written to {path} (from {origin})")
    return {split: len(rows[split]) for split in splits}


LOCAL_HELP = ("offline input instead of the hub: SPLIT=PATH (a file or folder that is that split) or a FOLDER "
              "whose files are named after their split (SPLIT.jsonl, SPLIT-00000-of-00001.parquet, SPLIT/...)")


def prepare_or_exit(name: str, out_dir: Path, local: Sequence[str] | None, splits: Iterable[str] | None = None) -> None:
    """:func:`prepare` for the command lines: a :class:`DataPrepError` exits 1 with its one line on stderr."""
    try:
        prepare(name, out_dir, local, splits)
    except DataPrepError as error:
        sys.exit(f"data_prep error: {error}")
