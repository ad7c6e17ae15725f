"""The settings every verl run on the CPU backend needs, defined once: the demo (:mod:`amir_verl.demo`), the
paper pipeline (:mod:`amir_verl.paper_pipeline`) and the tests take them from here, and docs/cpu_backend.md points here.

None of them changes the algorithm: the ``hf`` rollout instead of vLLM, float32 and PyTorch's sdpa attention
instead of bf16 and flash-attention, FSDP2, one worker process where verl would start several, and a Ray of
the run's own with logical CPUs and GPUs for verl's resource pools.
"""

from __future__ import annotations

import importlib.util

from amir_verl.cpu import ROLLOUT_NAME

FP32 = "{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}"  # FSDP mixed precision that is not mixed
SCHEDULES = ("sync", "colocate_async", "separate_async")  # verl's V1 schedules


def cpu_settings(logical_gpus: int = 1) -> list[str]:
    """The overrides of every CPU run (``logical_gpus``: what Ray advertises, one per trainer rank plus
    ``separate_async``'s standalone rollout)."""
    return [
        f"actor_rollout_ref.rollout.name={ROLLOUT_NAME}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.model.use_remove_padding=False",
        "actor_rollout_ref.actor.strategy=fsdp2",
        f"+actor_rollout_ref.actor.fsdp_config.mixed_precision={FP32}",
        f"+actor_rollout_ref.ref.fsdp_config.mixed_precision={FP32}",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        # the rows are read in the trainer's process: worker processes only cost start-up time, and Ray's
        # shutdown of the TaskRunner used to kill them mid-iteration ("DataLoader worker ... is killed")
        "data.dataloader_num_workers=0",
        "reward.num_workers=1",
        # verl's metrics to a file too (amir_verl.cpu.launch.verl_metrics_path): what the progress lines, the reports
        # and the tests read
        "trainer.logger=[console,file]",
        "+ray_kwargs.ray_init.num_cpus=16",  # logical: verl's workers, TransferQueue and reward actors
        f"+ray_kwargs.ray_init.num_gpus={logical_gpus}",  # logical: verl's resource pools ask for them
        "+ray_kwargs.ray_init.include_dashboard=False",
        # a Ray of this run's own: ray.init() would otherwise join the cluster named by RAY_ADDRESS or the
        # last `ray start` on this machine, and fail there on num_cpus / num_gpus
        "+ray_kwargs.ray_init.address=local",
        # no idle Python workers started with the driver (Ray's default, for a first task's latency): verl starts
        # every worker it needs as a named actor, and each idle one cost a toy run's start-up about 0.7 CPU-s
        "+ray_kwargs.ray_init._system_config={prestart_worker_first_driver:false}",
        # one TransferQueue storage actor instead of 8: each is a Python process that takes seconds to start
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    ]


def schedule_overrides(schedule: str, prompts_per_step: int, local_updates: int = 2) -> list[str]:
    """What verl's V1 ``schedule`` needs on the CPU backend besides the trainer mode: nothing for ``sync`` and
    ``colocate_async``; for ``separate_async`` a standalone rollout replica on a logical GPU of its own, its
    weights through the checkpoint engine ``cpu_object_store``, and ``local_updates`` local updates per step
    (verl requires train_batch_size = parameter_sync_step x ppo_mini_batch_size)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown verl V1 schedule {schedule!r}")
    if schedule != "separate_async":
        return []
    if prompts_per_step % local_updates:
        raise ValueError(f"{prompts_per_step} prompts per step do not split into {local_updates} local updates")
    return [
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=cpu_object_store",
        f"trainer.v1.separate_async.parameter_sync_step={local_updates}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts_per_step // local_updates}",
    ]


def vllm_installed() -> bool:
    """Whether vLLM (its CPU build, the ``cpu-vllm`` extra) imports here; found, not imported: importing it takes
    seconds, and a process that only asks should not carry vLLM's native libraries."""
    return importlib.util.find_spec("vllm") is not None


# The OpenMP settings of every process of a CPU run, unless the environment sets them: a thread that waits for
# the others sleeps instead of spinning (libgomp, PyTorch's OpenMP, spins up to 300,000 times a wait by default).
# A CPU run's processes share the cores (the actor, vLLM's engine core, the reward workers; in the tests and the
# pipeline other runs too), and a spinning thread holds a core that the thread it waits for needs. Measured
# (2 cores, benchmarks/bench_omp_wait.py, 2026-12-06): a 2-thread forward beside one busy process 25.7 s and
# 30.7 CPU-s spinning, 19.9 s and 21.3 CPU-s sleeping; alone 11.3 s and 11.6 s. The results are the same: only how
# an idle thread waits changes.
OPENMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


VLLM_CPU_KVCACHE_GIB = 1  # vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE); the toy task needs far less


def vllm_rollout_settings(bucket_mb: int = 256) -> list[str]:
    """Overrides for verl's own ``vllm`` rollout on the CPU backend, in place of :func:`cpu_settings`'s ``hf``
    (append after it): vLLM's CPU build (the ``cpu-vllm`` extra) has no CUDA graphs (``enforce_eager``) and no
    sleep mode (on by default in verl's rollout config, rejected by vLLM on CPU; ``free_cache_engine`` needs
    it), and verl's shared-memory weight transfer (no CUDA IPC on a CPU) asserts on a tensor larger than its
    bucket: ``bucket_mb`` must hold the model's largest tensor (256 covers SmolLM2-135M's 113 MB embedding;
    verl's default, 2048, is a 2 GB shared-memory buffer). The engine runs in float32 like the CPU actor: verl's
    rollout ``dtype`` defaults to bfloat16 and goes to ``vllm serve --dtype`` as is, and the synced float32
    weights are then cast to bfloat16 in the engine (on the toy task vLLM's token probabilities were 1.3e-4 to
    2.5e-4 off the actor's, ``rollout_probs_diff_max``; in float32, 1.1e-8 to 1.3e-8). Run with
    :func:`vllm_rollout_env` in the environment."""
    return [
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.rollout.enforce_eager=True",
        "+actor_rollout_ref.rollout.enable_sleep_mode=False",
        "actor_rollout_ref.rollout.free_cache_engine=False",
        f"actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes={bucket_mb}",
    ]


def vllm_rollout_env() -> dict[str, str]:
    """The environment vLLM's CPU build reads: its KV cache in GiB, and no core reserved away from the engine
    (by default it keeps one back, half of a 2-core machine)."""
    return {"VLLM_CPU_KVCACHE_SPACE": str(VLLM_CPU_KVCACHE_GIB), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
