"""benchmarks/gpu_check.py on the CPU (issue 24, item 6), as CI can run it.

The script runs in a subprocess whose imports of verl, ray and vllm fail (a ``sys.meta_path`` blocker, as on a
lent GPU machine where none is installed), from a directory outside the checkout; it must pass, print the
figures it also writes as JSON, and fail (exit status 1) when its rows are fed a wrong normalisation.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
RUNNER = """
import runpy, sys
BLOCKED = ("verl", "ray", "vllm")
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None
sys.meta_path.insert(0, Blocker())
for name in BLOCKED:
    try:
        __import__(name)
    except ModuleNotFoundError:
        pass
    else:
        raise SystemExit(f"the blocker let {name} through")
script, *args = sys.argv[1:]
sys.argv = [script, *args]
runpy.run_path(script, run_name="__main__")
"""
TORCH_DISTRIBUTED_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")


def run_check(workdir: Path, *args: str):
    figures = workdir / "figures.json"
    env = {k: v for k, v in os.environ.items() if k not in TORCH_DISTRIBUTED_ENV}
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(SCRIPT), "--device", "cpu", "--json", str(figures),
                           *args], cwd=workdir, env=env, capture_output=True, text=True, timeout=900)
    return proc, json.loads(figures.read_text()) if figures.exists() else None


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    return run_check(tmp_path_factory.mktemp("gpu_check"))


def rows_by_name(figures) -> dict:
    return {row["name"]: row for row in figures["rows"]}


def test_the_cpu_check_passes_with_verl_unimportable(cpu_run):
    proc, figures = cpu_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RESULT: PASS" in proc.stdout and "imports no verl/ray/vllm" in proc.stdout
    assert figures["verdict"] == "PASS"
    rows = rows_by_name(figures)
    fp32, bf16 = rows["plain fp32"], rows["plain bf16 autocast"]
    assert fp32["status"] == "PASS" and fp32["max_rel"] < 1e-5  # measured 7.5e-07 (tolerance 1e-4)
    # bf16 really computed in bf16 (far above fp32 rounding), within its tolerance
    assert bf16["status"] == "PASS" and 1e-4 < bf16["max_rel"] <= bf16["tolerance"] == 5e-2
    assert fp32["num_pairs"] > 0 and 0.2 < fp32["pref_share"] < 0.9  # the term is a large part of the gradient
    control = rows["control: plain bf16 autocast, weight without dp"]
    assert control["status"] == "DETECTED" and control["max_rel"] > 4 * control["tolerance"]
    assert rows["fsdp2 bf16"]["status"] == "PASS"
    # torch refuses FSDP1 on a CPU-only process: skipped with the reason (it runs on a GPU)
    for name in ("fsdp1 bf16", "fsdp1 bf16 lora-r16"):
        assert rows[name]["status"] == "PASS" or (rows[name]["status"] == "SKIP" and "CPU" in rows[name]["note"])
    lora = rows["fsdp2 bf16 lora-r16"]
    assert lora["status"] == "PASS" or (lora["status"] == "SKIP" and "peft" in lora["note"])
    assert not [r for r in figures["rows"] if r["status"] in ("FAIL", "ERROR", "MISSED")]


def test_the_printed_figures_are_the_measured_ones(cpu_run):
    proc, figures = cpu_run
    lines = proc.stdout.splitlines()
    for row in figures["rows"]:
        (line,) = [x for x in lines
                   if x.strip().startswith(row["name"]) and x.strip()[len(row["name"]):].lstrip().startswith("max rel")]
        assert row["status"] in line
        if row["max_rel"] is not None:
            assert f"max rel {row['max_rel']:.2e}" in line and f"tol {row['tolerance']:.2e}" in line
    timing = figures["timing"]
    assert math.isfinite(timing["ratio_median"]) and timing["ratio_median"] > 0
    assert f"AMIR / base {timing['ratio_median']:.3f}" in proc.stdout
    assert figures["wall_s"] < 300


def test_a_wrong_normalisation_fails_the_check(tmp_path):
    """Every row fed the control's wrong weight (no dp factor): the rows fail and the exit status is 1."""
    proc, figures = run_check(tmp_path, "--inject-fault", "--no-fsdp")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "RESULT: FAIL" in proc.stdout
    rows = rows_by_name(figures)
    assert rows["plain fp32"]["status"] == rows["plain bf16 autocast"]["status"] == "FAIL"
