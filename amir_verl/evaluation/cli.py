"""``amir-eval``: evaluation of verl validation dumps (or plain JSONL) in the paper's form.

    amir-eval passk --run GRPO=outputs/qwen2.5-3b_grpo/validation --run AMIR=outputs/qwen2.5-3b_amir_grpo/validation \\
        [--k 1 2 4] [--step N] [--out DIR]

prints the unbiased pass@k per benchmark, the first run the baseline: one run's pass@k; for two runs the
paper's Table 1 form "GRPO -> AMIR (+gain)"; for more, a column group per k with each run's pass@k and its
gain in points over the first. The analyses (:mod:`amir_verl.evaluation.analyses`) draw every ``--run`` in
one figure. Every command writes ``<out>/<command>_<run>_vs_<run>...`` (passk: ``.csv`` and ``.md``, only
with ``--out``; the analyses: ``.csv`` and ``.png``):

    amir-eval calibration --run GRPO=PATH --run AMIR=PATH --out DIR
    amir-eval lengths     --run GRPO=PATH --run AMIR=PATH --out DIR [--tokenizer MODEL]
    amir-eval coverage    --run base=PATH --run GRPO=PATH --run AMIR=PATH --out DIR
    amir-eval margin      --run GRPO=PATH --run AMIR=PATH --model GRPO=MODEL --model AMIR=MODEL --out DIR [--device cuda]
    amir-eval perplexity  --run GRPO=PATH --run AMIR=PATH --model GRPO=MODEL --model AMIR=MODEL --out DIR [--device cuda]

(``margin`` and ``perplexity`` score the same responses under the same models: ``--score-cache DIR`` on both
scores them once, :mod:`amir_verl.evaluation.scores`.)

Runs are compared over the problems they all share (``--all-problems`` keeps the others); what is left
out, and which run lacked it, is printed. An existing output file is an error unless ``--overwrite``.

Exit status: 0 done; 2 bad input or usage; 3 nothing to measure (the runs are well formed, but the analysis
has no case to measure, such as ``margin`` without a problem that has both a correct and an incorrect
response; no file is written).
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from pathlib import Path

import pandas as pd

from amir_verl.evaluation.passk import (
    NOTHING_TO_MEASURE,
    NOTHING_TO_MEASURE_PREFIX,
    EvaluationError,
    NothingToMeasure,
    align_runs,
    benchmark_pass_at_k,
    comparison_rows,
    passk_csv_rows,
    passk_markdown,
)
from amir_verl.evaluation.records import load_run
from amir_verl.evaluation.scores import response_scores


def _named(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    return name, path


def _outputs(args, analysis: str, names: list[str], suffixes: tuple[str, ...]) -> list[Path]:
    """``<out>/<analysis>_<run>_vs_<run>...<suffix>``; an existing file is an error unless --overwrite."""
    out = Path(args.out)
    stem = f"{analysis}_" + "_vs_".join(re.sub(r"[^A-Za-z0-9.+-]+", "-", name) for name in names)
    paths = [out / f"{stem}{suffix}" for suffix in suffixes]
    existing = [str(p) for p in paths if p.exists()]
    if existing and not args.overwrite:
        raise EvaluationError(f"{', '.join(existing)} exist(s); --overwrite replaces, or choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    return paths


def _written(*paths: Path) -> None:
    print("wrote " + ", ".join(str(p) for p in paths))


def _load_runs(args, pairs: list[tuple[str, str]]) -> dict[str, list]:
    """Each named run's samples, over the problems all runs share (unless --all-problems); what reading
    and aligning left out is printed as notes."""
    names = [name for name, _ in pairs]
    if len(set(names)) < len(names):
        raise EvaluationError(f"run names must differ, got {names}")
    benchmark_of = dict(args.benchmark_of or [])
    runs = {}
    for name, path in pairs:
        loaded = load_run(path, args.step, args.skip_malformed, benchmark_of)
        for note in loaded.notes:
            print(f"note: {name}: {note}")
        runs[name] = loaded.samples
    aligned, notes = align_runs(runs, args.all_problems)
    for note in notes:
        print(f"note: {note}")
    return aligned


def run_passk(args) -> int:
    ks = sorted(set(args.k))
    runs = _load_runs(args, args.run)
    results = {}
    for name, samples in runs.items():
        try:
            results[name] = benchmark_pass_at_k(samples, ks)
        except EvaluationError as error:
            raise EvaluationError(f"{name}: {error}") from None
    rows = comparison_rows(results, ks)
    if not rows:
        raise EvaluationError(f"runs {', '.join(runs)} share no benchmark")
    paths = _outputs(args, "passk", list(runs), (".csv", ".md")) if args.out else ()
    table = passk_markdown(rows, ks, list(runs))
    print(table)
    if paths:
        csv_path, md = paths
        md.write_text(table + "\n", encoding="utf-8")
        with csv_path.open("w", newline="", encoding="utf-8") as f:
            csv.writer(f).writerows(passk_csv_rows(rows, list(runs)))
        _written(csv_path, md)
    return 0


BRIER_DEFINITIONS = (
    "Brier (stated) = mean (acc - confidence)^2 over responses stating a confidence; Brier (missing as 1) "
    "counts a response without one as 1, as amir-verl's reward logs brier; ECE over responses stating one"
)


def run_calibration(args) -> int:
    from amir_verl.evaluation import analyses

    runs = _load_runs(args, args.run)
    per_run = {name: analyses.calibration(samples, bins=args.bins) for name, samples in runs.items()}
    csv_path, png = _outputs(args, "calibration", list(runs), (".csv", ".png"))
    pd.concat([table.assign(run=name) for name, (table, _) in per_run.items()]).to_csv(csv_path, index=False)
    analyses.plot_calibration(per_run, png)
    print(BRIER_DEFINITIONS)
    for name, (_, s) in per_run.items():
        print(f"{name}: Brier (stated) {s['brier_stated']:.4f} over {s['stated']}  Brier (missing as 1) "
              f"{s['brier_missing_as_1']:.4f} over {s['n']}  ECE {s['ece']:.4f}  without confidence: "
              f"{s['missing_confidence']}")
    _written(csv_path, png)
    return 0


def run_lengths(args) -> int:
    from amir_verl.evaluation import analyses

    runs = _load_runs(args, args.run)
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    table = pd.concat([analyses.response_lengths(samples, tokenizer).assign(run=name)
                       for name, samples in runs.items()])
    table = table[["run", "benchmark", "correct", "count", "mean", "median"]]
    csv_path, png = _outputs(args, "lengths", list(runs), (".csv", ".png"))
    table.to_csv(csv_path, index=False)
    analyses.plot_lengths(table, "tokens" if tokenizer else "words", png)
    print(table.to_string(index=False))
    _written(csv_path, png)
    return 0


def run_coverage(args) -> int:
    from amir_verl.evaluation import analyses

    if len(args.run) < 2:
        raise EvaluationError("coverage compares runs: give --run at least twice (e.g. base, GRPO, AMIR)")
    runs = _load_runs(args, args.run)
    table, patterns = analyses.coverage(runs), analyses.coverage_patterns(runs)
    csv_path, patterns_csv, png = _outputs(args, "coverage", list(runs), (".csv", "_patterns.csv", ".png"))
    table.to_csv(csv_path, index=False)
    patterns.to_csv(patterns_csv, index=False)
    analyses.plot_coverage(patterns, list(runs), png)
    print(table.to_string(index=False))
    print(f"\nTable 2 form ({'/'.join(runs)}: Y solved, N not; % of problems some run solves)")
    print(patterns.pivot(index="pattern", columns="benchmark", values="percent_of_solvable")
          .reindex(index=list(dict.fromkeys(patterns["pattern"])), columns=list(dict.fromkeys(patterns["benchmark"])))
          .round(1).to_string())
    _written(csv_path, patterns_csv, png)
    return 0


def run_logprob_analysis(args) -> int:
    from amir_verl.evaluation import analyses

    runs = _load_runs(args, args.run)
    models = dict(args.model)
    unknown, lacking = sorted(set(models) - set(runs)), [name for name in runs if name not in models]
    if unknown or lacking:
        problems = ([f"no run {unknown}"] if unknown else []) + ([f"no model for {lacking}"] if lacking else [])
        raise EvaluationError(f"--model NAME=PATH names each run's model: {'; '.join(problems)}")
    strata = analyses.problem_strata(runs)
    results = {}
    for name, samples in runs.items():
        def score(pairs: list[tuple[str, str]], path: str = models[name]) -> list[float]:
            model, tokenizer = analyses.load_model(path, args.device, args.dtype)  # only when a score is missing
            return analyses.mean_response_log_probs(model, tokenizer, pairs, args.device, progress=print)

        scores, reused = response_scores(samples, models[name], score, args.score_cache, args.dtype, args.device)
        if args.score_cache:
            print(f"{name}: {reused} of {len(samples)} scores from {args.score_cache}")
        if args.command == "margin":
            results[name] = analyses.preference_margin(samples, scores)
        else:
            results[name] = analyses.self_perplexity(samples, strata, scores)
    if args.command == "margin" and not any(summary["problems_with_both"] for _, summary in results.values()):
        raise NothingToMeasure("no problem has both a correct and an incorrect response in any run: no margin")
    if args.command == "perplexity" and all(table.empty for table in results.values()):
        raise NothingToMeasure("no response was scored (every response is empty): no perplexity")
    csv_path, png = _outputs(args, args.command, list(runs), (".csv", ".png"))
    if args.command == "margin":
        pd.concat([table.assign(run=name) for name, (table, _) in results.items()]).to_csv(csv_path, index=False)
        analyses.plot_margin(results, png)
        for name, (_, summary) in results.items():
            print(f"{name}: mean preference margin {summary['mean_margin']:.4f}, pair accuracy "
                  f"{summary['mean_pair_accuracy']:.3f}, over {summary['problems_with_both']} problems with correct "
                  "and incorrect responses")
    else:
        table = pd.concat([table.assign(run=name) for name, table in results.items()])
        table.to_csv(csv_path, index=False)
        analyses.plot_perplexity(table, png)
        print(table.groupby(["stratum", "run"], sort=False)["perplexity"].describe().to_string())
    _written(csv_path, png)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="amir-eval", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def reading(cmd):
        cmd.add_argument("--step", type=int, help="validation step of verl dump folders (default: latest)")
        cmd.add_argument("--all-problems", action="store_true",
                         help="keep problems not every run has (default: compare over the shared ones)")
        cmd.add_argument("--skip-malformed", action="store_true",
                         help="leave out lines that are not a UTF-8 JSON object (default: stop at the first)")
        cmd.add_argument("--benchmark-of", type=_named, action="append", metavar="PATH=BENCHMARK",
                         help="benchmark of the lines of a dump (file or folder) without data_source "
                              "(default: the dump's file); repeat")
        cmd.add_argument("--overwrite", action="store_true", help="replace existing output files")

    def analysis(name: str, help: str, func, out_required: bool = True):
        cmd = sub.add_parser(name, help=help)
        cmd.add_argument("--run", type=_named, action="append", required=True, metavar="NAME=PATH",
                         help="a run (verl dump folder/file or JSONL); repeat to compare, the first is passk's baseline")
        cmd.add_argument("--out", required=out_required, metavar="DIR",
                         help="folder for <command>_<run>_vs_<run>... files (.csv and .png; passk: .csv and .md, "
                              "without --out passk only prints)")
        reading(cmd)
        cmd.set_defaults(func=func)
        return cmd

    analysis("passk", "unbiased pass@k per benchmark: Table 1 form for two runs, gains over the first for more",
             run_passk, out_required=False).add_argument(
        "--k", type=int, nargs="+", default=[1, 2, 4], help="the k of pass@k, each 1 <= k <= samples per problem")
    analysis("calibration", "Brier score, ECE and reliability diagram", run_calibration).add_argument(
        "--bins", type=int, default=10)
    analysis("lengths", "length of incorrect (and correct) responses", run_lengths).add_argument(
        "--tokenizer", help="count tokens of this tokenizer (default: words)")
    analysis("coverage", "solvable-set coverage across runs (Table 2)", run_coverage)
    for name, help in (("margin", "preference margin of each run under its model (Figure 4)"),
                       ("perplexity", "self-perplexity by problem stratum under each run's generating model")):
        cmd = analysis(name, help, run_logprob_analysis)
        cmd.add_argument("--model", type=_named, action="append", required=True, metavar="NAME=MODEL",
                         help="HF model path of run NAME; one per run")
        cmd.add_argument("--device", default="cpu")
        cmd.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
        cmd.add_argument("--score-cache", type=Path, metavar="DIR",
                         help="keep each response's log-prob here, keyed by the model folder's content, dtype, device "
                              "and the exact text, and reuse it (margin and perplexity score the same responses)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except NothingToMeasure as nothing:
        print(f"{NOTHING_TO_MEASURE_PREFIX}{nothing}", file=sys.stderr)
        return NOTHING_TO_MEASURE
    except (EvaluationError, FileNotFoundError) as error:
        print(f"amir-eval: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
