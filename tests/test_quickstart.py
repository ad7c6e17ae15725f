"""The quickstart's launcher, report and bad-use answers, without main_ppo (see tests/e2e for the real runs)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from amir_verl.cpu import SWITCH
from amir_verl.cpu.launch import (
    LoggedCommand,
    MainPPOFailed,
    failure_reason,
    main_ppo_env,
    read_verl_metrics,
    run_logged,
    run_logged_together,
    stop_all,
    stops_on_sigterm,
    verl_metrics_path,
)
from amir_verl.cpu.progress import RunProgress, progress_line, validation_accuracy
from amir_verl.cpu.settings import OPENMP_ENV
from amir_verl.demo.quickstart import MARKER, QuickstartError, main, prepare_workdir
from amir_verl.demo.report import moving_average, plot_runs, summary_rows, summary_table
from amir_verl.metrics import GRAD_SHARE, LAMBDA, MARGIN, NUM_PAIRS, PAIR_ACCURACY, REWARD, STEP_TIME
from tests.support import sigint_as_from_a_terminal

PY = sys.executable


# ---- launcher ---------------------------------------------------------------------------------------------

def test_timeout_fires_while_the_child_prints_nothing_and_stops_its_whole_group():
    """The child starts a grandchild and both stay silent: the timeout still fires, and neither survives."""
    code = ("import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            "print(p.pid, flush=True); time.sleep(120)")
    seen = []
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="ran over 2 s"):
        run_logged([PY, "-c", code], timeout=2, on_line=seen.append)
    assert time.monotonic() - start < 15
    grandchild = int(seen[0])
    for _ in range(50):
        if _gone(grandchild):
            break
        time.sleep(0.1)
    else:
        pytest.fail("the grandchild outlived the timeout")


def _gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_lines_printed_from_threads_side_by_side_come_out_whole():
    """The reader threads of runs side by side print their lines at once; ``print`` writes a text and its newline
    apart, so two lines could merge into one (seen: a launcher test read " 4242" for "child 4242")."""
    code = ("import threading\nfrom amir_verl.cpu.launch import print_line\n"
            "def lines(name):\n    for i in range(3000):\n        print_line(f'{name} {i}')\n"
            "threads = [threading.Thread(target=lines, args=(name,)) for name in 'ab']\n"
            "[t.start() for t in threads]\n[t.join() for t in threads]\n")
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert sorted(out.splitlines()) == sorted(f"{name} {i}" for name in "ab" for i in range(3000))


def launcher_to_interrupt(child_code: str, call: str) -> subprocess.Popen:
    """A Python process that runs ``call`` (a launcher call starting ``CHILD = child_code`` processes, whose
    lines it prints after 'child') and prints 'interrupted' from its own KeyboardInterrupt handler."""
    launcher = (f"import sys\nCHILD = {child_code!r}\n"
                "from amir_verl.cpu.launch import LoggedCommand, print_line, run_logged, run_logged_together, stops_on_sigterm\n"
                "show = lambda line: print_line('child ' + line.rstrip())\n"
                f"@stops_on_sigterm\ndef main():\n    {call}\n"
                "try:\n    main()\nexcept KeyboardInterrupt:\n    print('interrupted', flush=True)\n")
    return subprocess.Popen([PY, "-c", launcher], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_as_from_a_terminal)


def test_ctrl_c_stops_the_child_group_even_when_pressed_twice():
    """A launcher process runs a silent child; two SIGINTs in a row (an impatient Ctrl-C) still end with the
    child stopped and the launcher's own KeyboardInterrupt handler reached. The child ignores SIGTERM, so
    the second SIGINT lands while the launcher waits to SIGKILL it."""
    child_code = ("import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                  "print(os.getpid(), flush=True); time.sleep(120)")
    proc = launcher_to_interrupt(child_code, "run_logged([sys.executable, '-c', CHILD], on_line=show)")
    child = int(proc.stdout.readline().split()[1])
    proc.send_signal(signal.SIGINT)
    time.sleep(1.0)  # the first one handled: the launcher is stopping the child
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)  # unguarded, the launcher would wait on the child for 120 s
    assert out.strip() == "interrupted" and "Traceback" not in err
    assert _gone(child)


def test_ctrl_c_stops_every_command_side_by_side():
    child_code = "import os, time; print(os.getpid(), flush=True); time.sleep(120)"
    proc = launcher_to_interrupt(child_code, "run_logged_together({name: LoggedCommand([sys.executable, '-c', CHILD], "
                                             "on_line=show) for name in ('a', 'b')})")
    children = [int(proc.stdout.readline().split()[1]) for _ in range(2)]
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert out.strip() == "interrupted" and "Traceback" not in err
    assert all(_gone(child) for child in children)


def test_sigterm_stops_every_command_as_ctrl_c_does():
    """A job scheduler's stop (SIGTERM to the launcher alone) reaches the children, each in a session of its own,
    through the same clean-up as Ctrl-C; a second SIGTERM during it does not cut it short (the children ignore
    SIGTERM, so the launcher is waiting to SIGKILL them when it lands)."""
    child_code = ("import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                  "print(os.getpid(), flush=True); time.sleep(120)")
    proc = launcher_to_interrupt(child_code, "run_logged_together({name: LoggedCommand([sys.executable, '-c', CHILD], "
                                             "on_line=show) for name in ('a', 'b')})")
    children = [int(proc.stdout.readline().split()[1]) for _ in range(2)]
    proc.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert out.strip() == "interrupted" and "Traceback" not in err and proc.returncode == 0
    assert all(_gone(child) for child in children)


def test_a_second_interrupt_landing_before_the_signals_are_ignored_does_not_cut_the_stopping_short(monkeypatch):
    """The window the test above cannot aim at: a second Ctrl-C (or SIGTERM) whose KeyboardInterrupt comes while
    the clean-up is only starting, before SIGINT and SIGTERM are ignored (here: at its first signal.signal call).
    The children are stopped all the same, and the handlers are what they were before."""
    from amir_verl.cpu import launch

    children = {name: launch._Child(LoggedCommand([PY, "-c", "import time; time.sleep(120)"])) for name in "ab"}
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    real_signal, calls = signal.signal, []

    def interrupted_at_the_first_call(sig, handler):
        calls.append(sig)
        if len(calls) == 1:
            raise KeyboardInterrupt  # what the second signal's handler raises there
        return real_signal(sig, handler)

    monkeypatch.setattr(launch.signal, "signal", interrupted_at_the_first_call)
    try:
        stop_all(children)
        running = [name for name, child in children.items() if child.proc.poll() is None]  # stop_all reaps each
    finally:
        for child in children.values():  # whatever stop_all left, so that the test leaves nothing behind
            if child.proc.poll() is None:
                child.proc.kill()
                child.proc.wait()
    assert len(calls) > 1
    assert running == []
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_the_programs_that_launch_main_ppo_stop_on_sigterm():
    from amir_verl.demo import quickstart
    from amir_verl.paper_pipeline import pipeline
    from amir_verl.study import study

    for program in (quickstart, pipeline, study):  # each main is stops_on_sigterm's wrapper around its own
        assert program.main.__code__ is stops_on_sigterm(lambda: 0).__code__ and program.main.__wrapped__


def test_what_the_child_leaves_in_its_group_is_stopped_when_it_exits(tmp_path):
    """main_ppo can exit while Ray processes of its group still hold the output pipe: they are stopped at
    once, so the launcher neither waits on the pipe nor leaves them running."""
    code = ("import subprocess, sys; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); print(p.pid, flush=True)")
    printed = []
    returncode, output = run_logged([PY, "-c", code], log_path=tmp_path / "log",
                                    on_line=lambda line: printed.append(time.monotonic()))
    assert returncode == 0 and time.monotonic() - printed[0] < 3  # waiting on the pipe would take GRACE_S (5 s)
    leftover = int(output)
    time.sleep(0.5)
    assert _gone(leftover)
    assert (tmp_path / "log").read_text() == output


def test_run_logged_tees_every_line_and_returns_the_exit_status(tmp_path):
    seen = []
    code = "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"
    returncode, output = run_logged([PY, "-c", code], log_path=tmp_path / "log", on_line=seen.append)
    assert returncode == 3
    assert sorted(output.splitlines()) == sorted(line.strip() for line in seen) == ["err", "out"]
    assert (tmp_path / "log").read_text() == output


def test_side_by_side_commands_all_run_and_come_back_in_the_order_they_ended(tmp_path):
    """Decided before running: the two sleeps overlap in time (each command prints when its sleep began and
    ended, so the check holds on a loaded machine too, where starting a Python process can take a second);
    each output goes to its own log."""
    code = "import time; began = time.time(); time.sleep({}); print('{}', began, time.time())"
    commands = {name: LoggedCommand([PY, "-c", code.format(delay, name)], log_path=tmp_path / f"{name}.log")
                for name, delay in (("slow", 1.5), ("fast", 1.0))}
    results = run_logged_together(commands)
    printed = {name: output.split() for name, (_, output) in results.items()}
    assert all(status == 0 for status, _ in results.values()) and all(printed[name][0] == name for name in commands)
    began, ended = ({name: float(words[i]) for name, words in printed.items()} for i in (1, 2))
    assert began["fast"] < ended["slow"] and began["slow"] < ended["fast"]  # side by side, not one after the other
    assert list(results) == sorted(results, key=ended.get)  # (fast, then slow, unless a start was delayed)
    assert (tmp_path / "slow.log").read_text() == results["slow"][1]


def test_a_failing_command_stops_the_ones_beside_it_at_once():
    code = "import os, time; print(os.getpid(), flush=True); time.sleep(120)"
    pids = []
    commands = {"failing": LoggedCommand([PY, "-c", "import time, sys; time.sleep(1); sys.exit(4)"]),
                "long": LoggedCommand([PY, "-c", code], on_line=pids.append)}
    start = time.monotonic()
    results = run_logged_together(commands, timeout=60)
    assert time.monotonic() - start < 10
    assert list(results) == ["failing", "long"] and results["failing"][0] == 4 and results["long"][0] < 0
    assert _gone(int(pids[0]))


def test_the_timeout_names_the_commands_still_running_and_stops_them():
    pids = []
    code = "import os, time; print(os.getpid(), flush=True); time.sleep(120)"
    commands = {"done": LoggedCommand([PY, "-c", "pass"]),
                "silent": LoggedCommand([PY, "-c", code], on_line=pids.append)}
    with pytest.raises(TimeoutError, match=r"^silent ran over 2 s"):
        run_logged_together(commands, timeout=2)
    assert _gone(int(pids[0]))


def test_an_on_line_callback_that_raises_stops_the_run_with_its_error_at_once():
    """Seen in a test's callback (a process that ended while it was being inspected): the reading thread died with
    the callback's error, nothing read the pipe any more, and main_ppo blocked on a full pipe until the timeout.
    The child here writes 1 MB (a pipe holds 64 KB), then waits; the callback fails at its second line. (Before the
    fix: TimeoutError after 60 s.)"""
    code = ("import os, time; print(os.getpid(), flush=True); [print('y' * 1023, flush=True) for _ in range(1024)]; "
            "time.sleep(120)")
    seen = []

    def inspect(line: str) -> None:
        seen.append(line)
        if len(seen) == 2:
            raise psutil.NoSuchProcess(12345)

    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^child: its on_line callback raised psutil.NoSuchProcess") as failed:
        run_logged_together({"child": LoggedCommand([PY, "-c", code], on_line=inspect)}, timeout=60)
    assert time.monotonic() - start < 30
    assert isinstance(failed.value.__cause__, psutil.NoSuchProcess) and len(seen) == 2
    assert _gone(int(seen[0]))


def test_a_run_that_goes_on_after_its_vllm_engine_died_is_stopped_as_a_failure(monkeypatch):
    """verl 0.9.1 does not stop when its vLLM engine core dies mid-run (seen: the engine core killed at step 1,
    then no output and no exit). The child prints what vLLM's front end then logs and keeps running: the launcher
    stops its group FATAL_GRACE_S later and reports the rollout as the reason."""
    import amir_verl.cpu.launch as launch

    monkeypatch.setattr(launch, "FATAL_GRACE_S", 1.0)
    code = ("import os, time; print(os.getpid(), flush=True); "
            "print('(vLLMHttpServer pid=9) WARNING [core_client.py:725] [shutdown] MPClient: engine core exited "
            "unexpectedly; starting cleanup', flush=True); "
            "print('(vLLMHttpServer pid=9) ERROR vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered "
            "an issue.', flush=True); time.sleep(120)")
    pids = []
    start = time.monotonic()
    with pytest.raises(MainPPOFailed) as failed:
        launch.run_main_ppo_together({"hung": LoggedCommand([PY, "-c", code], on_line=pids.append)}, timeout=60)
    assert time.monotonic() - start < 1.0 + 2 * launch.GRACE_S + 5
    assert failed.value.returncode < 0 and failed.value.reason == (
        "verl's vllm rollout: the vLLM engine failed: its engine core process exited unexpectedly (killed? out of "
        "memory?)")
    assert _gone(int(pids[0]))


@pytest.mark.parametrize("output,expected", [
    ("...\nOSError: [Errno 98] Address already in use\n", "port"),
    ("ConnectionError: Could not find any running Ray instance. Please specify", "RAY_ADDRESS"),
    ("Traceback (most recent call last):\n  File x\nValueError: first\n(TaskRunnerV1 pid=12) KeyError: 'last one'\n",
     "KeyError: 'last one'"),
    ("no error line at all\n", "see the log"),
    # hydra refusing an override: no "...Error:" line (seen: an amir key the recipe's amir block does not hold)
    ("Could not override 'amir.lambda_init'.\nTo append to your config use +amir.lambda_init=2.0\n"
     "Key 'lambda_init' is not in struct\n    full_key: amir.lambda_init\n    object_type=dict\n\n"
     "Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.\n",
     "hydra: Could not override 'amir.lambda_init'. To append to your config use +amir.lambda_init=2.0 "
     "Key 'lambda_init' is not in struct"),
    # vLLM 0.27.1's engine core on a head size its CPU attention refuses, then verl's replay buffer's last word
    ("(vLLMHttpServer pid=9) (EngineCore pid=8) ERROR [core.py:1351] RuntimeError: Worker failed with error "
     "'Unsupported CPU attention configuration: head_dim=16 isa=2 kv_cache_idx=0', please check the stack trace\n"
     "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.\n"
     "RuntimeError: Sync replay buffer selected terminal groups with no materializable trajectories.\n",
     "verl's vllm rollout: the vLLM engine failed: Unsupported CPU attention configuration: head_dim=16"),
])
def test_failure_reason_is_one_line_naming_the_cause(output, expected):
    reason = failure_reason(output)
    assert expected in reason and "\n" not in reason


def test_main_ppo_failed_carries_the_reason_and_log(tmp_path):
    error = MainPPOFailed(1, "ValueError: x", "tail of the output", tmp_path / "log")
    assert error.reason == "ValueError: x" and "full log: " in str(error) and "tail of the output" in str(error)


def test_main_ppo_waits_in_openmp_as_the_cpu_settings_say_unless_the_environment_sets_it(monkeypatch):
    for key in OPENMP_ENV:
        monkeypatch.delenv(key, raising=False)
    assert {key: main_ppo_env()[key] for key in OPENMP_ENV} == OPENMP_ENV
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's choice wins
    assert main_ppo_env()["OMP_WAIT_POLICY"] == "ACTIVE"


def test_main_ppo_env_sets_its_own_keys_over_the_environments(monkeypatch, tmp_path):
    """The keys the launcher sets win over the environment's (the demo's process has TOKENIZERS_PARALLELISM set by
    then: merging them as keyword arguments raised "got multiple values")."""
    for key, value in {SWITCH: "0", "TOKENIZERS_PARALLELISM": "true", "RAY_DEDUP_LOGS": "1",
                       "VERL_FILE_LOGGER_PATH": "elsewhere"}.items():
        monkeypatch.setenv(key, value)
    env = main_ppo_env(tmp_path / "main_ppo.log")
    assert {key: env[key] for key in (SWITCH, "TOKENIZERS_PARALLELISM", "RAY_DEDUP_LOGS", "VERL_FILE_LOGGER_PATH")} == {
        SWITCH: "1", "TOKENIZERS_PARALLELISM": "false", "RAY_DEDUP_LOGS": "0",
        "VERL_FILE_LOGGER_PATH": str(verl_metrics_path(tmp_path / "main_ppo.log"))}


def verl_file_logger(monkeypatch, log_path: Path):
    """verl's own file logger, writing where a run launched with ``log_path`` has it write."""
    from verl.utils.tracking import FileLogger

    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", main_ppo_env(log_path)["VERL_FILE_LOGGER_PATH"])
    return FileLogger("project", "experiment")


def test_metrics_come_from_verls_file_logger_numbers_only_nan_kept(monkeypatch, tmp_path):
    assert main_ppo_env()["VERL_FILE_LOGGER_PATH"] == os.devnull  # no log: verl's file logger writes nowhere
    logger = verl_file_logger(monkeypatch, tmp_path / "main_ppo.log")
    logger.log({"val-core/t/acc/mean@4": np.float64(0.1)}, step=0)
    logger.log({REWARD: np.float32(0.25), LAMBDA: 0.5, NUM_PAIRS: 3, "flag": True, "tag": "abc",
                MARGIN: float("nan")}, step=3)
    logger.log({STEP_TIME: 1.5}, step=3)
    logger.finish()
    steps = read_verl_metrics(verl_metrics_path(tmp_path / "main_ppo.log"))
    assert set(steps) == {0, 3} and steps[0] == {"val-core/t/acc/mean@4": 0.1}
    assert {k: v for k, v in steps[3].items() if k != MARGIN} == {REWARD: 0.25, LAMBDA: 0.5, NUM_PAIRS: 3.0,
                                                                  STEP_TIME: 1.5}
    assert np.isnan(steps[3][MARGIN])  # orjson writes NaN as null: read back as NaN, not dropped
    assert read_verl_metrics(tmp_path / "absent.jsonl") == {}


def test_a_console_line_split_in_pieces_loses_no_metric(monkeypatch, tmp_path, capsys):
    """Ray forwards a worker's long line in pieces under load (a paper run's 50 kB validation line arrived as
    two): the progress follows verl's file logger, so every key of the step reaches metrics.jsonl, once."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    verl_metrics_path(run_dir / "main_ppo.log").write_text("{\"step\": 9, \"data\": {}}\n")  # an earlier run's
    progress = RunProgress("amir_grpo", run_dir, total_steps=4)
    logger = verl_file_logger(monkeypatch, progress.log_path)
    benchmarks = [f"val-core/bench{b}/acc/mean@8" for b in range(7)]
    step = {**{key: 0.125 * b for b, key in enumerate(benchmarks)},
            **{f"val-aux/bench{b}/extra{k}/mean@8": float(k) for b in range(7) for k in range(400)}, REWARD: 0.5}
    logger.log(step, step=4)
    console = "(TaskRunnerV1 pid=7) step:4 - " + " - ".join(f"{k}:{v}" for k, v in step.items())
    assert len(console) > 50_000
    for piece in (console[:20_000], "(TaskRunnerV1 pid=7) " + console[20_000:]):
        progress(piece)
    progress.close()
    logger.finish()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 4, **step}] and progress.steps == {4: step}
    printed = capsys.readouterr().out
    assert printed.count("[amir_grpo] step  4/4") == 1 and "(mean of 7 benchmarks)" in printed


def test_a_record_still_being_written_waits_for_its_end(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    progress = RunProgress("grpo", run_dir, total_steps=2)
    record = json.dumps({"step": 1, "data": {REWARD: 0.75}}).encode() + b"\n"
    source = verl_metrics_path(progress.log_path)
    source.write_bytes(record[:10])
    progress("any line")
    assert progress.steps == {}
    with open(source, "ab") as out:
        out.write(record[10:])
    progress("another line")
    progress.close()
    assert progress.steps == {1: {REWARD: 0.75}}
    assert (run_dir / "metrics.jsonl").read_text() == json.dumps({"step": 1, REWARD: 0.75}) + "\n"


# ---- report ----------------------------------------------------------------------------------------------

def fake_run(rewards, accuracies, margin_last, lam):
    """Metrics of a run whose step s has reward rewards[s-1]; validations at the steps of ``accuracies``."""
    steps = {0: {"val-core/toy/acc/mean@4": accuracies[0]}}
    for step, reward in enumerate(rewards, 1):
        steps[step] = {REWARD: reward, MARGIN: 0.0, PAIR_ACCURACY: 0.5,
                       NUM_PAIRS: 4.0, LAMBDA: lam, GRAD_SHARE: 0.2, STEP_TIME: 1.0}
    steps[1].update({NUM_PAIRS: 0.0, MARGIN: 0.0, PAIR_ACCURACY: 0.0})  # no pairs: verl logs 0
    steps[len(rewards)][MARGIN] = margin_last
    steps[len(rewards)]["val-core/toy/acc/mean@4"] = accuracies[1]
    return steps


def test_summary_rows_average_the_first_and_last_steps():
    rewards = [0.1 * i for i in range(12)]  # steps 1..12: 0.0 .. 1.1
    row = summary_rows({"GRPO": fake_run(rewards, [0.1, 0.4], 0.25, 0.0)})[0]
    assert row["steps"] == 12
    assert row["reward_start"] == pytest.approx(sum(rewards[:5]) / 5)  # 0.2
    assert row["reward_end"] == pytest.approx(sum(rewards[-5:]) / 5)  # 0.9
    assert row["margin"] == pytest.approx(0.25 / 5) and row["pair_accuracy"] == pytest.approx(0.5)
    assert (row["val_acc_start"], row["val_acc_end"], row["lambda"]) == (0.1, 0.4, 0.0)
    table = summary_table({"GRPO": fake_run(rewards, [0.1, 0.4], 0.25, 0.0)})
    assert "| GRPO | 12 | 0.200 -> 0.900 | 0.100 -> 0.400 | +0.050 | 0.50 | 0.000 | 0.20 |" in table
    # steps without pairs have no margin: 2 steps, the first without pairs -> the second's margin alone
    short = summary_rows({"AMIR": fake_run([0.1, 0.2], [0.1, 0.2], -0.5, 0.5)})[0]
    assert short["margin"] == -0.5 and short["pair_accuracy"] == 0.5
    assert summary_rows({"empty": {}})[0]["reward_start"] is None  # a run interrupted before its first step


def test_progress_line_is_one_line_with_the_step_numbers():
    metrics = fake_run([0.5, 0.75], [0.1, 0.3], -0.125, 0.5)
    assert validation_accuracy(metrics[1]) is None and validation_accuracy(metrics[2]) == 0.3
    line = progress_line("amir_grpo", 2, 40, metrics[2])
    assert line == "[amir_grpo] step  2/40  reward 0.750  val acc 0.300  margin -0.125  pairs 4  lambda 0.500  1.0 s"
    assert "before training: acc 0.100" in progress_line("grpo", 0, 40, metrics[0])
    assert "margin -  pairs 0" in progress_line("grpo", 1, 40, metrics[1])
    # the paper pipeline validates on seven benchmarks: their mean, said so (not the first benchmark alone)
    several = {"val-core/openai/gsm8k/acc/mean@8": 0.5, "val-core/deepmind/aqua_rat/acc/mean@8": 0.0,
               "val-core/math-ai/aime25/acc/mean@8": 0.25, "val-core/openai/gsm8k/acc/best@8/mean": 1.0}
    assert validation_accuracy(several) == pytest.approx(0.25)
    assert progress_line("grpo", 0, 2, several).endswith("validation before training: acc 0.250 (mean of 3 benchmarks)")


def test_moving_average_of_the_last_five():
    assert moving_average([1.0, 3.0, 5.0, 7.0, 9.0, 11.0, 13.0]) == [1.0, 2.0, 3.0, 4.0, 5.0, 7.0, 9.0]


def test_plot_writes_a_png(tmp_path):
    runs = {"GRPO": fake_run([0.1, 0.2, 0.3], [0.1, 0.2], 0.1, 0.0),
            "AMIR-GRPO": fake_run([0.1, 0.3, 0.4], [0.1, 0.3], 0.2, 0.5)}
    path = plot_runs(runs, tmp_path / "q.png", "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


# ---- bad use ---------------------------------------------------------------------------------------------

def test_workdir_with_other_content_is_refused_and_left_alone(tmp_path):
    (tmp_path / "thesis.tex").write_text("mine")
    with pytest.raises(QuickstartError, match="already holds other files"):
        prepare_workdir(tmp_path, ["grpo"])
    assert [p.name for p in tmp_path.iterdir()] == ["thesis.tex"]
    with pytest.raises(QuickstartError, match="is a file"):
        prepare_workdir(tmp_path / "thesis.tex", ["grpo"])


def test_workdir_made_by_the_quickstart_is_reused_with_its_runs_cleared(tmp_path):
    prepare_workdir(tmp_path / "q", ["grpo", "amir_grpo"])
    (tmp_path / "q" / "grpo" / "checkpoints").mkdir()
    (tmp_path / "q" / "amir_grpo" / "metrics.jsonl").write_text("{}")
    prepare_workdir(tmp_path / "q", ["grpo"])
    assert not any((tmp_path / "q" / "grpo").iterdir())  # redone: nothing verl could resume from
    assert (tmp_path / "q" / "amir_grpo" / "metrics.jsonl").exists()  # not redone: kept
    assert (tmp_path / "q" / MARKER).read_text() == str(os.getpid())


def test_workdir_of_a_running_quickstart_is_refused(tmp_path):
    prepare_workdir(tmp_path, ["grpo"])
    # a live process whose command line names the quickstart module stands for the other quickstart
    other = subprocess.Popen([PY, "-c", "import time; time.sleep(60)", "amir_verl.demo.quickstart"])
    try:
        (tmp_path / MARKER).write_text(str(other.pid))
        with pytest.raises(QuickstartError, match=f"another quickstart \\(pid {other.pid}\\) is running"):
            prepare_workdir(tmp_path, ["grpo"])
    finally:
        other.kill()
        other.wait()
    prepare_workdir(tmp_path, ["grpo"])  # it ended: the folder is free again


def test_workdir_without_write_permission_is_refused(tmp_path):
    if os.geteuid() == 0:  # root writes anywhere a mode allows nothing; sysfs refuses even root
        target = Path("/sys/amir_quickstart_test")
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        target = locked / "q"
    with pytest.raises(QuickstartError, match="permission denied"):
        prepare_workdir(target, ["grpo"])


def test_cli_answers_bad_use_with_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["--workdir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("[quickstart] error: ") and "already holds other files" in err
    with pytest.raises(SystemExit) as exit_info:
        main(["--workdir", str(tmp_path / "new"), "--runs", "grpo,ppo"])
    assert exit_info.value.code == 2 and "unknown ['ppo']" in capsys.readouterr().err
