"""A multi-node Ray cluster on this machine, each node with its own resources and its own environment, as on a cluster
whose login or head node is not a GPU node and need not have the workers' image: verl 0.9.1's real ``main_ppo``
joins it (``+ray_kwargs.ray_init.address=...``), with ``trainer.nnodes=2`` and one (logical) GPU per node.

- The head node (``ray start --head``, no GPU) has the driver's environment, the worker nodes (``ray start
  --address=...``, one GPU each) theirs; each node's Ray workers inherit their node's environment.
- The package is flash-attn, verl's default attention: this machine has none (the test needs that), and a stand-in
  ``flash_attn`` package on a worker node's ``PYTHONPATH`` is what that node's environment adds. A worker that has it
  passes the AMIR worker check and loads the model with sdpa (the CPU backend's patch 10, flash-attention's CPU
  stand-in); one that lacks it stops the run before any model loads there.

Two runs of AMIR-GRPO, one cluster each:

1. Both worker nodes have the package, the driver lacks it: the driver warns and goes on, the run trains, one FSDP
   rank on each worker node (the head has no GPU) over gloo, and its steps are exact against brute force from its
   probe records and its 2-rank checkpoints (:func:`tests.e2e.support.check_update`, as the sequence-parallel run).
2. The second worker node lacks it (a node from another image): its rank stops the run in ``init_model`` with the
   one line naming the package, the host and the fix, before the first step.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from amir_verl.cpu.launch import LoggedCommand, run_logged
from amir_verl.run_config import ATTENTION_PACKAGES, amir_overrides
from tests.e2e.probe import probed
from tests.e2e.support import BETA, DELTA, check_sync_run, processes_printing, train_command
from tests.support import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None,
                                                  reason="the driver's environment must lack flash_attn")]

STEPS, PROMPTS, NODES = 2, 8, 2
RAY_START_TIMEOUT_S, RUN_TIMEOUT_S = 120, 900
STAND_IN = "attn_implementation=flash_attention_2 loads as sdpa"  # patch 10's line, once per process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayNode:
    """One ``ray start --block`` of this machine's cluster, in its own process group; SIGTERM stops it and everything
    it started. Its Ray workers inherit ``env``."""

    def __init__(self, log: Path, env: dict[str, str], *args: str):
        self.log = log
        common = ["--block", "--disable-usage-stats", "--node-ip-address=127.0.0.1", "--min-worker-port=0",
                  "--max-worker-port=0", f"--dashboard-agent-listen-port={free_port()}", "--num-cpus=8"]
        with log.open("w") as out:
            self.process = subprocess.Popen([str(Path(sys.executable).with_name("ray")), "start", *common, *args],
                                            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def cluster_gpus(address: str, env: dict[str, str]) -> tuple[int, float]:
    """(alive nodes, GPUs) that ``ray status`` reports, (0, 0) while the head is not up."""
    ray = str(Path(sys.executable).with_name("ray"))
    result = subprocess.run([ray, "status", f"--address={address}"], env=env, capture_output=True, text=True)
    active = result.stdout.split("Active:")[-1].split("Pending:")[0] if "Active:" in result.stdout else ""
    gpus = re.search(r"/([\d.]+) GPU", result.stdout)
    return active.count("node_"), float(gpus.group(1)) if gpus else 0.0


def start_node(log: Path, env: dict[str, str], args: list[str], address: str, joined: tuple[int, float]) -> RayNode:
    """Start one node and wait until the cluster has ``joined`` (nodes, GPUs); a start that fails or times out is
    retried once (under load Ray's raylet gives up on its dashboard agent after a fixed 15 s: tests/support.py)."""
    for attempt in (1, 2):
        node = RayNode(log.with_name(f"{log.stem}_{attempt}.log"), env, *args)
        deadline = time.monotonic() + RAY_START_TIMEOUT_S
        while node.process.poll() is None and time.monotonic() < deadline:
            if cluster_gpus(address, env) == joined:
                return node
            time.sleep(2)
        node.stop()
    raise AssertionError(f"{log.stem} did not join: " + node.log.read_text()[-3000:])


@contextlib.contextmanager
def ray_cluster(root: Path, head_env: dict[str, str], worker_envs: list[dict[str, str]]):
    """A head node (no GPU, ``head_env``) and one worker node per entry of ``worker_envs`` (one GPU each, that
    environment) -> the cluster's address, once every node has joined. One node at a time: two raylets starting
    together raced (seen)."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    nodes = []
    try:
        nodes.append(start_node(root / "ray_head.log", head_env, ["--head", f"--port={port}", "--num-gpus=0",
                                "--include-dashboard=false", f"--ray-client-server-port={free_port()}"], address, (1, 0.0)))
        for i, env in enumerate(worker_envs, start=1):
            nodes.append(start_node(root / f"ray_worker_{i}.log", env, [f"--address={address}", "--num-gpus=1"], address,
                                    (1 + i, float(i))))
        yield address
    finally:
        for node in reversed(nodes):
            node.stop()


def cluster_command(assets, workdir: Path) -> LoggedCommand:
    """AMIR-GRPO on 2 nodes x 1 GPU, joining the cluster at the address the caller adds; verl's default attention
    (flash_attention_2); a checkpoint every step, token-level IS weights (:func:`check_update` reads them), the probe.
    The CPU settings' own-Ray keys are dropped: they would start a Ray of the run's own."""
    command = probed(train_command(assets, workdir, STEPS, amir_overrides("amir_grpo", beta_dpo=BETA, delta_r=DELTA) + [
        "actor_rollout_ref.model.override_config.attn_implementation=flash_attention_2",
        "algorithm.rollout_correction.rollout_is=token",
    ], save_freq=1), workdir, REPO)
    own_ray = tuple(f"+ray_kwargs.ray_init.{key}=" for key in ("num_cpus", "num_gpus", "include_dashboard", "address",
                                                                "_system_config"))
    command.cmd = [a for a in command.cmd if not a.startswith((*own_ray, "trainer.nnodes="))]
    command.cmd += [f"trainer.nnodes={NODES}"]
    # Ray 2.60's `ray start --head` turns on token authentication; this machine's cluster is reached locally only
    command.env["RAY_AUTH_MODE"] = "disabled"
    return command


def with_stand_in(env: dict[str, str], stand_in: Path) -> dict[str, str]:
    return {**env, "PYTHONPATH": os.pathsep.join([str(stand_in), env["PYTHONPATH"]])}


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory) -> Path:
    """A folder holding a ``flash_attn`` package: what a worker node's image adds to the driver's environment."""
    folder = tmp_path_factory.mktemp("worker_site")
    (folder / "flash_attn").mkdir()
    (folder / "flash_attn" / "__init__.py").write_text('__version__ = "2.8.3"  # the package check finds it\n')
    return folder


def run_on_cluster(assets, root: Path, stand_in: Path, workers_with_package: list[bool]) -> tuple[int, str, Path]:
    workdir = root / "run"
    command = cluster_command(assets, workdir)
    workers = [with_stand_in(command.env, stand_in) if has else command.env for has in workers_with_package]
    with ray_cluster(root, command.env, workers) as address:
        command.cmd.append(f"+ray_kwargs.ray_init.address={address}")
        returncode, log = run_logged(command.cmd, command.env, command.log_path, timeout=RUN_TIMEOUT_S)
    return returncode, log, workdir


@pytest.fixture(scope="module")
def cluster_runs(assets, stand_in, tmp_path_factory) -> dict[str, tuple[int, str, Path]]:
    """{"two nodes" / "mixed nodes": (exit status, output, workdir)}: the two runs, each on its own cluster, side by
    side (the mixed one is nearly all start-up)."""
    layouts = {"two nodes": [True, True], "mixed nodes": [True, False]}  # per worker node: whether it has the package
    with ThreadPoolExecutor(len(layouts)) as pool:
        futures = {name: pool.submit(run_on_cluster, assets, tmp_path_factory.mktemp(name.replace(" ", "_")), stand_in,
                                     workers) for name, workers in layouts.items()}
        return {name: future.result() for name, future in futures.items()}


DRIVER_WARNING = ("amir-verl: actor_rollout_ref.model loads with attn_implementation=flash_attention_2, but the "
                  "flash_attn package is not installed where the driver runs (a worker without it cannot load the model)")


def test_a_run_whose_workers_have_the_package_the_driver_lacks_trains_exactly_on_two_nodes(assets, cluster_runs):
    returncode, log, workdir = cluster_runs["two nodes"]
    assert returncode == 0, log[-5000:]
    assert DRIVER_WARNING in log and log.index(DRIVER_WARNING) < log.index("ray init kwargs")  # warned, went on
    # each rank loaded its model on a worker node, with the package found there (no GPU on the head: one per node)
    assert len(processes_printing(log, STAND_IN) & processes_printing(log, "WorkerDict")) == NODES
    check_sync_run(assets, workdir, STEPS, PROMPTS, world=NODES)  # pairs mined, J_pref, the update's gradient


def test_a_run_with_a_worker_node_that_lacks_the_package_stops_there_naming_it_and_the_fix(cluster_runs):
    returncode, log, _ = cluster_runs["mixed nodes"]
    assert returncode != 0
    assert DRIVER_WARNING in log and log.index(DRIVER_WARNING) < log.index("ray init kwargs")  # warned, went on
    line = ("actor_rollout_ref.model loads with attn_implementation=flash_attention_2, but the flash_attn package is "
            "not installed on this worker (host @): install it (" + ATTENTION_PACKAGES["flash_attention_2"][1] +
            "), or run with PyTorch's attention: +actor_rollout_ref.model.override_config.attn_implementation=sdpa")
    worker = re.escape(line).replace("@", "[^)]+")  # raised in the worker's init_model, before verl builds the model
    assert re.search(r"WorkerDict\.actor_rollout_ref_init_model\(\)[^\n]*\n(.*\n)*?ValueError: " + worker + "\n", log), \
        log[-5000:]
    assert "step:1" not in log
