"""The measured figures' one home: ``docs/results/<name>.md``, written by the script that measures them.

Pure Python (no torch, no verl): ``benchmarks/gpu_check.py`` loads it by file path. A results file is

    <!-- written by the measuring script; do not edit by hand -->
    Measured with `<command>` on <UTC date>, <N> CPU cores (<cpu model>), commit <short sha>[, dirty].

    <body: a Markdown table or a text block>

and the documentation pages include it (``{include} results/<name>.md``). "dirty": the checkout's tracked files
(outside ``docs/results/``) had uncommitted changes when the figures were measured.
"""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS_DIR = ROOT / "docs"
MARKER = "<!-- written by the measuring script; do not edit by hand -->"


def results_path(name: str, docs_dir: Path | str | None = None) -> Path:
    """Where the figures called ``name`` live: ``<docs_dir>/results/<name>.md`` (default: this checkout's docs/)."""
    return Path(DOCS_DIR if docs_dir is None else docs_dir) / "results" / f"{name}.md"


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def commit_label() -> str:
    """``<short sha>``, with ``, dirty`` when tracked files differ from it; ``unknown`` outside a git clone."""
    sha = _git("rev-parse", "--short", "HEAD")
    if not sha:
        return "unknown"
    changes = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)docs/results")
    return f"{sha}, dirty" if changes else sha


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "model unknown"


def header(command: str, date: str | None = None, cores: int | None = None, model: str | None = None,
           commit: str | None = None) -> str:
    """The line that says how the figures were measured."""
    date = date or time.strftime("%Y-%m-%d", time.gmtime())
    cores = cores if cores is not None else os.cpu_count()
    return (f"Measured with `{command}` on {date} UTC, {cores} CPU cores ({model or cpu_model()}), "
            f"commit {commit or commit_label()}.")


def write_results(name: str, command: str, body: str, docs_dir: Path | str | None = None, **how) -> Path:
    """Write ``docs/results/<name>.md``: the marker, :func:`header` (``how`` passes its date, cores, model or
    commit when they are not this machine's and this checkout's), the body. Returns the path."""
    path = results_path(name, docs_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{MARKER}\n{header(command, **how)}\n\n{body.strip()}\n")
    return path


def script_command(argv: list[str] | None = None, prefix: str | None = None) -> str:
    """The command that ran this script, as a reader would retype it: ``python benchmarks/x.py --flag``."""
    argv = sys.argv if argv is None else argv
    if prefix is None:
        script = Path(argv[0]).resolve()
        prefix = "python " + (str(script.relative_to(ROOT)) if script.is_relative_to(ROOT) else script.name)
    return " ".join([prefix, *(shlex.quote(a) for a in argv[1:])])


def text_block(text: str) -> str:
    return f"```text\n{text.strip()}\n```"


class _Tee(io.TextIOBase):
    def __init__(self, stream):
        self.stream, self.copy = stream, io.StringIO()

    def write(self, s):
        self.copy.write(s)
        return self.stream.write(s)

    def flush(self):
        self.stream.flush()

    def fileno(self):  # what writes to the descriptor itself (a child process) is printed, not kept
        return self.stream.fileno()

    def isatty(self):
        return self.stream.isatty()


@contextlib.contextmanager
def printed():
    """Prints as usual and keeps a copy: ``with printed() as out: ...; out.getvalue()``."""
    tee = _Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        yield tee.copy


def print_or_record(name: str | None, report: Callable[[], None]) -> None:
    """Run ``report`` (which prints a benchmark's figures); with a ``name`` also write what it printed, as a text
    block, to ``docs/results/<name>.md`` under the command that ran this script."""
    if name is None:
        report()
        return
    with printed() as out:
        report()
    print(f"wrote {write_results(name, script_command(), text_block(out.getvalue()))}")
