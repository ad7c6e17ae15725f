"""Launch ``python -m verl.trainer.main_ppo`` on the CPU backend as a child process and read its metrics.

Each child runs in its own process group (session), so that a timeout or a Ctrl-C of the launcher stops
main_ppo together with everything it started (Ray's GCS and raylet, the Ray workers) in one signal, and
a terminal's Ctrl-C reaches only the launcher, which then stops the child in order. Several runs can go
side by side (:func:`run_main_ppo_together`), each with a Ray of its own.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from amir_verl.cpu import SWITCH
from amir_verl.cpu.settings import OPENMP_ENV

GRACE_S = 5.0  # SIGTERM to SIGKILL
_CONSOLE = threading.Lock()


def print_line(text: str, file=None) -> None:
    """``text`` and its newline onto the console (stdout, or ``file``) in one piece, from any thread: the reader
    threads of runs side by side print at once, and ``print`` writes its text and its newline apart, so two lines
    can otherwise merge into one ("a" "b" "\\n" "\\n")."""
    with _CONSOLE:
        print(text, file=file, flush=True)


class MainPPOFailed(RuntimeError):
    """main_ppo exited with an error; ``reason`` is one line, ``log_path`` holds the full output, ``run`` names
    the run among several side by side."""

    def __init__(self, returncode: int, reason: str, output: str, log_path: Path | None, run: str = "main_ppo"):
        self.returncode, self.reason, self.log_path, self.run = returncode, reason, log_path, run
        where = f"; full log: {log_path}" if log_path else ""
        super().__init__(f"main_ppo exited with {returncode}: {reason}{where}\n{output[-6000:]}")


VERL_METRICS_FILE = "verl_metrics.jsonl"  # verl's file logger's output, beside the run's main_ppo.log


def verl_metrics_path(log_path: Path) -> Path:
    """Where a run logged to ``log_path`` has verl's file logger (``trainer.logger`` ``file``) write its metrics."""
    return log_path.with_name(VERL_METRICS_FILE)


def parse_verl_metrics_record(raw: bytes | str) -> tuple[int, dict[str, float]]:
    """One line of verl's ``FileLogger`` (``verl/utils/tracking.py``), ``{"step": N, "data": {key: value}}`` ->
    (N, {key: value}), numbers only. orjson writes NaN and infinities as ``null``: those come back as NaN."""
    record = json.loads(raw)
    metrics = {}
    for key, value in record["data"].items():
        if value is None:
            metrics[key] = math.nan
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            metrics[key] = float(value)
    return int(record["step"]), metrics


def read_verl_metrics(path: Path) -> dict[int, dict[str, float]]:
    """A run's metrics as verl's file logger wrote them (:func:`verl_metrics_path`) -> {step: {key: value}}
    (the records of a step merged; step 0 holds the validation before training); {} if verl wrote none.

    The file, not verl's console line: Ray forwards a worker's long line in pieces under load (a 50 kB
    validation line once reached the launcher as two), and a piece lost is a metric silently missing."""
    steps: dict[int, dict[str, float]] = {}
    if path.exists():
        for raw in path.read_bytes().splitlines():
            if raw.strip():
                step, metrics = parse_verl_metrics_record(raw)
                steps.setdefault(step, {}).update(metrics)
    return steps


# (pattern in main_ppo's output, the one-line explanation); the first match wins
KNOWN_FAILURES = [
    (re.compile(r"address already in use|failed to bind|port \d+ .*(in use|taken)", re.I),
     "a network port main_ppo or Ray needs is already in use (another Ray or verl run on this machine?): "
     "stop it or retry in a minute"),
    (re.compile(r"connect(ing)? to (an )?existing (Ray )?cluster|Could not find any running Ray instance|"
                r"Failed to connect to GCS", re.I),
     "Ray tried to join a Ray instance that is not this run's own: unset RAY_ADDRESS, or keep "
     "+ray_kwargs.ray_init.address=local"),
    (re.compile(r"No space left on device", re.I), "the disk is full (Ray writes its session under /tmp/ray)"),
    (re.compile(r"Permission denied", re.I), "permission denied writing a file (the workdir, or /tmp/ray)"),
]
_ERROR_LINE = re.compile(r"^\s*(?:\(\w+ pid=\d+\)\s*)?([\w.]*(?:Error|Exception|Exit)\w*: .+)$")
# verl's vllm rollout: vLLM's engine core logs its worker's error once; what follows in the output comes from it
# (EngineDeadError in every request, then verl's replay buffer finding no trajectory), and the last error line
# names neither the rollout nor the cause
_VLLM_WORKER_FAILED = re.compile(r"Worker failed with error '(.+?)', please check")
_VLLM_ENGINE_DEAD = "EngineDeadError"
_VLLM_ENGINE_EXITED = "engine core exited unexpectedly"  # vLLM's front end, when the engine core process is gone
# Output after which verl 0.9.1 may never stop by itself: its vLLM engine is dead (a request in flight gets
# EngineDeadError and the run stops; seen: the engine core killed between rollouts, and main_ppo then waited with
# no further output). A child
# that prints it and is still running FATAL_GRACE_S later is stopped by the launcher, as a failure.
FATAL_OUTPUT = re.compile(f"{_VLLM_ENGINE_DEAD}|{_VLLM_ENGINE_EXITED}")
FATAL_GRACE_S = 10.0  # time to stop on its own (an engine that fails at start: main_ppo's output ended 3 s after)
# hydra refusing an override prints no "...Error:" line: "Could not override 'amir.x'.", then its advice
# ("To append to your config use +amir.x=1") and the reason ("Key 'x' is not in struct")
_HYDRA_OVERRIDE = re.compile(r"^(Could not (?:override|append to config|delete from config)\b.*)\n(.*)\n(.*)$", re.M)


def failure_reason(output: str) -> str:
    """One line saying why main_ppo failed: a known cause, else its last ``SomethingError: message`` line."""
    for pattern, explanation in KNOWN_FAILURES:
        if pattern.search(output):
            return explanation
    hydra = _HYDRA_OVERRIDE.search(output)
    if hydra:
        return "hydra: " + " ".join(line.strip() for line in hydra.groups() if line.strip())[:300]
    worker_failed = _VLLM_WORKER_FAILED.search(output)
    if worker_failed or _VLLM_ENGINE_DEAD in output or _VLLM_ENGINE_EXITED in output:
        cause = (worker_failed.group(1)[:300] if worker_failed else
                 "its engine core process exited unexpectedly (killed? out of memory?)" if _VLLM_ENGINE_EXITED in output
                 else "its error is in the log, above the first EngineDeadError")
        return f"verl's vllm rollout: the vLLM engine failed: {cause}"
    errors = [m.group(1).strip() for m in map(_ERROR_LINE.match, output.splitlines()) if m]
    return errors[-1][:300] if errors else "no error message (see the log)"


def stop_process_group(proc: subprocess.Popen, grace_s: float = GRACE_S) -> None:
    """SIGTERM the child's process group, SIGKILL what is left after ``grace_s``."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, grace_s)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            # the leader exited; its group may still hold Ray processes
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue
        return


@contextlib.contextmanager
def _signals_handled_as(handler, signals):
    """``signals`` go to ``handler`` inside the block, where this thread may set them (Python's main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def stops_on_sigterm(main: Callable[..., int]) -> Callable[..., int]:
    """``main`` with SIGTERM (a job scheduler's stop, ``kill``, ``timeout``) handled as Ctrl-C: a
    KeyboardInterrupt, whose clean-up in :func:`run_logged_together` stops every main_ppo it started. Those run
    in sessions of their own, so a signal to the launcher alone would leave them, and their Ray, running."""

    @functools.wraps(main)
    def stopping(*args, **kwargs):
        with _signals_handled_as(_interrupt, (signal.SIGTERM,)):
            return main(*args, **kwargs)

    return stopping


@dataclass
class LoggedCommand:
    """A command to run in its own process group, its output (stdout and stderr) teed line by line to
    ``log_path`` and ``on_line``."""

    cmd: list[str]
    env: dict[str, str] | None = None
    log_path: Path | None = None
    on_line: Callable[[str], None] | None = None


class _Child:
    """A started :class:`LoggedCommand`: the process and the thread that reads its output (which notes when the
    child first printed :data:`FATAL_OUTPUT`)."""

    def __init__(self, command: LoggedCommand):
        self.command, self.lines = command, []
        self.fatal_at: float | None = None
        self.on_line_error: Exception | None = None  # what ``on_line`` raised; it is not called again
        log = open(command.log_path, "w", buffering=1) if command.log_path is not None else None
        self.proc = subprocess.Popen(command.cmd, env=command.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)

        def pump() -> None:
            try:
                for line in self.proc.stdout:
                    self.lines.append(line)
                    if self.fatal_at is None and FATAL_OUTPUT.search(line):
                        self.fatal_at = time.monotonic()
                    if log is not None:
                        log.write(line)
                    if command.on_line is not None and self.on_line_error is None:
                        try:
                            command.on_line(line)
                        except Exception as error:  # the reading goes on: a child writing into a pipe nobody
                            self.on_line_error = error  # reads blocks for ever (seen: a run hung at step 1)
            finally:  # here, not in the caller: a process still holding the pipe may write after a join times out
                if log is not None:
                    log.close()

        self.reader = threading.Thread(target=pump, name="child-output", daemon=True)
        self.reader.start()

    def ended(self) -> bool:
        """Exited, or still running FATAL_GRACE_S after printing FATAL_OUTPUT (then :meth:`finish` stops it)."""
        return self.proc.poll() is not None or (
            self.fatal_at is not None and time.monotonic() - self.fatal_at > FATAL_GRACE_S)

    def finish(self) -> tuple[int, str]:
        """Stop the process's group (what an exited process left: Ray processes would hold the output pipe open;
        or the process itself, when :meth:`ended` says so), then return its exit status and output."""
        stop_process_group(self.proc)
        self.reader.join(timeout=GRACE_S)
        if not self.reader.is_alive():  # closing it under a reading thread would raise there
            self.proc.stdout.close()
        return self.proc.returncode, "".join(self.lines)


POLL_S = 0.1


def run_logged_together(commands: dict[str, LoggedCommand], timeout: float | None = None) -> dict[str, tuple[int, str]]:
    """Run ``commands`` side by side, each in its own process group; returns {name: (exit status, output)}
    in the order they ended, once all have.

    A command that exits with an error stops the others at once (their status is then the stopping
    signal's, negative). So does one still running :data:`FATAL_GRACE_S` after printing :data:`FATAL_OUTPUT`,
    which is stopped first (its status: the stopping signal's). ``timeout`` (seconds, wall clock, for all of
    them) holds whether or not they print anything: on it, ``TimeoutError`` naming the commands still running.
    A command's ``on_line`` that raises stops them all too: ``RuntimeError`` naming the command, from the callback's
    error (its output is still read to the end meanwhile, so the child never blocks on a full pipe).
    On the timeout, on ``KeyboardInterrupt`` and on any other exception every process group is stopped before
    the exception propagates."""
    deadline = None if timeout is None else time.monotonic() + timeout
    children: dict[str, _Child] = {}
    results: dict[str, tuple[int, str]] = {}
    try:
        for name, command in commands.items():
            children[name] = _Child(command)
        while len(results) < len(children):
            for name, child in children.items():
                if child.on_line_error is not None:  # the caller's callback failed: its error, every group stopped
                    raise RuntimeError(f"{name}: its on_line callback raised {child.on_line_error!r}") \
                        from child.on_line_error
                if name not in results and child.ended():
                    results[name] = child.finish()
                    if results[name][0] != 0:
                        for other, rest in children.items():
                            if other not in results:
                                results[other] = rest.finish()
            if deadline is not None and time.monotonic() > deadline and len(results) < len(children):
                running = ", ".join(name for name in children if name not in results)
                raise TimeoutError(f"{running} ran over {timeout:.0f} s and was stopped")  # stopped below
            time.sleep(POLL_S)
    except BaseException:  # Ctrl-C above all: a second one (or a SIGTERM) must not cut the stopping short
        stop_all(children)
        raise
    return results


def stop_all(children: dict[str, _Child]) -> None:
    """Stop every child's process group with SIGINT and SIGTERM ignored meanwhile (restored after), so that a
    second Ctrl-C or a scheduler's second SIGTERM cannot cut the stopping short, even one that lands before they
    are ignored: its KeyboardInterrupt starts the stopping again (seen once, under load: a launcher that printed
    'interrupted' and left both of its children running)."""
    stopping = (signal.SIGINT, signal.SIGTERM)
    main_thread = threading.current_thread() is threading.main_thread()  # only it sets signals, only it gets them
    previous = None
    while True:
        try:
            if main_thread:
                previous = previous or {sig: signal.getsignal(sig) for sig in stopping}
                for sig in stopping:
                    signal.signal(sig, signal.SIG_IGN)
            for child in children.values():
                stop_process_group(child.proc)
            break
        except KeyboardInterrupt:
            continue
    for sig, handler in (previous or {}).items():
        signal.signal(sig, handler)


def run_logged(cmd: list[str], env: dict[str, str] | None = None, log_path: Path | None = None,
               timeout: float | None = None, on_line: Callable[[str], None] | None = None) -> tuple[int, str]:
    """Run one command as :func:`run_logged_together` does; returns its exit status and output."""
    name = " ".join(cmd[:3])
    return run_logged_together({name: LoggedCommand(cmd, env, log_path, on_line)}, timeout)[name]


def main_ppo_env(log_path: Path | None = None) -> dict[str, str]:
    """The environment of a CPU-backend main_ppo: the switch on, verl's file logger writing to
    :func:`verl_metrics_path` of ``log_path`` (nowhere without one: verl would write into the working
    directory), and :data:`~amir_verl.cpu.settings.OPENMP_ENV` where the environment does not set it (Ray's workers
    inherit it)."""
    metrics = verl_metrics_path(log_path) if log_path is not None else Path(os.devnull)
    return {**OPENMP_ENV, **os.environ, SWITCH: "1", "TOKENIZERS_PARALLELISM": "false", "RAY_DEDUP_LOGS": "0",
            "VERL_FILE_LOGGER_PATH": str(metrics)}


def main_ppo_command(overrides: list[str], log_path: Path | None = None,
                     on_line: Callable[[str], None] | None = None) -> LoggedCommand:
    """``python -m verl.trainer.main_ppo <overrides>`` on the CPU backend, its output to ``log_path`` and
    ``on_line`` (with neither it is echoed to stdout), its metrics to :func:`verl_metrics_path` of ``log_path``."""
    if log_path is None and on_line is None:
        on_line = lambda line: print_line(line.rstrip("\n"))  # noqa: E731
    return LoggedCommand([sys.executable, "-m", "verl.trainer.main_ppo", *overrides], main_ppo_env(log_path), log_path,
                         on_line)


def run_main_ppo_together(runs: dict[str, LoggedCommand], timeout: float | None = None) -> dict[str, str]:
    """Run several :func:`main_ppo_command` side by side (each with its own Ray); returns {name: output}.

    The first run to fail stops the others and raises :class:`MainPPOFailed` naming it, with a one-line
    reason."""
    results = run_logged_together(runs, timeout)
    for name, (returncode, output) in results.items():
        if returncode != 0:
            raise MainPPOFailed(returncode, failure_reason(output), output, runs[name].log_path, run=name)
    return {name: output for name, (_, output) in results.items()}


def run_main_ppo(overrides: list[str], log_path: Path | None = None, timeout: float | None = None,
                 on_line: Callable[[str], None] | None = None) -> str:
    """Run one :func:`main_ppo_command`; returns its output, raises :class:`MainPPOFailed` if it fails."""
    return run_main_ppo_together({"main_ppo": main_ppo_command(overrides, log_path, on_line)}, timeout)["main_ppo"]
