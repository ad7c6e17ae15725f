"""What the end-to-end modules share: the toy task's model, tokenizer and data, made once (runs only read them), and
the runs that start beside the paper pipeline's last stages."""

from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from tests.support import PAPER_E2E

# a run whose engine fails, nearly all of it start-up (main_ppo's output ended 3 s after the engine's error): 88 s
# alone, 222 s beside the paper pipeline's last stages (CI's whole suite, 2026-12-06), more on a slower machine; a hang
# (the fear) runs into this and fails with TimeoutError
ENGINE_FAILURE_TIMEOUT_S = 600


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    from amir_verl.demo.toy_task import make_assets

    return make_assets(tmp_path_factory.mktemp("toy"), n_train=64, n_test=8)


@pytest.fixture(scope="session")
def engine_failure_run(assets, tmp_path_factory) -> Future:
    """A run whose vLLM engine cannot run the model: the toy model (hidden 64, 4 heads of 16; vLLM's CPU attention
    needs a head size of at least 32) on verl's vllm rollout, started on a thread of its own -> the Future of its
    :class:`tests.e2e.support.Launch`."""
    from amir_verl.cpu.settings import vllm_rollout_env, vllm_rollout_settings
    from tests.e2e.support import run_alone, train_command

    command = train_command(assets, tmp_path_factory.mktemp("vllm") / "head_size_16", 1, vllm_rollout_settings())
    command.env.update(vllm_rollout_env())
    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(run_alone, "head_size_16", command, ENGINE_FAILURE_TIMEOUT_S)


@pytest.fixture(scope="session")
def bad_config_runs(assets, tmp_path_factory) -> Future:
    """Every bad config's run (:data:`tests.e2e.support.BAD_CONFIGS`), each on its own (one failing must not stop the
    others), two at a time, on a thread of their own -> the Future of {id: (exit status, its output: what its
    main_ppo.log holds)}. Each stops on the driver before Ray starts: one process, about 5 CPU-s and 0.6 GB."""
    from amir_verl.cpu.launch import run_logged
    from tests.e2e.support import BAD_CONFIGS, train_command

    root = tmp_path_factory.mktemp("bad")

    def launch(name: str) -> tuple[int, str]:
        command = train_command(assets, root / name, 1, BAD_CONFIGS[name][0])
        return run_logged(command.cmd, command.env, command.log_path, timeout=600)

    def launch_all() -> dict[str, tuple[int, str]]:
        with ThreadPoolExecutor(2) as runs:
            return dict(zip(BAD_CONFIGS, runs.map(launch, BAD_CONFIGS)))

    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(launch_all)


# the runs that go beside the pipeline's last stages where the session asks for them, those that need little memory:
# fixture -> whether it needs vLLM's CPU build
BESIDE_THE_PIPELINE = {"engine_failure_run": True, "bad_config_runs": False}


@pytest.fixture(scope="session", autouse=True)
def beside_the_pipeline(request) -> list[Future]:
    """The runs that start as the first end-to-end test sets up, where the session holds the paper pipeline's tests
    (tests/conftest.py runs them first) and a test that asks for the run: the pipeline's tests wait for its last
    stages, about 4 minutes with a core to spare (CI, 2026-12-06: 85% busy). The pipeline holds about 13 GB, so only
    runs that need little memory go beside it: the engine-failure run (about 4.5 GB), which otherwise runs alone
    after the vLLM module's two training runs (beside them, the three peaked at 20.7 of CI's 24 GB), and the bad
    configs (one process each, two at a time), which otherwise run when their test module reaches them."""
    from amir_verl.cpu.settings import vllm_installed

    items = request.session.items
    if not any(item.nodeid.startswith(PAPER_E2E) for item in items):
        return []
    wanted = {fixture for item in items for fixture in getattr(item, "fixturenames", ()) if fixture in BESIDE_THE_PIPELINE}
    return [request.getfixturevalue(fixture) for fixture, needs_vllm in BESIDE_THE_PIPELINE.items()
            if fixture in wanted and (vllm_installed() or not needs_vllm)]


@pytest.fixture(scope="module", autouse=True)
def after_the_runs_beside_the_pipeline(request, beside_the_pipeline):
    """Every other module's runs start once those beside the pipeline have ended: they would not fit in memory
    beside them (the async schedules' three vLLM runs peaked at 17.2 to 19.1 GiB in CI)."""
    if not request.node.nodeid.startswith(PAPER_E2E):
        for run in beside_the_pipeline:
            run.result()
