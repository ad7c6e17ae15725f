"""Guards on every verl 0.9.1 function amir-verl hooks, overrides or relies on.

If verl changes one of them this fails loudly, naming it: re-read the upstream function against the
reason recorded here, adapt amir_verl, then update the fingerprint.
"""

import inspect
import re

import pytest

import verl
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
from verl.trainer.ppo.utils import need_reference_policy
from verl.trainer.ppo.v1 import trainer_base
from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils.dataset import rl_dataset
from verl.workers import engine_workers
from verl.workers.config.model import HFModelConfig
from verl.workers.engine.fsdp.transformer_impl import FSDPEngine
from verl.workers.utils import losses
from verl.workers.utils.padding import no_padding_2_padding

from tests.seams import fingerprint as fingerprint_of
from tests.support import FreshPython
import verl.trainer.main_ppo as main_ppo
import verl.utils.config as verl_config

# name -> (object, sha256 prefix of its source in verl 0.9.1, why amir-verl depends on it)
SEAMS = {
    "PPOTrainer.__init__": (trainer_base.PPOTrainer.__init__, "6f938d77859b66ae",
                            "assigns trainer_mode, then builds the replay buffer (AmirPPOTrainer.trainer_mode)"),
    "PPOTrainer._compute_advantage": (trainer_base.PPOTrainer._compute_advantage, "2a4a2aa4a475b228",
                                      "overridden: called first, its TransferQueue fields and uid layout are read"),
    "PPOTrainer._update_actor": (trainer_base.PPOTrainer._update_actor, "d7009bd8a69d40b9",
                                 "overridden: reports actor/pg_loss; mini-batch = ppo_mini_batch_size * rollout.n"),
    "PPOTrainer._save_checkpoint": (trainer_base.PPOTrainer._save_checkpoint, "8c2435b577e54f19",
                                    "overridden: folder layout global_step_N, tracker file written last"),
    "PPOTrainer._load_checkpoint": (trainer_base.PPOTrainer._load_checkpoint, "bb446d77c48ac6cc",
                                    "overridden: resume folder rules reproduced in AmirPPOTrainer._resumed_folder"),
    "PPOTrainer._step_once": (trainer_base.PPOTrainer._step_once, "efdd4abe161c6dee",
                              "order: old and ref log-probs before _compute_advantage, actor update after"),
    "PPOTrainer._log_rollout_data": (trainer_base.PPOTrainer._log_rollout_data, "c1fa53a46df397cb",
                                     "overridden: its self._dump_generations(reward_extra_infos_dict=) call, with "
                                     "the sample keys as 'uid', is where the AMIR fields join each line"),
    "RLHFDataset.maybe_filter_out_long_prompts": (
        inspect.unwrap(rl_dataset.RLHFDataset.maybe_filter_out_long_prompts), "e3dfcd9bb62a214a",
        "wrapped by amir_verl.prompt_filter: takes and returns the datasets.Dataset, reads filter_overlong_prompts "
        "and max_prompt_length"),
    "PPOTrainerSync": (PPOTrainerSync, "beb30ff5187a75b9", "base class of AmirPPOTrainer"),
    "PPOTrainerColocateAsync": (PPOTrainerColocateAsync, "678d665bb28cbed4",
                                "base class of AmirColocateAsyncTrainer: on_init_end updates weights (AMIR calls "
                                "it first), overrides none of _step_once / _compute_advantage"),
    "PPOTrainerSeparateAsync": (PPOTrainerSeparateAsync, "e98a0390f091ec6b",
                                "base class of AmirSeparateAsyncTrainer: its _compute_old_log_prob restores pi_old "
                                "for local updates j >= 1 (the anchored surrogate the README documents)"),
    "PPOTrainer.step": (trainer_base.PPOTrainer.step, "e22f53aadb7805d2",
                        "parameter_sync_step local updates, each its own _step_once (pairs, lambda); the step's "
                        "metrics averaged by MetricsAggregator; one combined batch returned"),
    "PPOTrainer.fit": (trainer_base.PPOTrainer.fit, "7d83a81c2e62979f",
                       "_log_rollout_data once per step on the combined batch, after every local update"),
    "ppo_loss": (losses.ppo_loss, "d7c0f8772b444f55",
                 "wrapped by amir_ppo_loss: dp_size / batch_num_tokens normalisation, metric names"),
    "no_padding_2_padding": (no_padding_2_padding, "0868d5c4731b66ac", "response log-prob layout in the loss"),
    "ActorRolloutRefWorker.set_loss_fn": (engine_workers.ActorRolloutRefWorker.set_loss_fn, "a655a9cfc08a64fd",
                                          "installs amir_ppo_loss on every actor rank"),
    "ActorRolloutRefWorker.init_model": (
        inspect.unwrap(engine_workers.ActorRolloutRefWorker.init_model), "d1598903d82449f2",
        "wrapped (run_config.install_worker_checks): the worker builds its actor and reference models in it, the "
        "first call the trainer makes on the worker, so an AMIR worker's attention check runs before any model loads"),
    "TrainingWorker.set_loss_fn": (engine_workers.TrainingWorker.set_loss_fn, "e9304c63648d4e83",
                                   "the loss used by train_batch"),
    "need_reference_policy": (need_reference_policy, "b8a793a391c04714", "when verl computes ref_log_prob"),
    "validate_config": (getattr(verl_config.validate_config, "__wrapped__", verl_config.validate_config), "ab4096deecfec745",
                        "wrapped: main_ppo's driver-side check, which AMIR extends"),
    "main_ppo.main": (main_ppo.main, "eb706c4f6622ed04", "calls validate_config before run_ppo (ray.init)"),
    "main_ppo.run_ppo": (main_ppo.run_ppo, "a65eddb189e56ae1",
                         "ray.init(**ray_kwargs.ray_init), only its runtime_env merged over verl's defaults: the CPU "
                         "settings' Ray of the run's own (address, logical num_cpus / num_gpus, no dashboard, "
                         "_system_config: no prestarted workers; amir_verl.cpu.settings.cpu_settings) and the "
                         "end-to-end probe's worker_process_setup_hook (tests/e2e/probe.py) reach Ray as given"),
    "HFModelConfig.__post_init__": (HFModelConfig.__post_init__, "a18620cfff22adeb",
                                    "override_config.attn_implementation, default flash_attention_2, is what every "
                                    "FSDP model loads with (run_config.missing_attention_package)"),
    "ActorRolloutRefWorker.update_weights": (
        engine_workers.ActorRolloutRefWorker.update_weights, "ea8f2ec1eb8a4481",
        "a non-naive checkpoint engine gets get_per_tensor_param()'s weights and not its peft_config: no adapter "
        "reaches the rollout (verl issue 7495; run_config.lora_sync_without_adapter)"),
    "FSDPEngine.get_per_tensor_param": (FSDPEngine.get_per_tensor_param, "30802c73cfcc5ba2",
                                        "with LoRA unmerged and base_sync_done=False it returns the base weights only "
                                        "(run_config.lora_sync_without_adapter)"),
}


def test_verl_version_is_the_pinned_one():
    assert verl.__version__ == "0.9.1"


@pytest.mark.parametrize("name", list(SEAMS))
def test_upstream_source_unchanged(name):
    obj, fingerprint, why = SEAMS[name]
    assert fingerprint_of(obj) == fingerprint, f"verl changed {name} ({why}); re-check amir_verl against it"


def test_trainer_mode_comparisons_are_the_ones_amir_reports_its_base_mode_for():
    """An AMIR trainer reports its base mode as trainer_mode; these are the places verl compares it."""
    src = inspect.getsource(trainer_base.PPOTrainer)
    methods = sorted(
        name
        for name, fn in inspect.getmembers(trainer_base.PPOTrainer, inspect.isfunction)
        if re.search(r'trainer_mode [!=]= "sync"', inspect.getsource(fn))
    )
    assert len(re.findall(r'trainer_mode [!=]= "sync"', src)) == 6
    assert methods == ["_build_replay_buffer", "_init_dataloader", "_load_checkpoint", "_reissue_inflight_prompts",
                       "_save_checkpoint", "_submit_batch_to_rollout"]


def test_plugin_registered_through_the_entry_point():
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

    from amir_verl.trainer import AmirColocateAsyncTrainer, AmirPPOTrainer, AmirSeparateAsyncTrainer, AmirTrainerMixin

    assert {"amir_grpo", "amir_gspo"} <= set(POLICY_LOSS_REGISTRY)
    for name, cls, base in (("amir", AmirPPOTrainer, PPOTrainerSync),
                            ("amir_colocate_async", AmirColocateAsyncTrainer, PPOTrainerColocateAsync),
                            ("amir_separate_async", AmirSeparateAsyncTrainer, PPOTrainerSeparateAsync)):
        assert TRAINER_REGISTRY[name] is cls
        assert cls.__mro__[1:3] == (AmirTrainerMixin, base)  # the mixin first: its trainer_mode property wins


def test_amir_loss_mode_without_the_amir_trainer_fails_loudly():
    import torch

    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    with pytest.raises(RuntimeError, match=r"trainer\.v1\.trainer_mode=amir"):
        get_policy_loss_fn("amir_grpo")(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2))


# verl modules that own a registry AMIR registers in, and the AMIR modules that register there
# (amir_verl.verl_plugin.REGISTRATIONS, written out so that the test does not trust the code under test)
REGISTRY_MODULES = ("verl.trainer.ppo.core_algos", "verl.trainer.ppo.v1", "verl.experimental.reward_loop.reward_manager")
AMIR_REGISTERING_MODULES = ("amir_verl.loss_modes", "amir_verl.trainer", "amir_verl.reward.manager")
REGISTRY_CHECKS = (
    "from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, get_policy_loss_fn\n"
    "print(sorted(m for m in POLICY_LOSS_REGISTRY if m.startswith('amir')))\n"
    "print(get_policy_loss_fn('amir').__name__)\n"
    "from verl.trainer.ppo.v1 import get_trainer_cls\n"
    "print(*(get_trainer_cls(m).__qualname__ for m in ('amir', 'amir_colocate_async', 'amir_separate_async')))\n"
    "from verl.experimental.reward_loop.reward_manager import get_reward_manager_cls\n"
    "print(get_reward_manager_cls('amir_calibrated').__qualname__)\n"
)
REGISTERED = ["['amir', 'amir_grpo', 'amir_gspo']", "amir_registry_entry_amir",
              "AmirPPOTrainer AmirColocateAsyncTrainer AmirSeparateAsyncTrainer",
              "AmirCalibratedRewardManager"]


def fresh_env(**env_overrides: str) -> dict[str, str]:
    """The environment of a fresh interpreter with the installed package and no plugin switches
    (``VERL_USE_EXTERNAL_*``, ``AMIR_VERL_CPU``) unless given."""
    import os

    env = {k: v for k, v in os.environ.items()
           if k not in ("VERL_USE_EXTERNAL_MODULES", "VERL_USE_EXTERNAL_PLUGINS", "AMIR_VERL_CPU")}
    return {**env, **env_overrides}


# what each probe runs, in a fresh interpreter: see the test that reads it
IMPORT_VERL_PROBE = (
    "import sys, verl\n"
    f"print([m for m in {REGISTRY_MODULES + AMIR_REGISTERING_MODULES} + ('verl.trainer.ppo.v1.trainer_base',)"
    " if m in sys.modules])\n"
    "print('amir_verl.verl_plugin' in sys.modules)\n"
    + REGISTRY_CHECKS
    + "import verl.trainer.main_ppo as m\n"
    "print(getattr(m.validate_config, '_amir_checked', False))\n"
)
LOSSES_FIRST_PROBE = "import verl, verl.workers.utils.losses\n" + REGISTRY_CHECKS
PLUGIN_LAST_PROBE = (
    "import importlib, sys, verl\n"
    f"for name in {REGISTRY_MODULES}: importlib.import_module(name)\n"
    "from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY\n"
    f"print('amir' in POLICY_LOSS_REGISTRY, [m for m in {AMIR_REGISTERING_MODULES} if m in sys.modules])\n"
    "import amir_verl.verl_plugin\n"
    + REGISTRY_CHECKS
)


@pytest.fixture(scope="module")
def fresh_probes() -> dict[str, FreshPython]:
    return {"import_verl": FreshPython(IMPORT_VERL_PROBE, fresh_env()),
            "losses_first": FreshPython(LOSSES_FIRST_PROBE, fresh_env()),
            "plugin_last": FreshPython(PLUGIN_LAST_PROBE, fresh_env(VERL_USE_EXTERNAL_PLUGINS="none"))}


def test_import_verl_loads_the_plugin_but_not_the_trainer_stack(fresh_probes):
    """No import of amir_verl, no env var: installing the package is enough (``verl.plugins`` entry point).
    ``import verl`` must stay cheap (every Ray worker pays it): the registries' modules, and the AMIR
    modules that register in them, load only when something imports them."""
    assert fresh_probes["import_verl"].stdout_lines()[-7:] == ["[]", "True", *REGISTERED, "True"]


def test_loss_modes_register_when_verls_loss_module_imports_core_algos(fresh_probes):
    """``verl.workers.utils.losses`` imports ``core_algos`` half-way through its own import: the hook must
    not need ``losses`` (the circular import a registration inside amir_verl.actor_loss would hit)."""
    assert fresh_probes["losses_first"].stdout_lines()[-4:] == REGISTERED


def test_registries_imported_before_the_plugin_get_the_entries_at_once(fresh_probes):
    """With ``AMIR_VERL_CPU=1`` the CPU backend imports the V1 trainer before the hooks exist; a hook on a
    module already imported must register at once. Here verl loads no plugin; the test imports it last."""
    assert fresh_probes["plugin_last"].stdout_lines()[-5:] == ["False []", *REGISTERED]
