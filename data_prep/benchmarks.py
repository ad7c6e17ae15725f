"""The evaluation benchmarks -> verl parquet with amir-verl's prompt template, in amir_verl.datasets.ROW_SCHEMA.

    python data_prep/benchmarks.py --benchmark aime25 --out ~/data/amir/eval/aime25 [--local [SPLIT=]PATH]

Benchmarks (hub id, config, split): aime25 (math-ai/aime25, test), olympiadbench
(Hothan/OlympiadBench, OE_TO_maths_en_COMP, train), amc23 (math-ai/amc23, test), minerva
(math-ai/minervamath, test), aqua_rat (deepmind/aqua_rat, raw, test; options shown, gold = letter),
livemathbench (opencompass/LiveMathBench, v202412_AMC_en, test). Each writes ``--out/<split>.parquet``
with that split's name; ``--benchmark all`` writes each into ``--out/<name>/`` from the hub.

``--local`` (one benchmark; machines without internet) takes files in the dataset's own schema
(json/jsonl/parquet/csv): a FOLDER whose file is named after the split (``test.jsonl``,
``train-00000-of-00001.parquet`` for olympiadbench, ...), or ``SPLIT=PATH`` for a file or folder
(``--local test=aime25.jsonl``); a bare file is refused. Every record must have its answer: bad input
exits 1 with one line on stderr naming the file, the record and the column, and nothing is written.
"""

import argparse
from pathlib import Path

from amir_verl.datasets import LOCAL_HELP, SOURCES, prepare_or_exit

BENCHMARKS = [name for name in SOURCES if name != "gsm8k"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--benchmark", required=True, choices=BENCHMARKS + ["all"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--local", nargs="+", metavar="[SPLIT=]PATH", help=LOCAL_HELP + " (one benchmark)")
    args = parser.parse_args()
    if args.benchmark == "all":
        if args.local is not None:
            parser.error("--local names one benchmark's files; use it with a single --benchmark")
        for name in BENCHMARKS:
            prepare_or_exit(name, args.out / name, None)
    else:
        prepare_or_exit(args.benchmark, args.out, args.local)


if __name__ == "__main__":
    main()
