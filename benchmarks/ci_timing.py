"""How long CI takes: ``.ci/run`` on a fresh clone of this checkout's HEAD, with the machine's load sampled.

    python benchmarks/ci_timing.py [--record] [--interval 5] [--keep]

Clones HEAD (``git clone --no-hardlinks``, then that commit checked out: uncommitted changes are not measured)
into a temporary folder, runs ``bash .ci/run`` there as CI does (``CI=true``, no standard input, this process's
virtual environment off the PATH) with ``PYTEST_ADDOPTS=--durations=20``, and samples the whole machine every
``--interval`` seconds: busy CPU time from ``/proc/stat`` and used memory (psutil, or ``free``). Prints, and with
``--record`` writes to docs/results/ci.md (:mod:`amir_verl.results_page`): the exit status, the tests passed /
failed / skipped (pytest's last line), pytest's time, the whole run's time (the install included), the CPU
seconds and peak memory of the machine over the run (other work on the machine counts too: run it idle), and the
10 slowest tests. It takes as long as CI (docs/results/ci.md); ``.ci/run``'s output goes to ``ci.log`` in the
clone (``--keep`` keeps the clone).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from amir_verl.results_page import write_results  # noqa: E402  (pure python, the checkout's own)

SLOWEST = 10
# pytest's summary line, with or without -q's bars: "894 passed, 1 skipped, 3 warnings in 1313.45s (0:21:53)"
SUMMARY = re.compile(r"^=*\s*((?:\d+ \w+(?:, )?)+) in ([\d.]+)s(?: \([\d:]+\))?\s*=*$")
COUNT = re.compile(r"(\d+) (\w+)")
DURATION = re.compile(r"^([\d.]+)s (setup|call|teardown)\s+(\S.*)$")


def parse_summary(output: str) -> dict | None:
    """The last pytest summary line of ``output``: ``{"counts": {"passed": 894, "skipped": 1, ...}, "seconds": s}``
    (``error``/``errors`` and ``warning``/``warnings`` counted under the plural); None when there is none."""
    for line in reversed(output.splitlines()):
        match = SUMMARY.match(line.strip())
        if match:
            counts = {}
            for number, word in COUNT.findall(match.group(1)):
                word = {"error": "errors", "warning": "warnings"}.get(word, word)
                counts[word] = counts.get(word, 0) + int(number)
            return {"counts": counts, "seconds": float(match.group(2))}
    return None


def parse_durations(output: str, top: int = SLOWEST) -> list[tuple[float, str, str]]:
    """The ``--durations`` section: the ``top`` slowest ``(seconds, phase, test id)``, slowest first."""
    rows, inside = [], False
    for line in output.splitlines():
        if "slowest" in line and "durations" in line:
            inside = True
            continue
        if inside:
            match = DURATION.match(line.strip())
            if match:
                rows.append((float(match.group(1)), match.group(2), match.group(3).strip()))
            elif line.strip() and not line.strip().startswith("("):
                inside = False
    return sorted(rows, key=lambda row: -row[0])[:top]


def parse_proc_stat(text: str) -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs from ``/proc/stat``'s first line; busy leaves out idle and iowait."""
    fields = text.splitlines()[0].split()
    assert fields[0] == "cpu", fields[:1]
    values = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal (guest is in user)
    return sum(values) - values[3] - values[4], sum(values)


def parse_free(text: str) -> int:
    """Used bytes from ``free -b``'s ``Mem:`` line."""
    for line in text.splitlines():
        if line.startswith("Mem:"):
            return int(line.split()[2])
    raise ValueError(f"no Mem: line in {text!r}")


def used_memory() -> int:
    try:
        import psutil

        return psutil.virtual_memory().used
    except ImportError:
        return parse_free(subprocess.run(["free", "-b"], capture_output=True, text=True, check=True).stdout)


class Sampler(threading.Thread):
    """Reads /proc/stat and the used memory every ``interval`` seconds until stopped."""

    def __init__(self, interval: float):
        super().__init__(daemon=True)
        self.interval, self.stopped = interval, threading.Event()
        self.first = self.last = parse_proc_stat(Path("/proc/stat").read_text())
        self.peak_memory = used_memory()

    def run(self):
        while not self.stopped.wait(self.interval):
            self.sample()

    def sample(self):
        self.last = parse_proc_stat(Path("/proc/stat").read_text())
        self.peak_memory = max(self.peak_memory, used_memory())

    def stop(self) -> None:
        self.stopped.set()
        self.join()
        self.sample()

    def cpu_seconds(self) -> float:
        return (self.last[0] - self.first[0]) / os.sysconf("SC_CLK_TCK")


def ci_environment() -> dict[str, str]:
    """This environment as CI has it: CI=true, the durations asked of pytest, no virtual environment active."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME", "PYTHONPATH")}
    if sys.prefix != sys.base_prefix:  # drop this venv's bin from the PATH: .ci/run makes its own
        venv_bin = str(Path(sys.prefix) / "bin")
        env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != venv_bin)
    env.update(CI="true", PYTEST_ADDOPTS="--durations=20")
    return env


def clone_head(target: Path) -> str:
    """Clone this checkout into ``target`` at its HEAD; returns the short sha."""
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(ROOT), str(target)], check=True)
    subprocess.run(["git", "-c", "advice.detachedHead=false", "checkout", "-q", "--detach", sha], cwd=target, check=True)
    shared = ROOT / "shared"
    if shared.is_dir():  # CI has a copy of shared/ beside the clone
        shutil.copytree(shared, target / "shared", symlinks=True)
    return sha[:7]


def report(status: int, summary: dict | None, whole_s: float, cpu_s: float, peak_bytes: int,
           slowest: list[tuple[float, str, str]]) -> str:
    """The Markdown that ci.md holds: the run's figures, then the slowest tests."""
    if summary:
        counts = summary["counts"]
        tests = ", ".join(f"{counts[k]} {k}" for k in ("passed", "failed", "errors", "skipped") if counts.get(k))
        pytest_time = f"{summary['seconds']:,.0f} s ({summary['seconds'] / 60:.1f} min)"
    else:
        tests, pytest_time = "no pytest summary line (see ci.log)", "-"
    lines = ["| exit status | tests | pytest | whole run (install included) | CPU-s (machine) | peak memory (machine) |",
             "|---|---|---|---|---|---|",
             f"| {status} | {tests} | {pytest_time} | {whole_s:,.0f} s ({whole_s / 60:.1f} min) | {cpu_s:,.0f} "
             f"| {peak_bytes / 2**30:.1f} GiB |",
             "", f"The {len(slowest)} slowest test phases (pytest `--durations`; a set-up includes the fixtures it "
             "starts):", "",
             "| seconds | phase | test |", "|---|---|---|"]
    lines += [f"| {seconds:.1f} | {phase} | `{test}` |" for seconds, phase, test in slowest]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", help="also write the figures to docs/results/ci.md")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between load samples")
    parser.add_argument("--keep", action="store_true", help="keep the clone (its ci.log) after the run")
    args = parser.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="amir_ci_timing_"))
    clone = folder / "amir-verl"
    sha = clone_head(clone)
    log = clone / "ci.log"
    print(f"[ci_timing] .ci/run on a clone of {sha} in {clone}; output in {log}", flush=True)
    sampler = Sampler(args.interval)
    sampler.start()
    start = time.monotonic()
    with log.open("w") as out:
        status = subprocess.run(["bash", ".ci/run"], cwd=clone, env=ci_environment(), stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT).returncode
    whole = time.monotonic() - start
    sampler.stop()
    output = log.read_text(errors="replace")
    body = report(status, parse_summary(output), whole, sampler.cpu_seconds(), sampler.peak_memory,
                  parse_durations(output))
    print(body)
    if args.record:
        command = "python benchmarks/ci_timing.py " + " ".join(argv if argv is not None else sys.argv[1:])
        print(f"wrote {write_results('ci', command.strip(), body, commit=sha)}")
    if args.keep:
        print(f"[ci_timing] the clone is kept: {clone}")
    else:
        shutil.rmtree(folder, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
