"""Generated problems for the paper's pipeline at miniature: GSM8K and the seven evaluation sets, each in its
dataset's own raw (hub) schema, so that ``data_prep --local`` reads them exactly as it reads the real files.

Every problem is a one-step addition or subtraction word problem written by :func:`word_problem` from a
seeded generator: no text comes from the datasets. The same generator writes the cold start's worked
answers (:func:`worked_answer`, in amir-verl's template), so a small model can learn the format first.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Femi", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lena", "Mo", "Nia")
THINGS = ("apples", "pencils", "stickers", "marbles", "books", "coins", "shells", "cards", "stamps", "beads")
EVAL_FILES = {  # benchmark -> its raw file, named as --local FOLDER finds the split (amir_verl.datasets)
    "aime25": "test.jsonl", "olympiadbench": "train.jsonl", "amc23": "test.jsonl", "minerva": "test.jsonl",
    "aqua_rat": "test.jsonl", "livemathbench": "test.jsonl",
}
CONFIDENCE = 0.9  # what every cold-start answer states: calibration is left for RL to learn


@dataclass(frozen=True)
class WordProblem:
    question: str
    a: int
    op: str  # "+" or "-"
    b: int

    @property
    def answer(self) -> int:
        return self.a + self.b if self.op == "+" else self.a - self.b


def word_problem(rng: random.Random, padding_sentences: int = 0) -> WordProblem:
    """One problem; ``padding_sentences`` adds that many sentences of irrelevant context (over-long prompts)."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(5, 60), rng.randint(2, 30)
    if rng.random() < 0.5:
        text, op = f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?", "+"
    else:
        a = max(a, b + rng.randint(1, 20))
        text, op = f"{name} had {a} {thing} and gave away {b}. How many {thing} does {name} have left?", "-"
    context = " ".join(f"On day {i + 1} the weather was {rng.choice(('sunny', 'cloudy', 'windy'))}."
                       for i in range(padding_sentences))
    return WordProblem(f"{context} {text}".strip(), a, op, b)


def worked_answer(problem: WordProblem) -> str:
    """The response the cold start teaches, in the exact layout the reward parses."""
    return (f"<think> {problem.a} {problem.op} {problem.b} = {problem.answer} </think> "
            f"<answer> {problem.answer} </answer> <confidence> {CONFIDENCE} </confidence>")


def _gsm8k(p: WordProblem, i: int) -> dict:
    return {"question": p.question, "answer": f"{p.a} {p.op} {p.b} = {p.answer}\n#### {p.answer}"}


def _aqua(p: WordProblem, i: int, rng: random.Random) -> dict:
    values = sorted({p.answer, *(p.answer + d for d in rng.sample([-3, -2, -1, 1, 2, 3, 4], 4))})[:5]
    letters = "ABCDE"
    return {"question": p.question, "options": [f"{letters[k]}){v}" for k, v in enumerate(values)],
            "rationale": f"{p.a} {p.op} {p.b} = {p.answer}", "correct": letters[values.index(p.answer)]}


def raw_record(benchmark: str, p: WordProblem, i: int, rng: random.Random) -> dict:
    """One problem in ``benchmark``'s hub schema (the columns amir_verl.datasets reads)."""
    if benchmark == "gsm8k":
        return _gsm8k(p, i)
    if benchmark == "aime25":
        return {"id": f"gen-{i}", "problem": p.question, "answer": str(p.answer)}
    if benchmark == "olympiadbench":
        return {"id": 1000 + i, "question": p.question, "context": None, "final_answer": [f"${p.answer}$"],
                "unit": None}
    if benchmark == "amc23":
        return {"id": i, "question": p.question, "answer": float(p.answer), "url": "generated"}
    if benchmark == "minerva":
        return {"question": p.question, "answer": str(p.answer)}
    if benchmark == "aqua_rat":
        return _aqua(p, i, rng)
    if benchmark == "livemathbench":
        return {"question": p.question, "answer": f"${p.answer}$", "question_type": "Problem-Solving"}
    raise ValueError(f"unknown benchmark {benchmark!r}")


def _write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def write_raw_datasets(root: Path, n_train: int, n_gsm8k_test: int, n_eval: int, seed: int = 0,
                       overlong: dict[str, int] | None = None, padding_sentences: int = 120) -> dict[str, Path]:
    """Write ``root/<name>/<split file>`` for gsm8k (train, test) and every evaluation benchmark.

    ``overlong`` maps a benchmark to how many extra problems get ``padding_sentences`` of context (prompts
    longer than the recipe's ``max_prompt_length``, which verl's filter drops). Returns {name: folder}."""
    rng = random.Random(seed)
    overlong = overlong or {}
    folders = {}
    gsm8k = root / "gsm8k"
    _write_jsonl(gsm8k / "train.jsonl", [_gsm8k(word_problem(rng), i) for i in range(n_train)])
    tests = [word_problem(rng) for _ in range(n_gsm8k_test)]
    tests += [word_problem(rng, padding_sentences) for _ in range(overlong.get("gsm8k", 0))]
    _write_jsonl(gsm8k / "test.jsonl", [_gsm8k(p, i) for i, p in enumerate(tests)])
    folders["gsm8k"] = gsm8k
    for name, file in EVAL_FILES.items():
        problems = [word_problem(rng) for _ in range(n_eval)]
        problems += [word_problem(rng, padding_sentences) for _ in range(overlong.get(name, 0))]
        _write_jsonl(root / name / file, [raw_record(name, p, i, rng) for i, p in enumerate(problems)])
        folders[name] = root / name
    return folders


def cold_start_examples(n: int, seed: int) -> list[tuple[str, str]]:
    """``n`` (question, worked answer) pairs from a generator seeded apart from the datasets'."""
    rng = random.Random(f"cold-start-{seed}")
    return [(p.question, worked_answer(p)) for p in (word_problem(rng) for _ in range(n))]
