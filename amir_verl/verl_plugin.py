"""Entry point of the ``verl.plugins`` group: verl imports this module in every process that imports verl.

verl loads it from its own ``__init__`` (``import verl``), so it stays light: it imports no verl module
that ``import verl`` has not already imported. With ``AMIR_VERL_CPU=1`` it first switches the process to
the CPU backend (:mod:`amir_verl.cpu`; heavy, only under that switch). It then wraps verl's
``validate_config`` (:func:`amir_verl.run_config.install_early_config_check`) and registers AMIR in
verl's registries lazily: a post-import hook (``wrapt.register_post_import_hook``) on each verl module
that owns a registry imports the AMIR module that registers there, once that verl module has finished
importing, or at once when it already has. A lookup has to import the registry's module first, so the
entries are there whenever verl can look them up, in every process (:data:`REGISTRATIONS`). Two more hooks: on
verl's workers, the check of an AMIR run's worker before its model loads
(:func:`amir_verl.run_config.install_worker_checks`); on verl's RL dataset, a report per benchmark of the prompts its
length filter drops (:mod:`amir_verl.prompt_filter`). Under ``AMIR_VERL_CPU=1`` a process that sees a CUDA device
stops here (``SystemExit``, which verl's loader does not swallow) with one line naming the variable.

verl swallows plugin import errors at DEBUG level, so a failure here would only show up later as
"Unsupported loss mode"; ``python -m amir_verl.verl_plugin`` imports it loudly to check an install.
"""

import importlib
import os

import wrapt

if os.environ.get("AMIR_VERL_CPU", "") == "1":  # debug on CPU: explicit opt-in, never on a GPU run
    from amir_verl.cpu import AcceleratorVisible, activate_cpu_backend

    try:
        activate_cpu_backend()
    except AcceleratorVisible as refused:
        # verl's plugin loader catches every Exception (logged at DEBUG): the process would go on without the plugin.
        # SystemExit passes through it, and the interpreter prints the one line and exits 1, before any model loads.
        raise SystemExit(f"amir-verl: {refused}") from None

from amir_verl.run_config import install_early_config_check  # noqa: E402

install_early_config_check()  # AMIR config errors stop main_ppo on the driver, before Ray starts

# verl module that owns a registry -> the AMIR module whose import registers there. The hooks sit on the
# packages whose __init__ imports the registry and its users (``verl.trainer.ppo.v1`` imports
# ``trainer_base`` and the three trainers the AMIR trainers subclass), so the AMIR module finds them
# complete; ``TaskRunnerV1.run`` and ``resolve_reward_manager_cls`` import those packages before looking up.
REGISTRATIONS = {
    "verl.trainer.ppo.core_algos": "amir_verl.loss_modes",  # policy-loss modes amir, amir_grpo, amir_gspo
    "verl.experimental.reward_loop.reward_manager": "amir_verl.reward.manager",  # reward manager amir_calibrated
    "verl.trainer.ppo.v1": "amir_verl.trainer",  # V1 trainer modes amir, amir_colocate_async, amir_separate_async
}


def _importer(module_name: str):
    def import_registering_module(_verl_module) -> None:
        importlib.import_module(module_name)

    return import_registering_module


for _verl_module, _amir_module in REGISTRATIONS.items():
    wrapt.register_post_import_hook(_importer(_amir_module), _verl_module)

# Not a registry: in the worker that loads an AMIR run's actor, the attention package is checked before the model
# loads (the driver only warns: on a cluster its environment is not the workers').
wrapt.register_post_import_hook(lambda module: importlib.import_module("amir_verl.run_config").install_worker_checks(module),
                                "verl.workers.engine_workers")

# Not a registry: a line per benchmark of how many prompts filter_overlong_prompts dropped (amir_verl.prompt_filter).
wrapt.register_post_import_hook(lambda module: importlib.import_module("amir_verl.prompt_filter").install(module),
                                "verl.utils.dataset.rl_dataset")

if __name__ == "__main__":
    from verl.experimental.reward_loop.reward_manager.registry import REWARD_MANAGER
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

    print("policy losses:", ", ".join(m for m in POLICY_LOSS_REGISTRY if m.startswith("amir")))
    print("trainer modes:", ", ".join(sorted(TRAINER_REGISTRY)))
    print("reward managers:", ", ".join(m for m in REWARD_MANAGER if m.startswith("amir")))
