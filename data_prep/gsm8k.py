"""GSM8K -> verl parquet with amir-verl's prompt template, in amir_verl.datasets.ROW_SCHEMA.

    python data_prep/gsm8k.py --out ~/data/amir/gsm8k [--local FOLDER | --local train=FILE test=FILE]
                              [--splits train test]

Loads ``openai/gsm8k`` (config ``main``) with ``datasets.load_dataset``, or local json/jsonl/parquet/csv
files in the same schema (question, answer with a '#### N' line). ``--local`` maps files to splits
explicitly: a FOLDER's files by name (``train.jsonl``, ``test-00000-of-00001.parquet``, ``test/...``),
or ``SPLIT=PATH`` for a file or folder; a bare file is refused, and a split that is asked for (``--splits``,
default train and test) but not in the input is an error. Writes ``<split>.parquet`` for each split,
``ground_truth`` = [the number after '####'].

Bad input (missing column, record without an answer, empty file, non-UTF-8, malformed JSON lines) exits 1
with one line on stderr naming the file, the record and the column; nothing is written.
"""

import argparse
from pathlib import Path

from amir_verl.datasets import LOCAL_HELP, prepare_or_exit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for <split>.parquet")
    parser.add_argument("--local", nargs="+", metavar="[SPLIT=]PATH", help=LOCAL_HELP)
    parser.add_argument("--splits", nargs="+", default=None, help="default: train test")
    args = parser.parse_args()
    prepare_or_exit("gsm8k", args.out, args.local, args.splits)


if __name__ == "__main__":
    main()
