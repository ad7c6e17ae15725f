"""Run every ``amir-eval`` command on synthetic validation dumps: what the tools print and draw.

    python examples/synthetic_eval.py --out docs/eval_examples

Writes three verl-style dumps (base, GRPO, AMIR: the same 3 x 40 problems, 8 samples each, drawn with
increasing skill), a tiny local model for the log-prob analyses, then the Table 1 form, the calibration,
length and coverage analyses, and the margin and self-perplexity analyses on a toy-task dump. The numbers
are synthetic: they show the output format, not any result.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from amir_verl.cpu.toy_task import make_assets
from amir_verl.evaluation.cli import main as amir_eval

SOURCES = ["openai/gsm8k", "math-ai/aime25", "deepmind/aqua_rat"]


def write_dump(path: Path, skill: float, seed: int) -> None:
    rng = random.Random(seed)
    lines = []
    for source in SOURCES:
        for problem in range(40):
            difficulty = random.Random(f"{source}{problem}").random()  # the same problems in every run
            for session in range(8):
                correct = rng.random() < max(0.0, skill - difficulty)
                confidence = min(1.0, max(0.0, skill - difficulty + rng.gauss(0, 0.2)))
                length = rng.randint(20, 60) if correct else rng.randint(30, 120)
                lines.append({"input": f"{source} problem {problem}", "output": " ".join(["step"] * length),
                              "gts": "", "score": float(correct), "step": 100, "acc": float(correct),
                              "data_source": source, "problem_id": str(problem), "confidence": round(confidence, 2),
                              "uid": f"p{problem}{source}_{session}_0"})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")


def write_toy_dump(path: Path) -> None:
    rng = random.Random(1)
    lines = []
    for problem in range(30):
        a, b = rng.randrange(10), rng.randrange(10)
        gold = (a + b) % 10
        skill = (0.0, 0.4, 1.0)[problem % 3]  # strata: none correct, mixed, all correct
        for session in range(8):
            digit = gold if rng.random() < skill else (gold + 1 + rng.randrange(9)) % 10
            lines.append({"input": f"q{problem} te: {a}+{b}=?\nA: ", "output": str(digit), "gts": str(gold),
                          "score": float(digit == gold), "step": 40, "acc": float(digit == gold),
                          "data_source": "amir_verl/toy_last_digit", "problem_id": str(problem),
                          "confidence": 0.5, "uid": f"u{problem}_{session}_0"})
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dumps = args.out / "dumps"
    for name, skill, seed in (("base", 0.45, 0), ("grpo", 0.6, 1), ("amir", 0.7, 2)):
        write_dump(dumps / name / "100.jsonl", skill, seed)
    model = make_assets(args.out / "toy", n_train=2, n_test=2)["model"]
    write_toy_dump(dumps / "toy.jsonl")
    commands = [
        ["passk", "--base", f"GRPO={dumps / 'grpo'}", "--other", f"AMIR={dumps / 'amir'}", "--out",
         str(args.out / "table1")],
        ["calibration", "--run", f"AMIR={dumps / 'amir'}", "--out", str(args.out)],
        ["lengths", "--run", f"AMIR={dumps / 'amir'}", "--out", str(args.out)],
        ["coverage", "--run", f"base={dumps / 'base'}", "--run", f"GRPO={dumps / 'grpo'}", "--run",
         f"AMIR={dumps / 'amir'}", "--out", str(args.out)],
        ["margin", "--run", f"AMIR={dumps / 'toy.jsonl'}", "--model", model, "--out", str(args.out)],
        ["perplexity", "--run", f"AMIR={dumps / 'toy.jsonl'}", "--model", model, "--out", str(args.out)],
    ]
    for command in commands:
        print(f"\n$ amir-eval {' '.join(command)}")
        assert amir_eval(command) == 0


if __name__ == "__main__":
    main()
