"""Read graded samples: verl's validation dumps or a plain JSONL.

Both are read as one JSON object per ``\\n``-terminated line, decoded as UTF-8 line by line: JSON strings
may hold U+2028 or U+0085 (verl writes with ``ensure_ascii=False``), which ``str.splitlines`` would take
for line breaks. A line that is not UTF-8 or not a JSON object (a dump cut off mid-write) is an error
naming the file and line, or is skipped and counted with ``skip_malformed``.

- verl (``trainer.validation_data_dir``): one ``<step>.jsonl`` per validation, a line per output with
  ``input``, ``output``, ``score``, ``gts`` (a string or a list), the reward's extra fields and, from
  the V1 trainer, ``uid`` = ``{prompt uid}_{session}_{index}``. An agent session may return several
  outputs (index 0, 1, ...); verl's validation metrics and GRPO advantages count each session once, by
  its output of highest index (``final_session_outputs``), and its dump gives every output of the session
  the final output's reward fields. amir-verl's reward adds ``acc``, ``data_source``, ``problem_id`` and
  ``confidence``. Another reward must still give ``acc``; without ``data_source`` the dump's file is the
  benchmark (or ``benchmark_of``), without ``problem_id`` the uid's prompt part is the problem (verl draws
  a fresh uid per prompt, so two prompts with the same text stay two problems).
- plain JSONL: ``problem_id``, ``data_source``, ``response``, ``correct`` per line (``sample_id``,
  ``confidence`` and ``prompt`` optional; the log-prob analyses need ``prompt``).

A problem is identified by (data_source, problem_id): ids only need to be unique within a benchmark.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from amir_verl.evaluation.passk import EvaluationError, Sample

PLAIN_FIELDS = ("problem_id", "data_source", "response", "correct")
_SESSION_KEY = re.compile(r"^(?P<prompt>.+)_(?P<session>\d+)_(?P<index>\d+)$")


@dataclass
class LoadedRun:
    """A run's samples (one per session) and what reading them left out, for the command to say."""

    path: Path
    samples: list[Sample]
    notes: list[str] = field(default_factory=list)


def _latest_dump(folder: Path, step: int | None) -> Path:
    files = {int(p.stem): p for p in folder.glob("*.jsonl") if p.stem.isdigit()}
    if not files:
        raise EvaluationError(f"{folder} has no verl validation dump (<step>.jsonl)")
    if step is None:
        return files[max(files)]
    if step not in files:
        raise EvaluationError(f"{folder} has no dump of step {step}; steps: {sorted(files)}")
    return files[step]


def dump_file(path: str | Path, step: int | None = None) -> Path:
    """The file a run argument names: a dump folder's latest (or ``step``) dump, else the file itself."""
    path = Path(path)
    if path.is_dir():
        return _latest_dump(path, step)
    if not path.exists():
        raise EvaluationError(f"{path} does not exist")
    return path


def read_json_lines(path: Path, skip_malformed: bool = False) -> tuple[list[tuple[int, dict]], list[int]]:
    """[(line number, object)] of a JSONL file and the numbers of skipped malformed lines; blank lines
    are ignored. Without ``skip_malformed`` the first malformed line is an ``EvaluationError``."""
    records, skipped = [], []
    for line_no, raw in enumerate(path.read_bytes().split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
            if not isinstance(record, dict):
                raise ValueError(f"a JSON {type(record).__name__}, not an object")
        except UnicodeDecodeError as error:
            problem = f"not UTF-8 (byte {error.start}: {error.reason}; a cut-off write?)"
        except ValueError as error:  # json.JSONDecodeError included
            problem = f"not a JSON object ({error})"
        else:
            records.append((line_no, record))
            continue
        if not skip_malformed:
            raise EvaluationError(f"{path}:{line_no}: {problem}; --skip-malformed leaves such lines out")
        skipped.append(line_no)
    return records, skipped


def final_session_outputs(keys: list[str]) -> list[int]:
    """Positions of the outputs that stand for their session, in input order.

    ``keys`` are verl V1 sample keys ``{uid}_{session}_{index}``: of each ``{uid}_{session}`` the output
    with the highest index (the session's final output) is kept, the rule of verl's validation and of
    ``compute_advantage_for_multi_trajectories`` (pinned in tests/test_evaluation.py).
    """
    final: dict[str, tuple[int, int]] = {}
    for position, key in enumerate(keys):
        match = _SESSION_KEY.match(key)
        if match is None:
            raise EvaluationError(f"uid {key!r} is not verl's {{uid}}_{{session}}_{{index}}")
        session, index = f"{match['prompt']}_{match['session']}", int(match["index"])
        if session not in final or index > final[session][0]:
            final[session] = (index, position)
    return sorted(position for _, position in final.values())


def _as_bool(value, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    raise EvaluationError(f"{where}: correctness must be true/false or 0/1, got {value!r}")


def _confidence(value) -> float | None:
    """The stated confidence, None where the reward found none (it logs -1) or the field is absent."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        return None
    return float(value)


def _verl_samples(path: Path, lines: list[tuple[int, dict]], benchmark: str, notes: list[str]) -> list[Sample]:
    for line_no, record in lines:
        if "acc" not in record:
            raise EvaluationError(f"{path}:{line_no}: verl dump line without 'acc' (correctness); use a reward "
                                  "that returns acc, such as amir_calibrated")
    has_uid = [("uid" in record) for _, record in lines]
    if any(has_uid) and not all(has_uid):
        line_no = lines[has_uid.index(False)][0]
        raise EvaluationError(f"{path}:{line_no}: line without 'uid' in a dump whose other lines have one")
    if all(has_uid):
        keys = [str(record["uid"]) for _, record in lines]
        seen: dict[str, int] = {}
        for (line_no, _), key in zip(lines, keys):
            if key in seen:
                raise EvaluationError(f"{path}:{line_no}: duplicate uid {key!r} (first at line {seen[key]})")
            seen[key] = line_no
        try:
            keep = final_session_outputs(keys)
        except EvaluationError as error:
            line_no = next(n for (n, _), k in zip(lines, keys) if not _SESSION_KEY.match(k))
            raise EvaluationError(f"{path}:{line_no}: {error}") from None
        if len(keep) < len(lines):
            notes.append(f"{path}: {len(lines) - len(keep)} earlier output(s) of multi-output sessions not "
                         f"counted: each session counts once, by its final output, as in verl")
        lines = [lines[i] for i in keep]
    samples = []
    for line_no, record in lines:
        where = f"{path}:{line_no}"
        problem = record.get("problem_id")
        if problem in (None, ""):
            if "uid" not in record:
                raise EvaluationError(f"{where}: neither problem_id nor uid: the problem of the line is unknown "
                                      "(V0 dumps need a reward that returns problem_id, such as amir_calibrated)")
            problem = "uid:" + _SESSION_KEY.match(str(record["uid"]))["prompt"]
        source = record.get("data_source") or benchmark
        samples.append(Sample(str(problem), str(source), _as_bool(record["acc"], where), str(record["output"]),
                              _confidence(record.get("confidence")), str(record["input"])))
    return samples


def _plain_samples(path: Path, lines: list[tuple[int, dict]]) -> list[Sample]:
    samples, seen = [], {}
    for line_no, record in lines:
        where = f"{path}:{line_no}"
        missing = [f for f in PLAIN_FIELDS if f not in record]
        if missing:
            raise EvaluationError(f"{where}: missing field(s) {missing}; each line needs {list(PLAIN_FIELDS)}")
        if "sample_id" in record:
            ident = (record["problem_id"], record["sample_id"])
            if ident in seen:
                raise EvaluationError(f"{where}: duplicate sample id {ident!r} (first at line {seen[ident]})")
            seen[ident] = line_no
        samples.append(Sample(str(record["problem_id"]), str(record["data_source"]),
                              _as_bool(record["correct"], where), str(record["response"]),
                              _confidence(record.get("confidence")), str(record.get("prompt", ""))))
    return samples


def load_run(path: str | Path, step: int | None = None, skip_malformed: bool = False,
             benchmark_of: dict[str, str] | None = None) -> LoadedRun:
    """A run from a verl dump folder (latest step unless ``step``), a verl dump file, or a plain JSONL.

    ``benchmark_of`` maps a dump file or folder to the benchmark of its lines that lack ``data_source``
    (default: the dump file's path).
    """
    given = Path(path)
    path = dump_file(given, step)
    lines, skipped = read_json_lines(path, skip_malformed)
    notes = [f"{path}: skipped {len(skipped)} malformed line(s): {', '.join(map(str, skipped))}"] if skipped else []
    if not lines:
        raise EvaluationError(f"{path} has no samples")
    benchmark = str(path)
    for key, name in (benchmark_of or {}).items():
        if Path(key).resolve() in (given.resolve(), path.resolve()):
            benchmark = name
    verl_lines = [("output" in record and "input" in record) for _, record in lines]
    if all(verl_lines):
        samples = _verl_samples(path, lines, benchmark, notes)
    elif not any(verl_lines):
        samples = _plain_samples(path, lines)
    else:
        line_no = lines[verl_lines.index(not verl_lines[0])][0]
        raise EvaluationError(f"{path}:{line_no}: verl dump lines (input/output) and plain lines mixed in one file")
    return LoadedRun(path, samples, notes)

