"""``amir-eval``: evaluation of verl validation dumps (or plain JSONL) in the paper's form.

    amir-eval passk --base GRPO=outputs/qwen2.5-3b_grpo/validation --other AMIR=outputs/qwen2.5-3b_amir_grpo/validation \\
        [--k 1 2 4] [--step N] [--out table1]

prints the unbiased pass@k per benchmark as "GRPO -> AMIR (+gain)" and writes ``<out>.csv`` and
``<out>.md``. ``amir-eval passk --base NAME=PATH`` alone prints one run's pass@k. The analyses
(:mod:`amir_verl.evaluation.analyses`) each write a CSV and a PNG into ``--out``:

    amir-eval calibration --run AMIR=PATH --out DIR
    amir-eval lengths     --run AMIR=PATH --out DIR [--tokenizer MODEL]
    amir-eval coverage    --run base=PATH --run GRPO=PATH --run AMIR=PATH --out DIR
    amir-eval margin      --run AMIR=PATH --model MODEL --out DIR [--device cuda]
    amir-eval perplexity  --run AMIR=PATH --model MODEL --out DIR [--device cuda]
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


def _out_dir(args) -> Path:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return out


def _written(*paths: Path) -> None:
    print("wrote " + ", ".join(str(p) for p in paths))


def run_calibration(args) -> int:
    from amir_verl.evaluation import analyses

    name, path = args.run
    table, summary = analyses.calibration(load_samples(path, args.step), bins=args.bins)
    out = _out_dir(args)
    table.to_csv(out / "calibration.csv", index=False)
    analyses.plot_calibration(table, summary, name, out / "calibration.png")
    print(f"{name}: Brier {summary['brier']:.4f}  ECE {summary['ece']:.4f}  n={summary['n']}  "
          f"without confidence: {summary['missing_confidence']}")
    _written(out / "calibration.csv", out / "calibration.png")
    return 0


def run_lengths(args) -> int:
    from amir_verl.evaluation import analyses

    _, path = args.run
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    table = analyses.response_lengths(load_samples(path, args.step), tokenizer)
    out = _out_dir(args)
    table.to_csv(out / "lengths.csv", index=False)
    analyses.plot_lengths(table, "tokens" if tokenizer else "words", out / "lengths.png")
    print(table.to_string(index=False))
    _written(out / "lengths.csv", out / "lengths.png")
    return 0


def run_coverage(args) -> int:
    from amir_verl.evaluation import analyses

    runs = {name: load_samples(path, args.step) for name, path in args.run}
    if len(runs) < 2:
        raise EvaluationError("coverage compares runs: give --run at least twice (e.g. base, GRPO, AMIR)")
    table = analyses.coverage(runs)
    patterns = analyses.coverage_patterns(runs)
    out = _out_dir(args)
    table.to_csv(out / "coverage.csv", index=False)
    patterns.to_csv(out / "coverage_patterns.csv", index=False)
    analyses.plot_coverage(table, list(runs), out / "coverage.png")
    print(table.to_string(index=False))
    print(f"\nTable 2 form ({'/'.join(runs)}: Y solved, N not; % of problems any run solves)")
    print(patterns.pivot(index="pattern", columns="benchmark", values="percent_of_solvable").round(1).to_string())
    _written(out / "coverage.csv", out / "coverage_patterns.csv", out / "coverage.png")
    return 0


def run_logprob_analysis(args) -> int:
    from amir_verl.evaluation import analyses

    name, path = args.run
    samples = load_samples(path, args.step)
    model, tokenizer = analyses.load_model(args.model, args.device, args.dtype)
    out = _out_dir(args)
    if args.command == "margin":
        table, summary = analyses.preference_margin(samples, model, tokenizer, args.device)
        table.to_csv(out / "margin.csv", index=False)
        analyses.plot_margin(table, summary, name, out / "margin.png")
        print(f"{name}: mean preference margin {summary['mean_margin']:.4f} over "
              f"{summary['problems_with_both']} problems with correct and incorrect responses")
        _written(out / "margin.csv", out / "margin.png")
    else:
        table = analyses.self_perplexity(samples, model, tokenizer, args.device)
        table.to_csv(out / "perplexity.csv", index=False)
        analyses.plot_perplexity(table, name, out / "perplexity.png")
        print(table.groupby("stratum")["perplexity"].describe().to_string())
        _written(out / "perplexity.csv", out / "perplexity.png")
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

    def analysis(name: str, help: str, func, many: bool = False):
        cmd = sub.add_parser(name, help=help)
        if many:
            cmd.add_argument("--run", type=_named, action="append", required=True, help="NAME=PATH, repeat")
        else:
            cmd.add_argument("--run", type=_named, required=True, help="NAME=PATH")
        cmd.add_argument("--step", type=int, help="validation step of verl dump folders (default: latest)")
        cmd.add_argument("--out", required=True, help="folder for the CSV and the PNG")
        cmd.set_defaults(func=func)
        return cmd

    analysis("calibration", "Brier score, ECE and reliability diagram", run_calibration).add_argument(
        "--bins", type=int, default=10)
    analysis("lengths", "length of incorrect vs correct responses", run_lengths).add_argument(
        "--tokenizer", help="count tokens of this tokenizer (default: words)")
    analysis("coverage", "solvable-set coverage across runs (Table 2)", run_coverage, many=True)
    for name, help in (("margin", "preference margin under a model"),
                       ("perplexity", "self-perplexity by problem stratum (give the generating model)")):
        cmd = analysis(name, help, run_logprob_analysis)
        cmd.add_argument("--model", required=True, help="HF model path")
        cmd.add_argument("--device", default="cpu")
        cmd.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
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
