"""The suite's own helpers where they decide something: :func:`tests.support.start_local_ray`'s one retry, and a
:class:`tests.support.FreshPython` past its timeout."""

import subprocess

import pytest
import ray

from tests.support import FreshPython, start_local_ray

STARTUP_TIMEOUT = ("The current node timed out during startup. This could happen because some of the raylet failed "
                   "to startup or the GCS has become overloaded.")  # Ray 2.60's words (ray/_private/node.py)


def test_a_ray_that_timed_out_starting_is_started_once_more_and_any_other_failure_is_raised(monkeypatch):
    calls = []

    def init(failures):
        def fake_init(**kwargs):
            calls.append(kwargs)
            if failures:
                raise failures.pop(0)
        return fake_init

    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr(ray, "init", init([Exception(STARTUP_TIMEOUT)]))
    start_local_ray(num_cpus=3)
    assert [c if c == "shutdown" else (c["num_cpus"], c["address"]) for c in calls] == [
        (3, "local"), "shutdown", (3, "local")]

    calls.clear()
    monkeypatch.setattr(ray, "init", init([Exception(STARTUP_TIMEOUT), Exception(STARTUP_TIMEOUT)]))
    with pytest.raises(Exception, match="timed out during startup"):
        start_local_ray(num_cpus=1)
    assert len(calls) == 3

    calls.clear()
    monkeypatch.setattr(ray, "init", init([ValueError("num_cpus must be positive")]))
    with pytest.raises(ValueError):
        start_local_ray(num_cpus=1)
    assert len(calls) == 1


def test_a_fresh_python_past_its_timeout_is_killed():
    sleeper = FreshPython("import time; time.sleep(600)", {})
    with pytest.raises(subprocess.TimeoutExpired):
        sleeper.stdout_lines(timeout=0.5)
    assert sleeper.proc.poll() is not None
