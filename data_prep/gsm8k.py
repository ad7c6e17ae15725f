"""GSM8K -> verl parquet with amir-verl's prompt template (verl's examples/data_preprocess/gsm8k.py schema).

    python data_prep/gsm8k.py --out ~/data/amir_gsm8k [--local PATH]

Loads ``openai/gsm8k`` (config ``main``) with ``datasets.load_dataset``, or a local json/jsonl/parquet
file or folder in the same schema (question, answer with a '#### N' line). Writes train.parquet and
test.parquet and prints the counts; a record without an answer is reported by index and skipped.
"""

import argparse
from pathlib import Path

from amir_verl.datasets import prepare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for train.parquet and test.parquet")
    parser.add_argument("--local", type=Path, help="local file or folder instead of the hub")
    parser.add_argument("--splits", nargs="+", default=None, help="default: train test")
    args = parser.parse_args()
    prepare("gsm8k", args.out, args.local, args.splits)


if __name__ == "__main__":
    main()
