"""The results files the measuring scripts write (amir_verl/results_page.py), and benchmarks/ci_timing.py's
parsers on canned pytest, /proc/stat and free output (the script itself runs CI, 25 minutes: not run here)."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from amir_verl import results_page
from tests.support import load_script

ROOT = Path(__file__).resolve().parents[1]


def load_ci_timing():
    return load_script(ROOT / "benchmarks" / "ci_timing.py")


def test_write_results_states_the_command_date_cores_and_commit(tmp_path):
    body = "| a | b |\n|---|---|\n| 1 | 2 |"
    path = results_page.write_results("bench_x", "python benchmarks/bench_x.py --record", body, docs_dir=tmp_path)
    assert path == results_page.results_path("bench_x", tmp_path) == tmp_path / "results" / "bench_x.md"
    marker, header, blank, *rest = path.read_text().splitlines()
    assert marker == "<!-- written by the measuring script; do not edit by hand -->"
    match = re.fullmatch(r"Measured with `(.+)` on (\d{4}-\d\d-\d\d) UTC, (\d+) CPU cores \((.+)\), commit (.+)\.", header)
    assert match, header
    command, date, cores, model, commit = match.groups()
    assert command == "python benchmarks/bench_x.py --record"
    assert date == time.strftime("%Y-%m-%d", time.gmtime()) and int(cores) == os.cpu_count() and model
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert commit in (sha, f"{sha}, dirty") if sha else commit == "unknown"
    assert blank == "" and "\n".join(rest) == body


def test_the_header_takes_a_run_measured_elsewhere(tmp_path):
    path = results_page.write_results("study_toy", "python -m amir_verl.study --task toy --seeds 8", "table",
                                      docs_dir=tmp_path, date="2026-12-02", cores=2, model="model not recorded",
                                      commit="before 381ae47")
    assert path.read_text().splitlines()[1] == (
        "Measured with `python -m amir_verl.study --task toy --seeds 8` on 2026-12-02 UTC, 2 CPU cores "
        "(model not recorded), commit before 381ae47.")


def test_outside_a_clone_the_commit_is_unknown(monkeypatch, tmp_path):
    monkeypatch.setattr(results_page, "ROOT", tmp_path)  # git finds no repository there
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert results_page.commit_label() == "unknown"
    monkeypatch.setenv("PATH", "")  # no git at all
    assert results_page.commit_label() == "unknown"


def test_printed_output_is_kept_and_still_printed(capsys):
    with results_page.printed() as out:
        print("row 1")
        print("row 2", flush=True)
    assert out.getvalue() == "row 1\nrow 2\n" and capsys.readouterr().out == "row 1\nrow 2\n"
    assert results_page.text_block(out.getvalue()) == "```text\nrow 1\nrow 2\n```"


def test_the_command_is_the_script_relative_to_the_checkout():
    argv = [str(ROOT / "benchmarks" / "bench_reward.py"), "--n", "10", "--record"]
    assert results_page.script_command(argv) == "python benchmarks/bench_reward.py --n 10 --record"
    assert results_page.script_command(["x", "a b"], prefix="python -m m") == "python -m m 'a b'"


def test_the_pure_module_imports_no_torch():
    code = "import amir_verl.results_page, sys; print(sorted(m for m in ('torch', 'verl') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


CANNED_PYTEST = """\
........................................................................ [ 98%]
..s.......                                                               [100%]
============================= slowest 20 durations =============================
802.31s setup    tests/e2e/test_paper_pipeline_cpu.py::test_the_pipeline_trains
272.04s setup    tests/e2e/test_async_schedules.py::test_colocate
5.20s call     tests/test_reward.py::test_a
246.90s setup    tests/e2e/test_main_ppo_cpu.py::test_demo
0.91s teardown tests/test_x.py::test_y[param a-1]
(15 durations < 0.005s hidden.  Use -vv to show these durations.)
=========================== short test summary info ============================
FAILED tests/test_z.py::test_w - assert 0
1 failed, 894 passed, 1 skipped, 2 errors, 3 warnings in 1313.45s (0:21:53)
+ python -c 'import torch'
"""


def test_ci_timing_reads_pytest_last_line_and_the_slowest_tests():
    ci = load_ci_timing()
    summary = ci.parse_summary(CANNED_PYTEST)
    assert summary == {"counts": {"failed": 1, "passed": 894, "skipped": 1, "errors": 2, "warnings": 3},
                       "seconds": 1313.45}
    assert ci.parse_summary("== 12 passed, 1 error in 3.10s ==\n")["counts"] == {"passed": 12, "errors": 1}
    assert ci.parse_summary("no summary here\n") is None
    slowest = ci.parse_durations(CANNED_PYTEST, top=4)
    assert slowest == [(802.31, "setup", "tests/e2e/test_paper_pipeline_cpu.py::test_the_pipeline_trains"),
                       (272.04, "setup", "tests/e2e/test_async_schedules.py::test_colocate"),
                       (246.9, "setup", "tests/e2e/test_main_ppo_cpu.py::test_demo"),
                       (5.2, "call", "tests/test_reward.py::test_a")]
    assert ci.parse_durations(CANNED_PYTEST)[-1] == (0.91, "teardown", "tests/test_x.py::test_y[param a-1]")


def test_ci_timing_reads_the_machine_load():
    ci = load_ci_timing()
    stat = "cpu  100 5 50 1000 20 3 2 1 0 0\ncpu0 50 2 25 500 10 1 1 0 0 0\nintr 1\n"
    assert ci.parse_proc_stat(stat) == (100 + 5 + 50 + 3 + 2 + 1, 1181)
    free = ("               total        used        free      shared  buff/cache   available\n"
            "Mem:     24672661504  1396932608 19000000000     1000000  4000000000 23000000000\n"
            "Swap:              0           0           0\n")
    assert ci.parse_free(free) == 1396932608
    with pytest.raises(ValueError):
        ci.parse_free("Swap: 0 0 0\n")


def test_ci_timing_report_is_a_table_of_the_run(tmp_path):
    ci = load_ci_timing()
    body = ci.report(0, ci.parse_summary(CANNED_PYTEST), 1406.2, 2518.4, 18.8 * 2**30,
                     ci.parse_durations(CANNED_PYTEST))
    rows = body.splitlines()
    assert rows[2] == ("| 0 | 894 passed, 1 failed, 2 errors, 1 skipped | 1,313 s (21.9 min) | 1,406 s (23.4 min) "
                       "| 2,518 | 18.8 GiB |")
    assert "| 802.3 | setup | `tests/e2e/test_paper_pipeline_cpu.py::test_the_pipeline_trains` |" in rows
    assert "no pytest summary line" in ci.report(1, None, 10.0, 5.0, 2**30, [])
    env = ci.ci_environment()
    assert env["CI"] == "true" and env["PYTEST_ADDOPTS"] == "--durations=20" and "VIRTUAL_ENV" not in env
