"""What the amir-verl plugin adds to ``import verl``, the import every verl process (driver, TaskRunner,
Ray workers) pays.

    python benchmarks/bench_import_time.py [--n 10]

Each run is a fresh ``python -c`` that times ``import verl`` in-process, interpreter start-up excluded:
wall time (``time.perf_counter``) and the CPU time of the process (``time.process_time``, which other
processes on a loaded machine disturb less), and reports whether ``amir_verl.verl_plugin`` was loaded,
which the script checks.
Runs with and without the plugin alternate, the order swapped every round (with, without, without,
with, ...) so that a drift in machine load weighs on both alike; one untimed run of each first fills the
file cache. Prints median, min and max of each and the difference of the medians, for wall and CPU
time, and the load average before and after.

"Without the plugin" uninstalls nothing: verl's own switch ``VERL_USE_EXTERNAL_PLUGINS`` (read in
``verl/__init__.py``) is set to the names of the other installed ``verl.plugins`` entry points, or to
``none`` when amir is the only one, so verl loads every plugin but this one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from importlib.metadata import entry_points

PLUGIN_NAME = "amir"  # our name in the verl.plugins group (setup.py)
PLUGIN_MODULE = "amir_verl.verl_plugin"
TIMED_IMPORT = (
    "import sys, time\n"
    "wall, cpu = time.perf_counter(), time.process_time()\n"
    "import verl\n"
    "print(time.perf_counter() - wall, time.process_time() - cpu, '" + PLUGIN_MODULE + "' in sys.modules)\n"
)


def plugin_policy_without_amir() -> str:
    """The ``VERL_USE_EXTERNAL_PLUGINS`` value that loads every installed verl plugin except amir."""
    others = sorted(ep.name for ep in entry_points(group="verl.plugins") if ep.name != PLUGIN_NAME)
    return ",".join(others) if others else "none"


def timed_import(with_plugin: bool) -> tuple[float, float]:
    """(wall, CPU) seconds ``import verl`` took in a fresh interpreter; fails if the plugin was (not) loaded
    as asked."""
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_USE_EXTERNAL_PLUGINS", "AMIR_VERL_CPU")}
    if not with_plugin:
        env["VERL_USE_EXTERNAL_PLUGINS"] = plugin_policy_without_amir()
    out = subprocess.run([sys.executable, "-c", TIMED_IMPORT], capture_output=True, text=True, env=env,
                         cwd="/", timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"import verl failed:\n{out.stderr[-2000:]}")
    wall, cpu, loaded = out.stdout.split()[-3:]
    if (loaded == "True") != with_plugin:
        raise RuntimeError(f"{PLUGIN_MODULE} loaded={loaded} in a run {'with' if with_plugin else 'without'} it")
    return float(wall), float(cpu)


def describe(times: list[float]) -> str:
    return f"median {statistics.median(times):5.2f} s  min {min(times):5.2f}  max {max(times):5.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10, help="timed runs with and without the plugin, each")
    args = parser.parse_args()
    if args.n < 1:
        parser.error(f"--n must be at least 1, got {args.n}")

    print("load average before (1, 5, 15 min): %.2f %.2f %.2f" % os.getloadavg())
    for with_plugin in (True, False):  # untimed: fill the file cache
        timed_import(with_plugin)
    times = {True: [], False: []}
    for i in range(args.n):
        for with_plugin in ((True, False) if i % 2 == 0 else (False, True)):
            times[with_plugin].append(timed_import(with_plugin))
    print("load average after  (1, 5, 15 min): %.2f %.2f %.2f" % os.getloadavg())
    print(f"import verl, {args.n} fresh runs each, alternating; without = VERL_USE_EXTERNAL_PLUGINS="
          f"{plugin_policy_without_amir()}")
    for kind, index in (("wall", 0), ("CPU", 1)):
        with_times = [t[index] for t in times[True]]
        without_times = [t[index] for t in times[False]]
        print(f"  {kind:4} with the plugin     {describe(with_times)}")
        print(f"  {kind:4} without the plugin  {describe(without_times)}")
        print(f"  {kind:4} plugin cost (difference of medians): "
              f"{statistics.median(with_times) - statistics.median(without_times):+.2f} s")


if __name__ == "__main__":
    main()
