"""Debug on CPU: verl's real ``main_ppo`` without an accelerator (opt-in with ``AMIR_VERL_CPU=1``).

:mod:`amir_verl.cpu.platform` registers a ``cpu`` platform in verl; :mod:`amir_verl.cpu.hf_rollout` adds
the ``hf`` rollout backend (batched transformers decoding); :mod:`amir_verl.cpu.checkpoint_engine` the
checkpoint engine of ``separate_async``'s standalone rollout; :mod:`amir_verl.cpu.toy_task` makes the tiny
model, tokenizer and data of the quickstart (:mod:`amir_verl.cpu.quickstart`, the GRPO vs AMIR-GRPO demo),
which launches main_ppo through :mod:`amir_verl.cpu.launch` and reports with :mod:`amir_verl.cpu.report`.
The plugin imports none of this unless the switch is set, so a GPU run never touches it.
"""

SWITCH = "AMIR_VERL_CPU"
ROLLOUT_NAME = "hf"


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
    (the ``hf`` server itself is imported when verl looks it up)."""
    import wrapt

    from amir_verl.cpu.platform import activate

    activate()
    wrapt.register_post_import_hook(_register_hf_adapter, "verl.workers.rollout.base")
    wrapt.register_post_import_hook(_register_hf_replica, "verl.workers.rollout.replica")
    wrapt.register_post_import_hook(_register_checkpoint_engine, "verl.checkpoint_engine.base")
