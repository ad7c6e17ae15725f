"""How OpenMP threads wait, on a shared CPU: what :data:`amir_verl.cpu.settings.OPENMP_ENV` is for.

A forward pass of a randomly initialised model of SmolLM2-135M's shape (16 sequences of 200 tokens, two passes,
all threads of the machine) in a fresh process, with libgomp's default wait (spinning) and with
``OMP_WAIT_POLICY=PASSIVE`` (sleeping): alone, then beside as many busy processes as ``--busy`` (default: one
core's worth, as a CPU run's other processes or the test suite beside the paper pipeline). Prints each case's wall
time and the CPU time of the forward's process, and the ratios sleeping / spinning.

    python benchmarks/bench_omp_wait.py [--busy 1] [--repeats 2] [--record]

``--record`` also writes the output to docs/results/bench_omp_wait.md (:mod:`amir_verl.results_page`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from amir_verl.results_page import print_or_record

FORWARD = r"""
import json, time, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, vocab_size=49152)  # SmolLM2-135M's shape
model = LlamaForCausalLM(config).eval()
ids = torch.randint(0, config.vocab_size, (16, 200))
with torch.no_grad():
    model(ids[:2, :20])  # warm-up
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(2):
        model(ids)
    print(json.dumps({"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}))
"""

BUSY = "import time\nend = time.time() + 600\nwhile time.time() < end: pass"
POLICIES = {"spinning (libgomp's default)": None, "sleeping (OMP_WAIT_POLICY=PASSIVE)": "PASSIVE"}


def forward(policy: str | None) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    done = subprocess.run([sys.executable, "-c", FORWARD], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(busy: int, repeats: int) -> dict[str, dict[str, float]]:
    hogs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(busy)]
    try:
        time.sleep(0.5 if busy else 0)
        runs = {name: [] for name in POLICIES}
        for _ in range(repeats):  # alternating, so that a drift of the machine hits both alike
            for name, policy in POLICIES.items():
                runs[name].append(forward(policy))
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    return {name: {key: statistics.median(run[key] for run in results) for key in ("wall_s", "cpu_s")}
            for name, results in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy", type=int, default=1, help="busy processes beside the forward in the second case")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--record", action="store_true",
                        help="also write the output to docs/results/bench_omp_wait.md")
    args = parser.parse_args()
    print_or_record('bench_omp_wait' if args.record else None, lambda: report(args))


def report(args) -> None:
    print(f"{os.cpu_count()} cores; medians of {args.repeats}", flush=True)
    for busy in (0, args.busy):
        figures = measure(busy, args.repeats)
        print(f"beside {busy} busy process(es):")
        for name, figure in figures.items():
            print(f"  {name:36s} wall {figure['wall_s']:6.1f} s   CPU {figure['cpu_s']:6.1f} s", flush=True)
        spin, sleep = figures.values()
        print(f"  sleeping / spinning: wall {sleep['wall_s'] / spin['wall_s']:.2f}, CPU {sleep['cpu_s'] / spin['cpu_s']:.2f}")


if __name__ == "__main__":
    main()
