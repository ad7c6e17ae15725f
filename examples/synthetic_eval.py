"""Run every ``amir-eval`` command on synthetic validation dumps: what the tools print and draw.

    python examples/synthetic_eval.py --out docs/eval_examples

Writes verl validation dumps with verl's own writer: base, GRPO, AMIR (the same 3 x 40 problems, 8 samples
each, drawn with increasing skill and decreasing overconfidence), and two toy-task runs with a tiny local
model for the log-prob analyses; then runs pass@k in the Table 1 form (GRPO -> AMIR) and for all three
runs, and every comparison figure. The numbers are synthetic: they show the output format, not any result.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from amir_verl.demo.toy_task import make_assets
from amir_verl.evaluation.cli import main as amir_eval

SOURCES = ["openai/gsm8k", "math-ai/aime25", "deepmind/aqua_rat"]


def write_dump(folder: Path, lines: list[dict], step: int) -> None:
    """``<folder>/<step>.jsonl`` through verl's own validation-dump writer."""
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    extra = {key: [line[key] for line in lines] for key in lines[0] if key not in ("input", "output", "gts", "score")}
    PPOTrainer._write_generations([line["input"] for line in lines], [line["output"] for line in lines],
                                  [line["gts"] for line in lines], [line["score"] for line in lines], extra,
                                  str(folder), step)


def benchmark_lines(skill: float, overconfidence: float, no_confidence: float, seed: int) -> list[dict]:
    """3 x 40 problems (the same in every run), 8 samples each; a response states a confidence near its
    chance of being right plus ``overconfidence``, or none with probability ``no_confidence``."""
    rng = random.Random(seed)
    lines = []
    for source in SOURCES:
        for problem in range(40):
            difficulty = random.Random(f"{source}{problem}").random()
            for session in range(8):
                chance = max(0.0, skill - difficulty)
                correct = rng.random() < chance
                confidence = min(1.0, max(0.0, chance + overconfidence + rng.gauss(0, 0.15)))
                # stated confidences are round numbers, and 0.4 is rarely said: the [0.4, 0.5) bin stays empty
                confidence = round(confidence, 1) if round(confidence, 1) != 0.4 else 0.5
                if rng.random() < no_confidence:
                    confidence = -1.0  # the reward's mark for "no parseable confidence"
                length = rng.randint(20, 60) if correct else rng.randint(int(30 + 40 * skill), 160)
                lines.append({"input": f"{source} problem {problem}", "output": " ".join(["step"] * length),
                              "gts": "", "score": float(correct), "acc": float(correct), "data_source": source,
                              "problem_id": str(problem), "confidence": round(confidence, 2),
                              "uid": f"p{problem}{source}_{session}_0"})
    return lines


def toy_lines(skills: tuple[float, float, float], seed: int) -> list[dict]:
    """30 toy-task problems, 8 samples each; ``skills`` the chance of a right digit by problem % 3."""
    rng, problems = random.Random(seed), random.Random(1)
    lines = []
    for problem in range(30):
        a, b = problems.randrange(10), problems.randrange(10)
        gold = (a + b) % 10
        for session in range(8):
            digit = gold if rng.random() < skills[problem % 3] else (gold + 1 + rng.randrange(9)) % 10
            lines.append({"input": f"q{problem} te: {a}+{b}=?\nA: ", "output": str(digit), "gts": str(gold),
                          "score": float(digit == gold), "acc": float(digit == gold),
                          "data_source": "amir_verl/toy_last_digit", "problem_id": str(problem),
                          "confidence": 0.5, "uid": f"u{problem}_{session}_0"})
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dumps = args.out / "dumps"
    for name, skill, overconfidence, no_confidence, seed in (("base", 0.45, 0.3, 0.3, 0), ("grpo", 0.6, 0.15, 0.1, 1),
                                                              ("amir", 0.7, 0.05, 0.05, 2)):
        write_dump(dumps / name, benchmark_lines(skill, overconfidence, no_confidence, seed), step=100)
    model = make_assets(args.out / "toy", n_train=2, n_test=2)["model"]
    write_dump(dumps / "toy_grpo", toy_lines((0.0, 0.4, 1.0), seed=1), step=40)
    write_dump(dumps / "toy_amir", toy_lines((0.0, 0.6, 1.0), seed=2), step=40)
    runs = {name: f"{name}={dumps / folder}" for name, folder in (("base", "base"), ("GRPO", "grpo"), ("AMIR", "amir"))}
    toy = ["--run", f"GRPO={dumps / 'toy_grpo'}", "--run", f"AMIR={dumps / 'toy_amir'}",
           "--model", f"GRPO={model}", "--model", f"AMIR={model}"]
    out = ["--out", str(args.out), "--overwrite"]
    commands = [
        ["passk", "--run", runs["GRPO"], "--run", runs["AMIR"], *out],
        ["passk", "--run", runs["base"], "--run", runs["GRPO"], "--run", runs["AMIR"], *out],
        ["calibration", "--run", runs["GRPO"], "--run", runs["AMIR"], *out],
        ["lengths", "--run", runs["GRPO"], "--run", runs["AMIR"], *out],
        ["coverage", "--run", runs["base"], "--run", runs["GRPO"], "--run", runs["AMIR"], *out],
        ["margin", *toy, *out],
        ["perplexity", *toy, *out],
    ]
    for command in commands:
        print(f"\n$ amir-eval {' '.join(command)}")
        assert amir_eval(command) == 0


if __name__ == "__main__":
    main()
