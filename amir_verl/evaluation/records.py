"""Read graded samples: verl's validation dumps or a plain JSONL.

- verl (``trainer.validation_data_dir``): one ``<step>.jsonl`` per validation, a line per sample with
  ``input``, ``output``, ``score``, ``uid`` (``{prompt uid}_{session}_{index}``) and the reward's extra
  fields. amir-verl's reward adds ``acc``, ``data_source``, ``problem_id`` and ``confidence``; with
  another reward, ``acc`` must be there and the problem is identified by its prompt text.
A problem is identified by (data_source, problem_id): ids only need to be unique within a benchmark.
- plain JSONL: ``problem_id``, ``data_source``, ``response``, ``correct`` per line (``sample_id``,
  ``confidence`` and ``prompt`` optional; the log-prob analyses need ``prompt``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from amir_verl.evaluation.passk import EvaluationError, Sample

PLAIN_FIELDS = ("problem_id", "data_source", "response", "correct")


def _latest_dump(folder: Path, step: int | None) -> Path:
    files = {int(p.stem): p for p in folder.glob("*.jsonl") if p.stem.isdigit()}
    if not files:
        raise EvaluationError(f"{folder} has no verl validation dump (<step>.jsonl)")
    if step is None:
        return files[max(files)]
    if step not in files:
        raise EvaluationError(f"{folder} has no dump of step {step}; steps: {sorted(files)}")
    return files[step]


def _as_bool(value, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    raise EvaluationError(f"{where}: correctness must be true/false or 0/1, got {value!r}")


def load_samples(path: str | Path, step: int | None = None) -> list[Sample]:
    """Samples from a verl dump folder (latest step unless ``step``), a verl dump file, or a plain JSONL."""
    path = Path(path)
    if path.is_dir():
        path = _latest_dump(path, step)
    if not path.exists():
        raise EvaluationError(f"{path} does not exist")
    samples, seen = [], {}
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{line_no}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise EvaluationError(f"{where}: not JSON ({error})") from None
        if "output" in record and "input" in record:  # a verl dump line
            if "acc" not in record:
                raise EvaluationError(f"{where}: verl dump line without 'acc' (correctness); use a reward that "
                                      "returns acc, such as amir_calibrated")
            ident = record.get("uid")
            problem = str(record.get("problem_id") or hashlib.sha1(record["input"].encode()).hexdigest()[:12])
            source = str(record.get("data_source") or "unknown")
            sample = Sample(problem, source, _as_bool(record["acc"], where), record["output"],
                            _confidence(record.get("confidence")), record["input"])
        else:
            missing = [f for f in PLAIN_FIELDS if f not in record]
            if missing:
                raise EvaluationError(f"{where}: missing field(s) {missing}; each line needs {list(PLAIN_FIELDS)}")
            ident = (record["problem_id"], record["sample_id"]) if "sample_id" in record else None
            problem, source = str(record["problem_id"]), str(record["data_source"])
            sample = Sample(problem, source, _as_bool(record["correct"], where), str(record["response"]),
                            _confidence(record.get("confidence")), str(record.get("prompt", "")))
        if ident is not None:
            if ident in seen:
                raise EvaluationError(f"{where}: duplicate sample id {ident!r} (first at line {seen[ident]})")
            seen[ident] = line_no
        samples.append(sample)
    if not samples:
        raise EvaluationError(f"{path} has no samples")
    return samples


def _confidence(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and 0 <= value <= 1 else None
