"""Launch ``python -m verl.trainer.main_ppo`` on the CPU backend as a child process and read its metrics.

The child runs in its own process group (session), so that a timeout or a Ctrl-C of the launcher stops
main_ppo together with everything it started (Ray's GCS and raylet, the Ray workers) in one signal, and
a terminal's Ctrl-C reaches only the launcher, which then stops the child in order.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

from amir_verl.cpu import SWITCH

_NUMPY_SCALAR = re.compile(r"^np\.\w+\((.*)\)$")
GRACE_S = 5.0  # SIGTERM to SIGKILL


class MainPPOFailed(RuntimeError):
    """main_ppo exited with an error; ``reason`` is one line, ``log_path`` holds the full output."""

    def __init__(self, returncode: int, reason: str, output: str, log_path: Path | None):
        self.returncode, self.reason, self.log_path = returncode, reason, log_path
        where = f"; full log: {log_path}" if log_path else ""
        super().__init__(f"main_ppo exited with {returncode}: {reason}{where}\n{output[-6000:]}")


def parse_metrics_line(line: str) -> tuple[int, dict[str, float]] | None:
    """One line of verl's console logger, ``... step:N - key:value - ...`` -> (N, {key: value}) (numbers
    only; verl prints numpy scalars as ``np.float64(0.5)``); None for any other line."""
    at = line.find("step:")
    if at < 0 or " - " not in line[at:]:
        return None
    fields = line[at:].strip().split(" - ")
    try:
        step = int(fields[0].split(":", 1)[1])
    except ValueError:
        return None
    metrics = {}
    for field in fields[1:]:
        key, _, raw = field.rpartition(":")
        match = _NUMPY_SCALAR.match(raw)
        try:
            metrics[key] = float(match.group(1) if match else raw)
        except ValueError:
            pass
    return step, metrics


def parse_step_metrics(output: str) -> dict[int, dict[str, float]]:
    """All of verl's console metric lines of ``output`` -> {step: {key: value}} (lines of a step merged)."""
    steps: dict[int, dict[str, float]] = {}
    for line in output.splitlines():
        parsed = parse_metrics_line(line)
        if parsed is not None:
            steps.setdefault(parsed[0], {}).update(parsed[1])
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


def failure_reason(output: str) -> str:
    """One line saying why main_ppo failed: a known cause, else its last ``SomethingError: message`` line."""
    for pattern, explanation in KNOWN_FAILURES:
        if pattern.search(output):
            return explanation
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
def _sigint_ignored():
    """Ignore SIGINT (Ctrl-C) inside the block, where this thread may (Python's main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def run_logged(cmd: list[str], env: dict[str, str] | None = None, log_path: Path | None = None,
               timeout: float | None = None, on_line: Callable[[str], None] | None = None) -> tuple[int, str]:
    """Run ``cmd`` in its own process group, teeing its output (stdout and stderr) line by line to
    ``log_path`` and ``on_line``; returns its exit status and output. ``timeout`` (seconds, wall clock) holds whether or not
    the child prints anything. On timeout (``TimeoutError``), on ``KeyboardInterrupt`` and on any other
    exception the whole process group is stopped before the exception propagates."""
    log = open(log_path, "w", buffering=1) if log_path is not None else None
    lines: list[str] = []
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True) as proc:

        def pump() -> None:
            try:
                for line in proc.stdout:
                    lines.append(line)
                    if log is not None:
                        log.write(line)
                    if on_line is not None:
                        on_line(line)
            finally:  # here, not in the caller: a process still holding the pipe may write after a join times out
                if log is not None:
                    log.close()

        reader = threading.Thread(target=pump, name="main_ppo-output", daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_process_group(proc)
            raise TimeoutError(f"{' '.join(cmd[:3])} ran over {timeout:.0f} s and was stopped") from None
        except BaseException:  # Ctrl-C above all: a second one must not cut the stopping short
            with _sigint_ignored():
                stop_process_group(proc)
            raise
        else:  # what the child left in its group (Ray processes) would hold the output pipe open
            stop_process_group(proc)
        finally:
            reader.join(timeout=GRACE_S)
    return proc.returncode, "".join(lines)


def main_ppo_env() -> dict[str, str]:
    """The environment of a CPU-backend main_ppo: the switch on."""
    return dict(os.environ, **{SWITCH: "1", "TOKENIZERS_PARALLELISM": "false", "RAY_DEDUP_LOGS": "0"})


def run_main_ppo(overrides: list[str], log_path: Path | None = None, timeout: float | None = None,
                 on_line: Callable[[str], None] | None = None) -> str:
    """Run ``python -m verl.trainer.main_ppo <overrides>`` on the CPU backend; returns its output.

    The output goes to ``log_path`` and to ``on_line``; with neither it is echoed to stdout. A non-zero
    exit raises :class:`MainPPOFailed` with a one-line reason."""
    if log_path is None and on_line is None:
        on_line = lambda line: print(line, end="", flush=True)  # noqa: E731
    returncode, output = run_logged([sys.executable, "-m", "verl.trainer.main_ppo", *overrides], main_ppo_env(),
                                    log_path, timeout, on_line)
    if returncode != 0:
        raise MainPPOFailed(returncode, failure_reason(output), output, log_path)
    return output
