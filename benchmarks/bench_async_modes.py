"""Step time of AMIR under each verl V1 schedule against its own base mode, measured side by side (issue 20).

For each schedule (``sync``, ``colocate_async``, ``separate_async``) two runs of the CPU toy task go at once,
each with its own Ray: verl's GRPO on verl's own trainer mode, and AMIR-GRPO on the AMIR mode of that schedule
(``amir``, ``amir_colocate_async``, ``amir_separate_async``). Both compute reference log-probs
(``use_kl_loss=True``, coefficient 0), which AMIR's ``amir.reference=ref`` needs. Prints each pair's median
``timing_s/step`` over the steps after the first (the first includes warm-up) and the ratio AMIR / base, and the
same for the two phases AMIR changes, verl's ``timing_s/adv`` (the driver: pairs, the lambda measurement, the
TransferQueue fields) and ``timing_s/update_actor`` (the loss): on the toy task a step takes about 2 s, and the
two runs compete for the same cores, so the phases AMIR does not touch (generation, log-probs) move by tenths of
a second from run to run.

    python benchmarks/bench_async_modes.py [--steps 6] [--schedules sync,colocate_async,separate_async] [--workdir DIR]
                                           [--record]

``--record`` also writes the table to docs/results/bench_async_modes.md (:mod:`amir_verl.results_page`).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from amir_verl.cpu.launch import main_ppo_command, read_verl_metrics, run_main_ppo_together, verl_metrics_path
from amir_verl.demo.quickstart import toy_grpo_overrides
from amir_verl.demo.toy_task import make_assets
from amir_verl.results_page import script_command, write_results
from amir_verl.run_config import AMIR_TRAINER_MODES, amir_overrides

BASE_MODES = {base: amir for amir, base in AMIR_TRAINER_MODES.items()}  # verl mode -> its AMIR mode
PHASES = {"step": ("step",), "adv+update_actor": ("adv", "update_actor")}  # verl's timing_s/* keys


def pair_commands(assets, root: Path, schedule: str, steps: int) -> dict:
    runs = {
        "base": ["actor_rollout_ref.actor.use_kl_loss=True", f"trainer.v1.trainer_mode={schedule}"],
        "amir": amir_overrides("amir_grpo", trainer_mode=BASE_MODES[schedule], beta_dpo=0.5, delta_r=0.05),
    }
    commands = {}
    for name, extra in runs.items():
        workdir = root / schedule / name
        workdir.mkdir(parents=True)
        overrides = toy_grpo_overrides(assets, workdir, steps, test_freq=-1, schedule=schedule) + extra + [
            "trainer.val_before_train=False"]
        commands[name] = main_ppo_command(overrides, log_path=workdir / "main_ppo.log")
    return commands


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--schedules", default=",".join(BASE_MODES))
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--record", action="store_true",
                        help="also write the table to docs/results/bench_async_modes.md")
    args = parser.parse_args()
    root = args.workdir or Path(tempfile.mkdtemp(prefix="amir_bench_async_"))
    assets = make_assets(root / "toy", n_train=128, n_test=8)
    rows = []
    for schedule in args.schedules.split(","):
        print(f"[bench] {schedule}: GRPO on {schedule} and AMIR-GRPO on {BASE_MODES[schedule]}, side by side, "
              f"{args.steps} steps (logs under {root / schedule})", flush=True)
        commands = pair_commands(assets, root, schedule, args.steps)
        run_main_ppo_together(commands, timeout=1800)
        medians = {}
        for name, command in commands.items():
            steps = read_verl_metrics(verl_metrics_path(command.log_path))
            medians[name] = {phase: statistics.median(sum(steps[s].get(f"timing_s/{p}", 0.0) for p in parts)
                                                      for s in sorted(steps)[1:])
                             for phase, parts in PHASES.items()}
        rows.append((schedule, BASE_MODES[schedule], medians["base"], medians["amir"]))
        print(f"[bench] {schedule}: " + ", ".join(
            f"{phase} base {medians['base'][phase]:.3f} s AMIR {medians['amir'][phase]:.3f} s "
            f"({medians['amir'][phase] / medians['base'][phase]:.2f})" for phase in PHASES), flush=True)
    table = ["| schedule | AMIR mode | step s, base -> AMIR (median) | AMIR / base | adv + update_actor s, base -> AMIR "
             "| AMIR / base |", "|---|---|---|---|---|---|"]
    for schedule, amir_mode, base, amir in rows:
        step, touched = (base["step"], amir["step"]), (base["adv+update_actor"], amir["adv+update_actor"])
        table.append(f"| {schedule} | `{amir_mode}` | {step[0]:.2f} -> {step[1]:.2f} | {step[1] / step[0]:.2f} | "
                     f"{touched[0]:.3f} -> {touched[1]:.3f} | {touched[1] / touched[0]:.2f} |")
    print("\n" + "\n".join(table))
    if args.record:
        body = (f"Medians over steps 2-{args.steps} of each run; each pair's two runs side by side.\n\n"
                + "\n".join(table))
        print(f"wrote {write_results('bench_async_modes', script_command(), body)}")


if __name__ == "__main__":
    main()
