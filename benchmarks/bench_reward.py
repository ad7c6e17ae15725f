"""Throughput of the calibrated reward, single process: responses per second.

    python benchmarks/bench_reward.py [--n 2000]

Three workloads: GSM8K-style numeric answers, math-verify answers (LaTeX fractions, roots, intervals;
each call time-bounded in the helper process), and AQUA-RAT letters. Half the responses are right,
a quarter malformed.
"""

from __future__ import annotations

import argparse
import random
import time

from amir_verl.reward import compute_score


def responses(kind: str, n: int, seed: int = 0) -> list[tuple[str, str, object]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if kind == "gsm8k":
            gold = str(rng.randrange(1, 100000))
            answer = f"${int(gold):,}" if i % 2 == 0 else str(int(gold) + 1)
            source = "openai/gsm8k"
        elif kind == "math":
            a, b = rng.randrange(1, 50), rng.randrange(51, 100)
            gold = rng.choice([f"\\frac{{{a}}}{{{b}}}", f"\\sqrt{{{a}}}", f"[{a}, {b})", f"{a}x^2 + {b}"])
            answer = gold if i % 2 == 0 else gold.replace(str(a), str(a + 1), 1)
            answer = f"\\boxed{{{answer}}}" if i % 3 == 0 else answer
            source = "math-ai/minervamath"
        else:
            gold = rng.choice("ABCDE")
            answer = f"({gold})" if i % 2 == 0 else "Z"
            source = "deepmind/aqua_rat"
        text = f"<think> step {i} </think> <answer> {answer} </answer> <confidence> {rng.random():.2f} </confidence>"
        if i % 4 == 3:
            text = text.replace("</answer>", "")  # malformed
        out.append((source, text, gold))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2000)
    args = p.parse_args()
    compute_score("math-ai/minervamath", "<answer>1</answer>", "1")  # start the math-verify helper once
    for kind in ("gsm8k", "math", "aqua_rat"):
        batch = responses(kind, args.n)
        start = time.perf_counter()
        correct = sum(compute_score(source, text, gold)["acc"] for source, text, gold in batch)
        elapsed = time.perf_counter() - start
        print(f"{kind:<9} {args.n / elapsed:10.0f} responses/s   ({args.n} in {elapsed:.2f} s, {correct:.0f} correct)")


if __name__ == "__main__":
    main()
