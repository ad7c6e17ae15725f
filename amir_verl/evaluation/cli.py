"""``amir-eval``: evaluation of verl validation dumps (or plain JSONL) in the paper's form.

    amir-eval passk --base GRPO=outputs/qwen2.5-3b_grpo/validation --other AMIR=outputs/qwen2.5-3b_amir_grpo/validation \\
        [--k 1 2 4] [--step N] [--out table1]

prints the unbiased pass@k per benchmark as "GRPO -> AMIR (+gain)" and writes ``<out>.csv`` and
``<out>.md``. ``amir-eval passk --base NAME=PATH`` alone prints one run's pass@k.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from amir_verl.evaluation.passk import (
    DISPLAY_NAMES,
    EvaluationError,
    benchmark_pass_at_k,
    comparison_rows,
    table1_markdown,
)
from amir_verl.evaluation.records import load_samples


def _named(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    return name, path


def run_passk(args) -> int:
    ks = sorted(set(args.k))
    base_name, base_path = args.base
    base = benchmark_pass_at_k(load_samples(base_path, args.step), ks)
    if args.other is None:
        print(f"| Benchmark ({base_name}) | " + " | ".join(f"pass@{k}" for k in ks) + " |")
        print("|---" * (len(ks) + 1) + "|")
        for source, per_k in base.items():
            print(f"| {DISPLAY_NAMES.get(source, source)} | " + " | ".join(f"{100 * per_k[k]:.1f}" for k in ks) + " |")
        return 0
    other_name, other_path = args.other
    other = benchmark_pass_at_k(load_samples(other_path, args.step), ks)
    rows = comparison_rows(base, other, ks)
    if not rows:
        raise EvaluationError(f"{base_name} and {other_name} share no benchmark")
    table = table1_markdown(rows, ks, base_name, other_name)
    print(table)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".md").write_text(table + "\n")
        with out.with_suffix(".csv").open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["benchmark", "k", f"{base_name}_pass_at_k_pct", f"{other_name}_pass_at_k_pct", "gain_pts"])
            writer.writerows([(name, k, f"{b:.4f}", f"{o:.4f}", f"{g:+.4f}") for name, k, b, o, g in rows])
        print(f"wrote {out.with_suffix('.csv')} and {out.with_suffix('.md')}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="amir-eval", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    passk = sub.add_parser("passk", help="unbiased pass@k per benchmark, Table 1 form for two runs")
    passk.add_argument("--base", type=_named, required=True, help="NAME=PATH (verl dump folder/file or JSONL)")
    passk.add_argument("--other", type=_named, help="NAME=PATH of the run to compare")
    passk.add_argument("--k", type=int, nargs="+", default=[1, 2, 4])
    passk.add_argument("--step", type=int, help="validation step of verl dump folders (default: latest)")
    passk.add_argument("--out", help="write <out>.csv and <out>.md")
    passk.set_defaults(func=run_passk)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (EvaluationError, FileNotFoundError) as error:
        print(f"amir-eval: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
