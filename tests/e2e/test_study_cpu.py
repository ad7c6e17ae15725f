"""``python -m amir_verl.study --task toy`` at 2 seeds x 2 steps (CI's size; the study proper is a benchmark, its
results in the README): each seed's figures are its runs' own metrics, and the table's differences and
intervals are the paired t interval recomputed by hand from study.csv."""

import csv
import json
import re
import subprocess
import sys

import pytest

from amir_verl import run_figures
from amir_verl.study.study import AMIR, BASE
from amir_verl.metrics import LAMBDA, MARGIN, NUM_PAIRS, PAIR_ACCURACY, REWARD
from tests.support import paired_t_by_hand

pytestmark = pytest.mark.e2e
FIGURES = tuple(f for f in run_figures.FIGURES if f != run_figures.BRIER)  # the toy task's


def mean(values):
    return sum(values) / len(values)


def test_the_toy_study_reports_each_seeds_own_figures_and_the_paired_interval(tmp_path):
    work = tmp_path / "study"
    proc = subprocess.run([sys.executable, "-m", "amir_verl.study", "--task", "toy", "--seeds", "2", "--steps", "2",
                           "--workdir", str(work)], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert [line.split(":")[0] for line in proc.stdout.splitlines() if re.match(r"\[study\] seed \d (GRPO|AMIR)", line)] == [
        "[study] seed 0 GRPO", "[study] seed 0 AMIR-GRPO", "[study] seed 1 GRPO", "[study] seed 1 AMIR-GRPO"]

    rows = list(csv.DictReader((work / "study.csv").open()))
    by_seed_run = {(int(r["seed"]), r["run"]): r for r in rows}
    for seed in (0, 1):
        assert f"data.seed={seed}" in (work / f"seed_{seed}" / "amir_grpo" / "command.txt").read_text()
        for run, label in (("grpo", BASE), ("amir_grpo", AMIR)):
            steps = {row["step"]: row for row in map(json.loads, (work / f"seed_{seed}" / run / "metrics.jsonl")
                                                     .read_text().splitlines())}
            with_pairs = [steps[s] for s in (1, 2) if steps[s][NUM_PAIRS]]
            assert with_pairs, "the toy task mines pairs from step 1 on"
            expected = {run_figures.REWARD: mean([steps[s][REWARD] for s in (1, 2)]),
                        run_figures.VALIDATION_ACCURACY: mean([v for k, v in steps[2].items()
                                                               if k.startswith("val-core/") and "/acc/mean@" in k]),
                        run_figures.MARGIN: mean([m[MARGIN] for m in with_pairs]),
                        run_figures.PAIR_ACCURACY: mean([m[PAIR_ACCURACY] for m in with_pairs])}
            row = by_seed_run[(seed, label)]
            assert {f: float(row[f]) for f in FIGURES} == pytest.approx(expected), (seed, label)
            assert row[run_figures.BRIER] == ""
            assert (steps[2][LAMBDA] == 0.0) == (run == "grpo")

    table = (work / "study.md").read_text()
    for figure in FIGURES:
        grpo, amir = ([float(by_seed_run[(s, label)][figure]) for s in (0, 1)] for label in (BASE, AMIR))
        diff, half = paired_t_by_hand([a - g for g, a in zip(grpo, amir)])
        line = re.search(rf"^\| {figure} \| 2 \| (\S+) \| (\S+) \| (\S+) \| \[(\S+), (\S+)\] \| (\d) / (\d) \|$", table, re.M)
        assert line, (figure, table)
        assert [float(x) for x in line.groups()[:5]] == pytest.approx(
            [mean(grpo), mean(amir), diff, diff - half, diff + half], abs=2e-4), figure
        assert (int(line[6]), int(line[7])) == (sum(a > g for g, a in zip(grpo, amir)), sum(a < g for g, a in zip(grpo, amir)))
    assert "- brier: not measured: the toy task's responses state no confidence" in table
    assert table.strip() in proc.stdout
