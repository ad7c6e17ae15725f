"""Checkpoint engine ``cpu_object_store``: the trainer's weights to standalone rollout replicas through Ray's
object store, for verl's ``separate_async`` trainer on the CPU backend.

verl's ``PPOTrainerSeparateAsync`` refuses the ``naive`` engine (it hands weights over in process, which needs
the rollout on the trainer's devices), and its engines (nccl, nixl, mooncake, ...) need CUDA or RDMA. This one
keeps verl's protocol (``verl.checkpoint_engine.base.CheckpointEngine``, driven by
``CheckpointEngineManager.update_weights``: ``prepare`` on every worker, ``build_topology``,
``init_process_group``, ``send_weights`` on the actor ranks alongside ``receive_weights`` on the rollout
workers, ``finalize``):

- the master (actor rank 0) names the sync in ``prepare``; ``build_topology`` gives every worker that name;
- every actor rank drains the weight generator (gathering a sharded tensor is collective); the master copies
  each tensor to CPU, puts buckets of about ``bucket_size`` bytes into the object store and posts their
  references to a mailbox actor under the sync's name;
- each rollout worker waits at the mailbox for the references and yields the tensors bucket by bucket;
- ``finalize`` on the master drops the sync's references.

Registered in verl's ``CheckpointEngineRegistry`` when ``verl.checkpoint_engine.base`` is imported
(:func:`amir_verl.cpu.activate_cpu_backend`); select it with
``actor_rollout_ref.rollout.checkpoint_engine.backend=cpu_object_store``.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, Iterable
from typing import Any

import ray
import torch

from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
from verl.workers.rollout.utils import ensure_async_iterator

BACKEND_NAME = "cpu_object_store"
MAILBOX_NAME = "amir_verl_cpu_checkpoint_mailbox"


class WeightMailbox:
    """A Ray actor holding, per sync, the object references of the weight buckets until the sync ends."""

    def __init__(self):
        self._buckets: dict[str, list] = {}
        self._posted: dict[str, asyncio.Event] = {}

    def _event(self, sync_id: str) -> asyncio.Event:
        return self._posted.setdefault(sync_id, asyncio.Event())

    async def post(self, sync_id: str, buckets: list) -> None:
        self._buckets[sync_id] = buckets
        self._event(sync_id).set()

    async def fetch(self, sync_id: str) -> list:
        await self._event(sync_id).wait()
        return self._buckets[sync_id]

    async def drop(self, sync_id: str) -> None:
        self._buckets.pop(sync_id, None)
        self._posted.pop(sync_id, None)


def mailbox():
    return ray.remote(WeightMailbox).options(name=MAILBOX_NAME, get_if_exists=True, num_cpus=0).remote()


def bucketed(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_size: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive (name, tensor) lists of at most ``bucket_size`` bytes each (a larger tensor alone)."""
    buckets, current, size = [], [], 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > bucket_size:
            buckets.append(current)
            current, size = [], 0
        current.append((name, tensor))
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


@CheckpointEngineRegistry.register(BACKEND_NAME)
class ObjectStoreCheckpointEngine(CheckpointEngine):
    """verl checkpoint engine over Ray's object store (see the module docstring)."""

    def __init__(self, bucket_size: int, is_master: bool = False, **kwargs) -> None:
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.sync_id: str | None = None
        self._mailbox = None

    def _mailbox_handle(self):
        if self._mailbox is None:
            self._mailbox = mailbox()
        return self._mailbox

    def prepare(self) -> dict[str, Any]:
        return {"sync_id": uuid.uuid4().hex} if self.is_master else {}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
        sync_id = metadata[0].get("sync_id")
        if sync_id is None:
            raise RuntimeError(f"{BACKEND_NAME}: actor rank 0 is not the master of the weight sync")
        return {"sync_id": [sync_id] * actor_wg_world_size}, {"sync_id": [sync_id] * rollout_world_size}

    def init_process_group(self, sync_id: str, **kwargs) -> None:
        self.sync_id = sync_id

    def finalize(self) -> None:
        if self.is_master and self.sync_id is not None:
            ray.get(self._mailbox_handle().drop.remote(self.sync_id))
        self.sync_id = None

    async def send_weights(self, weights, global_steps: int | None = None):
        if not self.is_master:
            async for _ in ensure_async_iterator(weights):  # this rank's part of each collective gather
                pass
            return {}
        named = [(name, tensor.detach().to("cpu").clone()) async for name, tensor in ensure_async_iterator(weights)]
        refs = [ray.put(bucket) for bucket in bucketed(named, self.bucket_size)]
        await self._mailbox_handle().post.remote(self.sync_id, refs)
        return {}

    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        for ref in await self._mailbox_handle().fetch.remote(self.sync_id):
            for name, tensor in await ref:
                yield name, tensor
