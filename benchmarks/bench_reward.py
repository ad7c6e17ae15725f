"""Throughput of the calibrated reward, and what one pathological response costs the others.

    python benchmarks/bench_reward.py [--n 1000] [--reps 5] [--budget 5] [--record]

1. responses/s in one thread for three workloads: GSM8K-style numbers, math-verify answers (LaTeX
   fractions, roots, intervals; each time-bounded in a helper process) and AQUA-RAT letters. Half the
   responses are right, a quarter malformed.
2. math-verify responses/s with 1 and with 2 grading threads (verl's reward loop grades from a thread
   pool), alternating 1 and 2 threads ``--reps`` times: each repetition's ratio and their median.
3. Blocking: one thread grades a pathological response that uses up its whole budget while another
   grades ordinary math-verify responses; the time those lose against grading them alone.

``--record`` also writes the output to docs/results/bench_reward.md (:mod:`amir_verl.results_page`).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from amir_verl.results_page import print_or_record
from amir_verl.reward import compute_score
from amir_verl.reward.bounded import available_cores, pool_size

# a tower sympy evaluates for longer than any budget (((9!)!)! gives up after about 2 s: not a full budget)
PATHOLOGICAL = "<think> x </think> <answer> 9^{9^{9^{9}}} </answer> <confidence> 0.5 </confidence>"


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
        out.append((source, text, [gold]))
    return out


def grade_all(batch, threads: int) -> float:
    """Seconds to grade ``batch`` with ``threads`` threads (as verl's reward loop: an executor)."""
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as executor:
        list(executor.map(lambda item: compute_score(*item), batch))
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--reps", type=int, default=5, help="alternating 1- and 2-thread repetitions")
    p.add_argument("--budget", type=float, default=5.0, help="math_timeout_s of the pathological response")
    p.add_argument("--record", action="store_true", help="also write the output to docs/results/bench_reward.md")
    args = p.parse_args()
    print_or_record('bench_reward' if args.record else None, lambda: report(args))


def report(args) -> None:
    print(f"cores {available_cores()}, helpers {pool_size()}, load {os.getloadavg()[0]:.1f}")
    grade_all(responses("math", 2 * pool_size()), pool_size())  # start every helper once

    for kind in ("gsm8k", "math", "aqua_rat"):
        elapsed = grade_all(responses(kind, args.n), 1)
        print(f"{kind:<9} 1 thread  {args.n / elapsed:8.0f} responses/s")

    math = responses("math", args.n, seed=1)
    ones, twos = [], []
    for _ in range(args.reps):  # alternating, so drifting load hits both alike
        ones.append(grade_all(math, 1))
        twos.append(grade_all(math, 2))
    ratios = [one / two for one, two in zip(ones, twos)]
    print(f"math-verify: 1 thread {args.n / statistics.median(ones):.0f} responses/s, "
          f"2 threads {args.n / statistics.median(twos):.0f} responses/s (medians of {args.reps}); "
          f"2/1 ratio median {statistics.median(ratios):.2f}, per repetition "
          + ", ".join(f"{r:.2f}" for r in ratios))

    ordinary = responses("math", 200, seed=2)
    alone = grade_all(ordinary, 1)
    slow = threading.Thread(target=compute_score, args=("math-ai/aime25", PATHOLOGICAL, ["5"]),
                            kwargs={"math_timeout_s": args.budget})
    started = time.perf_counter()
    slow.start()
    beside = grade_all(ordinary, 1)
    slow.join()
    pathological = time.perf_counter() - started
    print(f"blocking: 200 ordinary responses took {alone:.2f} s alone and {beside:.2f} s beside a pathological one "
          f"({pathological:.2f} s, budget {args.budget:.0f} s): lost {beside - alone:+.2f} s = "
          f"{100 * (beside - alone) / args.budget:+.1f}% of the budget")


if __name__ == "__main__":
    main()
