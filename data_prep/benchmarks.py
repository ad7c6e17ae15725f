"""The evaluation benchmarks -> verl parquet with amir-verl's prompt template.

    python data_prep/benchmarks.py --benchmark aime25 --out ~/data/amir_eval/aime25 [--local PATH]

Benchmarks (hub id, config, split): aime25 (math-ai/aime25, test), olympiadbench
(Hothan/OlympiadBench, OE_TO_maths_en_COMP, train), amc23 (math-ai/amc23, test), minerva
(math-ai/minervamath, test), aqua_rat (deepmind/aqua_rat, raw, test; options shown, gold = letter),
livemathbench (opencompass/LiveMathBench, v202412_AMC_en, test). ``--benchmark all`` writes each into
``--out/<name>/``. ``--local`` takes a json/jsonl/parquet file or folder in the dataset's own schema
(machines without internet). Records without an answer are reported by index and skipped.
"""

import argparse
from pathlib import Path

from amir_verl.datasets import SOURCES, prepare

BENCHMARKS = [name for name in SOURCES if name != "gsm8k"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--benchmark", required=True, choices=BENCHMARKS + ["all"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--local", type=Path, help="local file or folder instead of the hub (one benchmark)")
    args = parser.parse_args()
    if args.benchmark == "all":
        if args.local is not None:
            parser.error("--local names one benchmark's files; use it with a single --benchmark")
        for name in BENCHMARKS:
            prepare(name, args.out / name)
    else:
        prepare(args.benchmark, args.out, args.local)


if __name__ == "__main__":
    main()
