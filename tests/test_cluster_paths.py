"""The paths verl users take on real clusters, as far as one CPU machine reaches them (issue 55): the AMIR switch
changes only AMIR; a driver whose environment is not the workers' refuses nothing for a missing package, and an
AMIR run's worker checks its own environment before loading the model; a Megatron actor and the CPU switch on a
machine with a GPU stop with one line naming the key and the fix. Configs are composed from verl 0.9.1's own yaml
and checked through verl's ``validate_config``, which ``main_ppo`` calls on its driver before Ray starts."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from amir_verl.run_config import (
    AMIR_TRAINER_MODE_KEY,
    ATTENTION_PACKAGES,
    LOSS_MODE_KEY,
    amir_overrides,
    check_amir_run,
    validate_amir_run,
)
from tests.support import GRPO, compose_verl

# what verl's own validate_config needs besides the run's choices (batch and micro-batch sizes that divide)
VALID_SIZES = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
               "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
               "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2", "trainer.n_gpus_per_node=1",
               "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=2"]
GSPO = ["actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"]
SDPA = ["+actor_rollout_ref.model.override_config.attn_implementation=sdpa"]
MODEL_KEY = "actor_rollout_ref.model"


def verls_validate_config(config) -> None:
    """What ``main_ppo`` calls on its driver (the plugin's checks run inside it)."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))


def flat(node, prefix: str = "") -> dict[str, object]:
    """A resolved config as {dotted key: value}; lists as one value."""
    if isinstance(node, dict):
        return {key: value for name, child in node.items() for key, value in flat(child, f"{prefix}{name}.").items()}
    return {prefix[:-1]: repr(node) if isinstance(node, list) else node}


def resolved(config) -> dict[str, object]:
    return flat(OmegaConf.to_container(config, resolve=True, throw_on_missing=False))


def effective_kl_loss_coef(config) -> float:
    actor = config.actor_rollout_ref.actor
    return float(actor.kl_loss_coef) if actor.use_kl_loss else 0.0


# ---- item 2: the AMIR overrides change only AMIR ---------------------------------------------------------------

def test_the_overrides_give_kl_loss_coef_zero_right_after_use_kl_loss():
    overrides = amir_overrides(beta_dpo=0.5)
    at = overrides.index("actor_rollout_ref.actor.use_kl_loss=True")
    assert overrides[at + 1] == "actor_rollout_ref.actor.kl_loss_coef=0.0"


@pytest.mark.parametrize("loss_mode, stock", [("amir_grpo", GRPO), ("amir_gspo", GRPO + GSPO)])
def test_a_stock_run_and_its_amir_run_differ_only_in_amir_keys_and_the_reference_computation(loss_mode, stock):
    """verl's GRPO (or GSPO) command composed with verl's own yaml, then with ``amir_overrides`` after it: walking
    both resolved configs key by key, what differs is the loss mode, the trainer mode, the ``amir`` namespace and
    ``use_kl_loss`` (verl computes the reference log-probs that ``amir.reference=ref`` reads). ``kl_loss_coef``
    changes from verl's 0.001, unused while ``use_kl_loss=False``, to 0.0: the KL loss's contribution is 0 in both."""
    from verl.trainer.ppo.utils import need_reference_policy

    before = compose_verl(stock)
    after = compose_verl(stock + amir_overrides(loss_mode, beta_dpo=0.5, delta_r=0.1))
    a, b = resolved(before), resolved(after)
    differing = {key for key in a.keys() | b.keys() if a.get(key, "<absent>") != b.get(key, "<absent>")}
    amir_keys = {LOSS_MODE_KEY, AMIR_TRAINER_MODE_KEY, "amir.beta_dpo", "amir.delta_r"}
    reference = {"actor_rollout_ref.actor.use_kl_loss", "actor_rollout_ref.actor.kl_loss_coef"}
    assert differing == amir_keys | reference
    assert (a["actor_rollout_ref.actor.use_kl_loss"], b["actor_rollout_ref.actor.use_kl_loss"]) == (False, True)
    assert (need_reference_policy(before), need_reference_policy(after)) == (False, True)
    assert a["actor_rollout_ref.actor.kl_loss_coef"] == 0.001  # verl's default: the trap the override avoids
    assert effective_kl_loss_coef(before) == effective_kl_loss_coef(after) == 0.0
    assert not OmegaConf.select(after, "algorithm.use_kl_in_reward")  # no KL through the reward either
    validate_amir_run(after)


# ---- item 1: the driver warns, the AMIR worker checks where the model loads -------------------------------------

FLASH_ATTN_MESSAGE = (r"actor_rollout_ref\.model loads with attn_implementation=flash_attention_2 \(verl's default\), "
                      r"but the flash_attn package is not installed {where}: install it \("
                      + re.escape(ATTENTION_PACKAGES["flash_attention_2"][1]).replace("{", "{{").replace("}", "}}")
                      + r"\), or run with PyTorch's attention: "
                      r"\+actor_rollout_ref\.model\.override_config\.attn_implementation=sdpa$")


def installed_only(monkeypatch, *present: str) -> None:
    """importlib's package lookup as run_config sees it: only ``present`` of the attention packages exist."""
    from amir_verl import run_config

    find_spec = importlib.util.find_spec
    packages = {package for package, _ in run_config.ATTENTION_PACKAGES.values()}
    monkeypatch.setattr(run_config.importlib.util, "find_spec",
                        lambda name, *a: (object() if name in present else None) if name in packages else find_spec(name, *a))


def amir_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "amir_verl.run_config" and r.levelname == "WARNING"]


@pytest.mark.parametrize("run", ["stock", "amir"])
def test_a_driver_without_flash_attn_warns_and_refuses_nothing(run, caplog):
    """On a cluster the driver's environment is not the workers': ``ray job submit`` runs the entrypoint on the head
    node, a multi-node job is launched from a login node. verl's validate_config passes, AMIR run or not, with one
    warning line naming the package, the install and the override."""
    import amir_verl.run_config  # noqa: F401  (the wrapper in place: the plugin installed it at import verl)
    from verl.utils import config as verl_config

    assert importlib.util.find_spec("flash_attn") is None  # this machine: verl's default attention cannot load here
    assert getattr(verl_config.validate_config, "_amir_checked", False)
    config = compose_verl(GRPO + VALID_SIZES + (amir_overrides() if run == "amir" else []))
    with caplog.at_level("WARNING", logger="amir_verl.run_config"):
        verls_validate_config(config)
    where = r"where the driver runs \(a worker without it cannot load the model\)"
    assert len(amir_warnings(caplog)) == 1
    assert re.match("amir-verl: " + FLASH_ATTN_MESSAGE.format(where=where), amir_warnings(caplog)[0])


def test_the_driver_warns_for_each_fsdp_model_whose_package_is_missing_and_only_then(monkeypatch, caplog):
    from amir_verl.run_config import check_any_run

    runs = {  # overrides -> the model keys warned about
        "sdpa": (GRPO + SDPA, []),
        "megatron": (GRPO + ["actor_rollout_ref.actor.strategy=megatron"], []),  # its engine chooses attention
        "fa3": (GRPO + ["+actor_rollout_ref.model.override_config.attn_implementation=flash_attention_3"], [MODEL_KEY]),
        "ppo critic": (["algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.name=vllm"] + SDPA, ["critic.model"]),
    }
    warned = {}
    for name, (overrides, keys) in runs.items():
        caplog.clear()
        with caplog.at_level("WARNING", logger="amir_verl.run_config"):
            check_any_run(compose_verl(overrides))
        warned[name] = amir_warnings(caplog)
        assert [line.split()[1] for line in warned[name]] == keys, name
    assert "attn_implementation=flash_attention_3, but the flash_attn_interface package is not" in warned["fa3"][0]
    assert "attn_implementation=flash_attention_2 (verl's default), but the flash_attn" in warned["ppo critic"][0]
    caplog.clear()
    installed_only(monkeypatch, "flash_attn")
    with caplog.at_level("WARNING", logger="amir_verl.run_config"):
        check_any_run(compose_verl(GRPO))  # flash-attn installed: verl's default loads
    assert amir_warnings(caplog) == []


def test_the_worker_of_an_amir_run_without_flash_attn_stops_naming_the_package_and_the_fix(monkeypatch):
    from amir_verl.run_config import check_worker_attention

    amir = compose_verl(GRPO + amir_overrides()).actor_rollout_ref
    with pytest.raises(ValueError, match=FLASH_ATTN_MESSAGE.format(where=r"on this worker \(host [^)]+\)")):
        check_worker_attention(amir)
    with pytest.raises(ValueError, match=r"flash_attention_3, but the flash_attn_interface package is not installed"):
        check_worker_attention(compose_verl(GRPO + amir_overrides() + [
            "+actor_rollout_ref.model.override_config.attn_implementation=flash_attention_3"]).actor_rollout_ref)
    check_worker_attention(compose_verl(GRPO).actor_rollout_ref)  # not AMIR: left to verl and transformers
    check_worker_attention(compose_verl(GRPO + amir_overrides() + SDPA).actor_rollout_ref)
    check_worker_attention(compose_verl(GRPO + amir_overrides() + ["actor_rollout_ref.actor.strategy=megatron"])
                           .actor_rollout_ref)  # not this engine's choice (and refused on the driver)
    installed_only(monkeypatch, "flash_attn")
    check_worker_attention(amir)


def test_the_check_runs_in_init_model_before_verls_own_and_only_where_a_model_loads(monkeypatch):
    """``install_worker_checks`` on a stand-in of verl's worker class, whose ``init_model`` carries verl's own
    ``@register`` (what verl's WorkerDict reads to bind it): the check runs first and a refusal stops the upstream
    method; a standalone rollout worker (role ``rollout``) loads no FSDP model and is not checked."""
    from verl.single_controller.base.decorator import MAGIC_ATTR, Dispatch, register

    from amir_verl import run_config

    calls = []

    class ActorRolloutRefWorker:
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def init_model(self):
            calls.append("verl")

    class Module:
        pass

    module = Module()
    module.ActorRolloutRefWorker = ActorRolloutRefWorker
    run_config.install_worker_checks(module)
    run_config.install_worker_checks(module)  # idempotent: one wrapper
    wrapped = ActorRolloutRefWorker.init_model
    assert getattr(wrapped.__wrapped__, "_amir_checked", False) is False  # wrapped once, not twice
    assert getattr(wrapped, MAGIC_ATTR)["dispatch_mode"] == Dispatch.ONE_TO_ALL

    amir = compose_verl(GRPO + amir_overrides()).actor_rollout_ref
    worker = ActorRolloutRefWorker()
    worker.config, worker._is_actor, worker._is_ref = amir, True, True
    with pytest.raises(ValueError, match=r"flash_attn package is not installed on this worker"):
        worker.init_model()
    assert calls == []  # stopped before verl's init_model, which builds the models
    worker._is_actor, worker._is_ref = False, False  # role "rollout"
    worker.init_model()
    worker.config, worker._is_actor = compose_verl(GRPO + amir_overrides() + SDPA).actor_rollout_ref, True
    worker.init_model()
    assert calls == ["verl", "verl"]


def test_the_plugin_wraps_verls_actor_worker_in_every_process_that_imports_it():
    """The post-import hook the plugin registers at ``import verl``: verl's own class carries the check (a Ray
    worker imports verl before it unpickles the class); verl's function is the one pinned in test_verl_seams."""
    import inspect

    from verl.workers import engine_workers

    init_model = engine_workers.ActorRolloutRefWorker.init_model
    assert getattr(init_model, "_amir_checked", False)
    assert inspect.unwrap(init_model).__module__ == "verl.workers.engine_workers"


# ---- item 5: Megatron, and the CPU switch where a GPU is visible -------------------------------------------------

MEGATRON_MESSAGE = (r"^actor_rollout_ref\.actor\.strategy=megatron: AMIR supports verl's FSDP engine only \(fsdp, fsdp2\); "
                    r"run it from verl's ppo_trainer config \(not ppo_megatron_trainer\) with "
                    r"actor_rollout_ref\.actor\.strategy=fsdp2$")


def test_amir_with_a_megatron_actor_stops_on_the_driver_naming_the_key():
    """Composed from verl's ``ppo_megatron_trainer`` config, as a Megatron user runs verl: refused inside verl's
    validate_config (main_ppo's driver, before Ray), by check_amir_run and by the trainers' validate_amir_run.
    The same run without AMIR passes: the plugin refuses no Megatron run that does not ask for AMIR."""
    stock = compose_verl(GRPO + VALID_SIZES, name="ppo_megatron_trainer")
    amir = compose_verl(GRPO + VALID_SIZES + amir_overrides(), name="ppo_megatron_trainer")
    assert amir.actor_rollout_ref.actor.strategy == "megatron"
    for check in (verls_validate_config, check_amir_run, validate_amir_run):
        with pytest.raises(ValueError, match=MEGATRON_MESSAGE):
            check(amir)
    verls_validate_config(stock)
    validate_amir_run(compose_verl(GRPO + amir_overrides() + ["actor_rollout_ref.actor.strategy=fsdp"]))


def switch_env(**env: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in ("AMIR_VERL_CPU", "VERL_PLATFORM", "VERL_ENGINE_DEVICE")}
    return {**base, **env}


def import_verl_seeing_a_gpu(patch: str, env: dict[str, str]) -> subprocess.Popen:
    """``import verl`` in a fresh interpreter whose torch reports a CUDA device (``patch``: which of its answers)."""
    code = f"import torch\ntorch.cuda.{patch}\nimport verl, sys\nprint('amir_verl.verl_plugin' in sys.modules)\n"
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd="/")


CPU_SWITCH_MESSAGE = ("amir-verl: AMIR_VERL_CPU=1 switches verl onto amir-verl's CPU backend (debug runs on machines "
                      "without an accelerator), but this process sees {n} CUDA device(s): unset AMIR_VERL_CPU to run "
                      "on the GPU")


def test_the_cpu_switch_in_a_process_that_sees_a_cuda_device_stops_naming_the_variable():
    """``AMIR_VERL_CPU=1`` leaking into a GPU job: ``import verl`` (every process of a run, the driver first) exits
    with one line, before any model loads or Ray starts; verl's plugin loader, which swallows exceptions, does not
    hide it. Without the switch the same process imports verl and the plugin as usual."""
    probes = {
        "available": import_verl_seeing_a_gpu("is_available = lambda: True", switch_env(AMIR_VERL_CPU="1")),
        "counted": import_verl_seeing_a_gpu("device_count = lambda: 2", switch_env(AMIR_VERL_CPU="1")),
        "no switch": import_verl_seeing_a_gpu("device_count = lambda: 2", switch_env()),
    }
    results = {name: (proc.communicate(timeout=300), proc.returncode) for name, proc in probes.items()}
    for name, n in (("available", 1), ("counted", 2)):
        (out, err), returncode = results[name]
        assert returncode == 1 and out == "", (name, err[-2000:])
        assert err.strip().splitlines()[-1] == CPU_SWITCH_MESSAGE.format(n=n), (name, err[-2000:])
        assert "Traceback" not in err
    (out, err), returncode = results["no switch"]
    assert returncode == 0 and out.strip().splitlines()[-1] == "True", err[-2000:]


def test_the_cpu_switch_checks_before_it_switches_anything(monkeypatch):
    import torch

    from amir_verl.cpu import AcceleratorVisible, activate_cpu_backend, refuse_a_visible_cuda_device

    refuse_a_visible_cuda_device()  # this machine: no CUDA device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("VERL_PLATFORM", "untouched")
    with pytest.raises(AcceleratorVisible, match=r"^AMIR_VERL_CPU=1 .* sees 1 CUDA device\(s\): unset AMIR_VERL_CPU"):
        activate_cpu_backend()
    assert os.environ["VERL_PLATFORM"] == "untouched"  # the CPU platform was not switched on


ULYSSES_2 = ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "actor_rollout_ref.model.use_remove_padding=True"]


@pytest.mark.parametrize("attention,refused", [("sdpa", True), ("eager", True), ("flash_attention_2", False)])
def test_amir_with_ulysses_on_an_attention_verl_does_not_gather_stops_on_the_driver(attention, refused, monkeypatch):
    """verl 0.9.1 gathers a Ulysses-sliced sequence only inside flash-attention (its monkey patch replaces
    transformers' _flash_attention_forward alone): with sdpa or eager each rank attends to its own slice and the
    log-probs are wrong without an error (measured on the CPU backend before its patch 9: old log-probs 0.16 off).
    An AMIR run stops there, naming both ways out; flash-attention passes; the CPU backend, which gathers for sdpa
    too, passes."""
    monkeypatch.delenv("AMIR_VERL_CPU", raising=False)
    attn = [f"+actor_rollout_ref.model.override_config.attn_implementation={attention}"]
    config = compose_verl(GRPO + VALID_SIZES + ULYSSES_2 + attn + amir_overrides())
    if refused:
        with pytest.raises(ValueError, match=rf"ulysses_sequence_parallel_size=2 with attn_implementation={attention}:"
                                             r".*attn_implementation=flash_attention_2, or .*ulysses_sequence_parallel_size=1$"):
            check_amir_run(config)
    else:
        check_amir_run(config)
    monkeypatch.setenv("AMIR_VERL_CPU", "1")
    check_amir_run(config)


def test_a_stock_run_with_ulysses_on_sdpa_gets_a_warning_only(monkeypatch, caplog):
    from amir_verl.run_config import check_any_run

    monkeypatch.delenv("AMIR_VERL_CPU", raising=False)
    config = compose_verl(GRPO + VALID_SIZES + ULYSSES_2 + SDPA)
    with caplog.at_level("WARNING", logger="amir_verl.run_config"):
        check_any_run(config)
        check_amir_run(config)
    assert [w for w in amir_warnings(caplog) if "ulysses_sequence_parallel_size=2 with attn_implementation=sdpa" in w]
