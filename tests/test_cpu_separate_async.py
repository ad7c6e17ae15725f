"""The CPU pieces verl's ``separate_async`` trainer needs: the checkpoint engine ``cpu_object_store`` (with the
``hf`` adapter that consumes it) and the snapshot patch of ``fsdp2_sharded_save_to_cpu``."""

import asyncio
import os
import subprocess
import sys

import pytest
import ray
import torch

from amir_verl.cpu.checkpoint_engine import BACKEND_NAME, ObjectStoreCheckpointEngine, bucketed
from tests.support import start_local_ray


@pytest.fixture(scope="module")
def local_ray():
    start_local_ray(num_cpus=4)
    yield
    ray.shutdown()


def weights(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [(f"layer{i}.weight", torch.randn(5 + i, 7, generator=generator)) for i in range(6)] + [
        ("embed.weight", torch.randn(64, 8, generator=generator).to(torch.bfloat16)),
        ("norm.weight", torch.ones(3, dtype=torch.float64)),
    ]


def test_buckets_hold_at_most_bucket_size_bytes_and_keep_the_order():
    named = weights()
    sizes = [t.numel() * t.element_size() for _, t in named]
    buckets = bucketed(named, bucket_size=600)
    assert [name for bucket in buckets for name, _ in bucket] == [name for name, _ in named]
    assert len(buckets) > 3
    for bucket in buckets:  # a bucket over the size holds a single larger tensor
        total = sum(t.numel() * t.element_size() for _, t in bucket)
        assert total <= 600 or len(bucket) == 1
    assert max(sizes) > 600


def sync(actors: list, rollouts: list, named, global_steps=3) -> list[list]:
    """verl's CheckpointEngineManager.update_weights for one sync, in process: prepare every worker, build the
    topology from the metadata (actor rank 0 first), init, send on every actor rank while the rollout workers
    receive, finalize. Returns what each rollout worker received."""
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    backend = CheckpointEngineRegistry.get(BACKEND_NAME)
    metadata = [engine.prepare() for engine in actors + rollouts]
    actor_kwargs, rollout_kwargs = backend.build_topology(len(actors), len(rollouts), metadata)
    for engines, kwargs in ((actors, actor_kwargs), (rollouts, rollout_kwargs)):
        for rank, engine in enumerate(engines):
            engine.init_process_group(**{key: values[rank] for key, values in kwargs.items()})

    async def receive(engine):
        return [(name, tensor) async for name, tensor in engine.receive_weights(global_steps=global_steps)]

    async def run():
        # the actor ranks each drain their own generator (the gathers are collective)
        sends = [engine.send_weights(iter(list(named)), global_steps=global_steps) for engine in actors]
        return await asyncio.gather(*[receive(engine) for engine in rollouts], *sends)

    received = asyncio.run(run())[: len(rollouts)]
    for engine in actors + rollouts:
        engine.finalize()
    return received


def test_a_sync_delivers_every_tensor_bit_identical_to_every_rollout_worker_across_buckets(local_ray):
    actors = [ObjectStoreCheckpointEngine(bucket_size=600, is_master=rank == 0) for rank in range(2)]
    rollouts = [ObjectStoreCheckpointEngine(bucket_size=600) for _ in range(2)]
    named = weights()
    for _ in range(2):  # two syncs one after the other, as every step does
        for received in sync(actors, rollouts, named):
            assert [name for name, _ in received] == [name for name, _ in named]
            for (_, got), (_, sent) in zip(received, named):
                assert got.dtype == sent.dtype and torch.equal(got, sent)
    with pytest.raises(RuntimeError, match="master"):
        ObjectStoreCheckpointEngine.build_topology(1, 1, [{}, {}])


def test_the_hf_adapter_of_a_standalone_replica_loads_what_the_engine_delivers(local_ray, tmp_path, monkeypatch):
    """verl's CheckpointEngineWorker builds the adapter with replica_rank= and hands it receive_weights(), an
    async generator: the adapter must feed that replica's server (not the one its RANK points to)."""
    from omegaconf import OmegaConf

    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import HFModelConfig, RolloutConfig

    from amir_verl.cpu.hf_rollout import HFRolloutServer, HFServerAdapter, server_actor_name
    from amir_verl.demo.toy_task import make_assets

    assets = make_assets(tmp_path, n_train=2, n_test=1)
    config = RolloutConfig(name="hf", prompt_length=32, response_length=4)
    model_config = omega_conf_to_dataclass(OmegaConf.create({"_target_": "verl.workers.config.HFModelConfig",
                                                             "path": assets["model"]}), HFModelConfig)
    server = ray.remote(HFRolloutServer).options(name=server_actor_name(3), num_cpus=0).remote(config, model_config, 3)
    state = ray.get(server.__ray_call__.remote(lambda srv: {k: v.clone() for k, v in srv.model.state_dict().items()}))
    new_state = [(name, tensor + 1.0) for name, tensor in state.items()]

    actor = ObjectStoreCheckpointEngine(bucket_size=4096, is_master=True)
    rollout = ObjectStoreCheckpointEngine(bucket_size=4096)
    metadata = [actor.prepare(), rollout.prepare()]
    actor_kwargs, rollout_kwargs = ObjectStoreCheckpointEngine.build_topology(1, 1, metadata)
    actor.init_process_group(**{k: v[0] for k, v in actor_kwargs.items()})
    rollout.init_process_group(**{k: v[0] for k, v in rollout_kwargs.items()})
    monkeypatch.setenv("RANK", "0")  # the CheckpointEngineWorker's rank in its own group
    adapter = HFServerAdapter(config=config, model_config=model_config, device_mesh=None, replica_rank=3)
    assert adapter.replica_rank == 3 and adapter.is_leader_rank

    async def run():
        await asyncio.gather(actor.send_weights(iter(new_state), global_steps=5),
                             adapter.update_weights(rollout.receive_weights(global_steps=5), global_steps=5))

    asyncio.run(run())
    served = ray.get(server.__ray_call__.remote(lambda srv: (srv.model.state_dict(), srv.global_steps)))
    assert served[1] == 5
    for name, tensor in new_state:
        assert torch.equal(served[0][name], tensor), name
    actor.finalize()
    rollout.finalize()
    ray.kill(server)


SNAPSHOT = r"""
import os, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000), RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo", rank=0, world_size=1)
import verl  # the plugin, with AMIR_VERL_CPU=1 the CPU backend's patches
from verl.utils import fsdp_utils
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
fully_shard(model)
before = {name: p.detach().to_local().clone() for name, p in model.named_parameters()}
state, spec = fsdp_utils.fsdp2_sharded_save_to_cpu(model)  # pi_old, as DetachActorWorker.save_model_to_cpu
with torch.no_grad():
    for p in model.parameters():
        p.to_local().add_(1.0)  # an optimizer step
saved_moved = any(not torch.equal(state[name][0], before[name]) for name in before)
fsdp_utils.fsdp2_sharded_load_from_cpu(model, state, spec)  # the restore
restored = all(torch.equal(p.detach().to_local(), before[name]) for name, p in model.named_parameters())
print(getattr(fsdp_utils.fsdp2_sharded_save_to_cpu, "_amir_cpu", False), saved_moved, restored)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("cpu_backend, expected", [
    (False, "False True False"),  # verl's own function: the "saved" shards are the live ones, restore is a no-op
    (True, "True False True"),  # patched: a snapshot, and the restore brings back the saved weights
])
def test_separate_async_pi_old_snapshot_survives_an_optimizer_step_only_with_the_patch(cpu_backend, expected):
    env = {k: v for k, v in os.environ.items() if k not in ("AMIR_VERL_CPU", "VERL_PLATFORM", "VERL_ENGINE_DEVICE")}
    if cpu_backend:
        env["AMIR_VERL_CPU"] = "1"
    out = subprocess.run([sys.executable, "-c", SNAPSHOT], capture_output=True, text=True, env=env, cwd="/",
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == expected
