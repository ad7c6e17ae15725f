"""AMIR's run-level contract with verl: its loss and trainer modes (the mode table), the overrides that switch a
GRPO or GSPO run to AMIR (:func:`amir_overrides`), and the checks of a whole run config, run before any worker
or model starts.

The checks run on the driver inside verl's ``validate_config`` (wrapped by :func:`install_early_config_check`,
so ``main_ppo`` stops before Ray starts): :func:`check_any_run` for every verl run with the plugin installed
(a LoRA adapter verl would ignore; warnings only for an attention package missing where the driver runs and for a
LoRA rollout that would never see its adapter), then :func:`check_amir_run` for an AMIR run, whose
:func:`validate_amir_run` the AMIR trainers' ``__init__`` repeats (for code that builds a trainer without
``main_ppo``). What depends on the packages installed where the model loads is checked there, in the worker, before
the model loads (:func:`install_worker_checks`: AMIR runs only).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import socket
import warnings
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from amir_verl.config import CONFIG_NAMESPACE, AmirConfig

LOSS_MODE_KEY = "actor_rollout_ref.actor.policy_loss.loss_mode"
AMIR_LOSS_MODE = "amir"
PAPER_ALIASES = {"amir_grpo": "vanilla", "amir_gspo": "gspo"}  # the paper's names: amir on a fixed base
AMIR_LOSS_MODES = (AMIR_LOSS_MODE, *PAPER_ALIASES)
# verl switches loss_mode to bypass_mode itself (algorithm.rollout_correction.bypass_mode), replacing
# any other mode, so it cannot sit under AMIR.
UNSUPPORTED_BASE_MODES = ("bypass_mode",)
# Base modes whose loss is a sum of per-sequence parts under the whole batch's normalisers (verl's
# global_batch_info), so any split of the batch gives the whole batch's value and gradient; the driver
# then evaluates them in chunks of sequences (:func:`amir_verl.step_batch.gradient_signal`). Pinned by
# tests/test_exactness.py, which checks that for each of them an actor update split over ranks and
# micro-batches equals the whole-batch gradient. Not in the list: geo_mean (a plain mean over its input),
# clip_cov / kl_cov (a top-k over the input's tokens), evaluated as one piece.
SPLIT_INVARIANT_BASE_MODES = ("vanilla", "gspo", "cispo", "gpg", "dppo_tv", "dppo_kl", "sapo", "dro")


# trainer.v1.trainer_mode of each AMIR trainer (amir_verl.trainer) -> the verl V1 mode whose schedule it runs
AMIR_TRAINER_MODE = "amir"  # the synchronous one, which messages name first
AMIR_COLOCATE_ASYNC_MODE = "amir_colocate_async"
AMIR_SEPARATE_ASYNC_MODE = "amir_separate_async"
AMIR_TRAINER_MODES = {AMIR_TRAINER_MODE: "sync", AMIR_COLOCATE_ASYNC_MODE: "colocate_async",
                      AMIR_SEPARATE_ASYNC_MODE: "separate_async"}
AMIR_TRAINER_MODE_KEY = "trainer.v1.trainer_mode"


def amir_overrides(loss_mode: str = "amir_grpo", *, trainer_mode: str = AMIR_TRAINER_MODE, **amir: object) -> list[str]:
    """The overrides that turn verl's GRPO (or GSPO) run into AMIR, as the README states them: the loss mode,
    the trainer mode (``trainer_mode`` picks the schedule, a key of :data:`AMIR_TRAINER_MODES`), the
    reference log-probs that ``amir.reference=ref`` reads (``use_kl_loss=True``, with ``kl_loss_coef=0.0`` so
    that no KL term joins a run that had none: verl's default coefficient is 0.001), and ``amir.<key>=<value>``
    for each of ``amir``. A run with a KL loss of its own keeps its coefficient by giving it after these."""
    if loss_mode not in AMIR_LOSS_MODES or trainer_mode not in AMIR_TRAINER_MODES:
        raise ValueError(f"not an AMIR loss mode and trainer mode: {loss_mode!r}, {trainer_mode!r}")
    return [
        f"{LOSS_MODE_KEY}={loss_mode}",
        f"{AMIR_TRAINER_MODE_KEY}={trainer_mode}",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.0",
    ] + [f"+{CONFIG_NAMESPACE}.{k}={v}" for k, v in amir.items()]


logger = logging.getLogger(__name__)

# attn_implementation -> the package transformers needs to load a model with it (its import name, the install)
ATTENTION_PACKAGES = {
    "flash_attention_2": ("flash_attn", "pip install flash-attn==2.8.3 --no-build-isolation once torch is installed, "
                                        "the version verl[fsdp] pins"),
    "flash_attention_3": ("flash_attn_interface", "build FlashAttention 3 from the flash-attention repository's hopper/"),
}
# verl 0.9.1's default (HFModelConfig.__post_init__: override_config.get("attn_implementation", "flash_attention_2"))
VERL_DEFAULT_ATTENTION = "flash_attention_2"
LORA_SYNC_ISSUE = "verl issue 7495: https://github.com/verl-project/verl/issues/7495"


FSDP_STRATEGIES = ("fsdp", "fsdp2")  # verl's FSDP engine: the only one AMIR's actor loss is written and checked for


def missing_attention_package(key: str, model, where: str) -> str | None:
    """Why the FSDP model configured at ``key`` (``model``: that node) cannot load in this process, or None:
    verl builds every FSDP model config with ``override_config.attn_implementation``, flash_attention_2 by default
    (pinned in tests/test_verl_seams.py), and transformers refuses to load the model without its package.
    ``where`` says which process looked (the package is looked for here only)."""
    override = model.get("override_config") or {}
    attention = override.get("attn_implementation", VERL_DEFAULT_ATTENTION)
    if attention not in ATTENTION_PACKAGES:
        return None
    package, install = ATTENTION_PACKAGES[attention]
    if importlib.util.find_spec(package) is not None:
        return None
    default = " (verl's default)" if "attn_implementation" not in override else ""
    return (f"{key} loads with attn_implementation={attention}{default}, but the {package} package is not installed "
            f"{where}: install it ({install}), or run with PyTorch's attention: "
            f"+{key}.override_config.attn_implementation=sdpa")


def ulysses_without_flash_attention(config: DictConfig) -> str | None:
    """Why verl 0.9.1's Ulysses sequence parallelism would compute this run's actor log-probs wrong, or None.

    verl slices each packed micro-batch along the sequence over the SP group and gathers the sequence back only
    inside flash-attention: ``verl.models.transformers.monkey_patch.apply_monkey_patch`` replaces transformers'
    ``_flash_attention_forward`` and nothing else. With another attention implementation (sdpa, eager) each rank
    attends to its own slice only, and every token whose context crosses a slice gets a wrong log-prob, with no
    error. The CPU backend (``AMIR_VERL_CPU=1``) wraps sdpa the same way (:mod:`amir_verl.cpu.platform`, patch 9)."""
    from amir_verl.cpu import SWITCH

    sp = OmegaConf.select(config, "actor_rollout_ref.actor.ulysses_sequence_parallel_size", default=1) or 1
    if sp <= 1 or os.environ.get(SWITCH, "") == "1":
        return None
    if OmegaConf.select(config, "actor_rollout_ref.actor.strategy", default="fsdp") not in FSDP_STRATEGIES:
        return None
    override = OmegaConf.select(config, "actor_rollout_ref.model.override_config", default=None) or {}
    attention = override.get("attn_implementation", VERL_DEFAULT_ATTENTION)
    if str(attention).startswith("flash_attention"):
        return None
    return (f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp} with attn_implementation={attention}: verl "
            "0.9.1 gathers the sequence for Ulysses only inside flash-attention, so each rank would attend to its own "
            "slice and the log-probs would be wrong without an error; use "
            "actor_rollout_ref.model.override_config.attn_implementation=flash_attention_2, or "
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=1")


def check_attention_loads(config: DictConfig) -> None:
    """Warn, on the driver, when this process lacks the attention package of a FSDP model of the run, AMIR or not.

    Only a warning: the models load in verl's workers, whose environment on a cluster need not be the driver's
    (``ray job submit`` runs the entrypoint on the head node, a multi-node job is launched from a login node).
    An AMIR run's worker checks its own environment before loading (:func:`install_worker_checks`); any other
    run is left to verl and transformers."""
    from verl.trainer.ppo.utils import need_critic  # imports the trainer stack: not at plugin load

    models = {"actor_rollout_ref.model": "actor_rollout_ref.actor.strategy"}  # model key -> its engine's strategy
    with warnings.catch_warnings():  # need_critic warns about a critic it disables; verl says so itself later
        warnings.simplefilter("ignore")
        if need_critic(config):
            models["critic.model"] = "critic.strategy"
    for key, strategy_key in models.items():
        if OmegaConf.select(config, strategy_key, default="fsdp") not in FSDP_STRATEGIES:
            continue  # other engines choose attention themselves
        problem = missing_attention_package(key, OmegaConf.select(config, key),
                                            "where the driver runs (a worker without it cannot load the model)")
        if problem is not None:
            logger.warning("amir-verl: %s", problem)


def check_worker_attention(actor_rollout_ref: DictConfig, where: str | None = None) -> None:
    """In the worker about to load an AMIR run's actor (and reference) model: raise ``ValueError`` naming the
    package and the fix when this process lacks the package of the model's attention implementation. Other
    runs, and other engines: nothing (transformers reports it for them)."""
    if OmegaConf.select(actor_rollout_ref, "actor.policy_loss.loss_mode", default="vanilla") not in AMIR_LOSS_MODES:
        return
    if OmegaConf.select(actor_rollout_ref, "actor.strategy", default="fsdp") not in FSDP_STRATEGIES:
        return
    where = where or f"on this worker (host {socket.gethostname()})"
    problem = missing_attention_package("actor_rollout_ref.model", actor_rollout_ref.model, where)
    if problem is not None:
        raise ValueError(problem)


def install_worker_checks(engine_workers) -> None:
    """Wrap ``ActorRolloutRefWorker.init_model`` (``engine_workers``: ``verl.workers.engine_workers``) so that
    an actor or reference worker runs :func:`check_worker_attention` before verl builds its models there.

    ``init_model`` is the first method the trainer calls on the worker (``PPOTrainer.init_workers``), and the
    worker builds its FSDP models in it (``TrainingWorker`` per role); the AMIR loss arrives later
    (``set_loss_fn``, after every ``init_model``). The plugin installs this with a post-import hook in every
    process, so the Ray worker's class carries it; verl's ``WorkerDict`` calls the method by name. A standalone
    rollout worker (role ``rollout``) loads no FSDP model and is not checked. Pinned in
    tests/test_verl_seams.py."""
    cls = engine_workers.ActorRolloutRefWorker
    upstream = cls.init_model
    if getattr(upstream, "_amir_checked", False):
        return

    @functools.wraps(upstream)  # keeps verl's @register dispatch attributes
    def init_model(self, *args, **kwargs):
        if getattr(self, "_is_actor", True) or getattr(self, "_is_ref", True):
            check_worker_attention(self.config)
        return upstream(self, *args, **kwargs)

    init_model._amir_checked = True
    cls.init_model = init_model


def lora_sync_without_adapter(config: DictConfig) -> str | None:
    """Why verl 0.9.1 would roll out the base model of this LoRA run, or None.

    With a checkpoint engine other than ``naive``, ``ActorRolloutRefWorker.update_weights`` calls the FSDP
    engine's ``get_per_tensor_param()`` with its defaults and drops the ``peft_config`` it returns; with
    ``lora.merge=False`` those are the base weights only (the adapter never reaches the rollout). Both
    functions are pinned in tests/test_verl_seams.py."""
    model = config.actor_rollout_ref.model
    rank = model.get("lora_rank", 0) or 0
    merge = bool((model.get("lora") or {}).get("merge", False))
    backend = OmegaConf.select(config, "actor_rollout_ref.rollout.checkpoint_engine.backend", default="naive")
    strategy = OmegaConf.select(config, "actor_rollout_ref.actor.strategy", default="fsdp")
    if rank > 0 and not merge and backend != "naive" and strategy in FSDP_STRATEGIES:
        return (f"actor_rollout_ref.model.lora_rank={rank} with actor_rollout_ref.model.lora.merge=False under "
                f"actor_rollout_ref.rollout.checkpoint_engine.backend={backend}: verl 0.9.1 syncs such a rollout "
                f"with the base weights only, never the adapter ({LORA_SYNC_ISSUE}), so it would generate with the "
                "base model while the actor trains the adapter; set actor_rollout_ref.model.lora.merge=True (the "
                "adapter is merged into the weights each sync)")
    return None


def check_lora_adapter_path(config: DictConfig) -> None:
    """``actor_rollout_ref.model.lora_adapter_path`` (an adapter to start from, e.g. :mod:`amir_verl.lora_init`'s)
    must agree with ``lora_rank`` / ``lora_alpha``: verl 0.9.1's FSDP engine builds LoRA only when
    ``lora_rank > 0`` (``FSDPEngine.__init__``'s ``_is_lora``) and then loads the adapter as saved, whatever
    its rank, while the trainer already counts the run as LoRA from the path alone (``ref_in_actor``). With
    rank 0 the adapter would be ignored and full weights would train against themselves as the reference."""
    model = config.actor_rollout_ref.model
    path = model.get("lora_adapter_path")
    if path is None or OmegaConf.select(config, "actor_rollout_ref.actor.strategy", default="fsdp") not in FSDP_STRATEGIES:
        return
    rank, alpha = model.get("lora_rank", 0) or 0, model.get("lora_alpha")
    saved = Path(str(path)) / "adapter_config.json"
    adapter = json.loads(saved.read_text()) if saved.is_file() else None  # a remote path: verl copies it later
    if rank <= 0:
        hint = f"actor_rollout_ref.model.lora_rank={adapter['r']}" if adapter else "actor_rollout_ref.model.lora_rank"
        raise ValueError(f"actor_rollout_ref.model.lora_adapter_path={path} with lora_rank=0: verl's FSDP engine "
                         f"would ignore the adapter and train full weights; set {hint} (and its lora_alpha)")
    if adapter and (adapter.get("r"), adapter.get("lora_alpha")) != (rank, alpha):
        raise ValueError(f"the adapter at actor_rollout_ref.model.lora_adapter_path={path} has r={adapter.get('r')}, "
                         f"lora_alpha={adapter.get('lora_alpha')}, but the run says lora_rank={rank}, "
                         f"lora_alpha={alpha}: verl would train the adapter as saved while the rollout is sized "
                         "from lora_rank; make them agree")


def check_any_run(config: DictConfig) -> None:
    """What stops any verl run on the driver with the plugin installed, AMIR or not: a LoRA adapter to start
    from that verl would ignore or mis-size. Warnings: an attention package missing where the driver runs
    (:func:`check_attention_loads`), and, for runs that are not AMIR, a LoRA rollout that would never see its
    adapter and Ulysses without flash-attention (errors for AMIR runs: :func:`validate_amir_run`)."""
    check_attention_loads(config)
    check_lora_adapter_path(config)
    if asks_for_amir(config):
        return
    for reason in (lora_sync_without_adapter(config), ulysses_without_flash_attention(config)):
        if reason is not None:
            logger.warning("amir-verl: %s", reason)


def asks_for_amir(config: DictConfig) -> bool:
    """Whether the run sets an AMIR loss mode or an AMIR trainer mode."""
    loss_mode = config.actor_rollout_ref.actor.policy_loss.get("loss_mode", "vanilla")
    trainer_mode = OmegaConf.select(config, AMIR_TRAINER_MODE_KEY, default="sync")
    return loss_mode in AMIR_LOSS_MODES or trainer_mode in AMIR_TRAINER_MODES


def base_parameter_sync_step(config: DictConfig, base_mode: str) -> int:
    """Local updates per step: ``trainer.v1.<base mode>.parameter_sync_step`` as ``PPOTrainer.__init__`` reads it."""
    return int(OmegaConf.select(config, f"trainer.v1.{base_mode}.parameter_sync_step", default=1))


def resolve_base_loss_mode(loss_mode: str, amir: AmirConfig) -> str:
    """The verl policy loss that computes the policy-gradient part of an AMIR loss mode.

    ``amir`` takes ``amir.base_loss_mode`` (required); the paper aliases fix it (a different
    ``amir.base_loss_mode`` is refused). The base must be in verl's policy-loss registry and not an
    AMIR mode or a mode AMIR cannot sit on; ``ValueError`` names the key otherwise.
    """
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    key = f"{CONFIG_NAMESPACE}.base_loss_mode"
    if loss_mode in PAPER_ALIASES:
        base = PAPER_ALIASES[loss_mode]
        if amir.base_loss_mode not in (None, base):
            raise ValueError(
                f"{LOSS_MODE_KEY}={loss_mode} is AMIR on `{base}`, but {key}={amir.base_loss_mode!r}: use "
                f"{LOSS_MODE_KEY}={AMIR_LOSS_MODE} to put AMIR on another base loss"
            )
        return base
    if amir.base_loss_mode is None:
        raise ValueError(f"{LOSS_MODE_KEY}={AMIR_LOSS_MODE} needs the base policy loss: add +{key}=<verl loss mode>, "
                         "e.g. vanilla (GRPO, DAPO, Dr.GRPO), gspo, cispo, sapo, gpg")
    base = amir.base_loss_mode
    supported = sorted(m for m in POLICY_LOSS_REGISTRY if m not in AMIR_LOSS_MODES + UNSUPPORTED_BASE_MODES)
    if base in AMIR_LOSS_MODES or base in UNSUPPORTED_BASE_MODES or base not in POLICY_LOSS_REGISTRY:
        why = "is not in verl's policy-loss registry" if base not in POLICY_LOSS_REGISTRY else "cannot be AMIR's base"
        raise ValueError(f"{key}={base!r} {why}; supported base losses: {', '.join(supported)}")
    return base


def validate_amir_run(config: DictConfig) -> AmirConfig:
    """Return the run's :class:`AmirConfig`, or raise ``ValueError`` naming the key or override to fix."""
    from verl.trainer.ppo.utils import need_reference_policy  # imports the trainer stack: not at plugin load

    loss_mode = config.actor_rollout_ref.actor.policy_loss.get("loss_mode", "vanilla")
    if loss_mode not in AMIR_LOSS_MODES:
        raise ValueError(
            f"the AMIR trainer needs {LOSS_MODE_KEY} in {AMIR_LOSS_MODES} (`amir` with "
            f"+{CONFIG_NAMESPACE}.base_loss_mode, or the paper's amir_grpo / amir_gspo), got {loss_mode!r}"
        )
    strategy = config.actor_rollout_ref.actor.get("strategy", "fsdp")
    if strategy not in FSDP_STRATEGIES:
        # AMIR's actor loss (amir_verl.actor_loss), its weight and normalisation are written and checked for verl's
        # FSDP engine only: Megatron's loss scaling, pipeline and context parallelism never were
        raise ValueError(f"actor_rollout_ref.actor.strategy={strategy}: AMIR supports verl's FSDP engine only "
                         "(fsdp, fsdp2); run it from verl's ppo_trainer config (not ppo_megatron_trainer) with "
                         "actor_rollout_ref.actor.strategy=fsdp2")
    amir = AmirConfig.from_mapping(config.get(CONFIG_NAMESPACE))
    resolve_base_loss_mode(loss_mode, amir)
    rollout_correction = config.get("algorithm", {}).get("rollout_correction", None)
    if rollout_correction is not None and rollout_correction.get("bypass_mode", False):
        raise ValueError("AMIR does not combine with algorithm.rollout_correction.bypass_mode=True, in any "
                         f"schedule: verl then replaces {LOSS_MODE_KEY} with its own bypass_mode loss, and takes "
                         "old_log_probs from the rollout engine (the behaviour policy, possibly several versions), "
                         "so the partners' frozen scores would not be at the weights the update starts from")
    if not amir.reference_free and not need_reference_policy(config):
        raise ValueError(
            f"{CONFIG_NAMESPACE}.reference=ref needs reference log-probs, which this run does not compute: add "
            "actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.0 (the coefficient "
            f"0 adds no KL term), or set {CONFIG_NAMESPACE}.reference=ref_free"
        )
    model = config.actor_rollout_ref.model
    megatron_lora_rank = (model.get("lora") or {}).get("rank", 0) or 0
    if megatron_lora_rank > 0 and not model.get("lora_rank", 0):  # an FSDP actor: other strategies stopped above
        # verl 0.9.1: FSDPEngine reads only model.lora_rank, while the V1 trainer's ref_in_actor also reads
        # model.lora.rank (PPOTrainer._setup, _init_resource_pool_mgr): full weights would train, and the
        # reference log-probs would ask the actor for an adapter it does not have (both reads pinned in
        # tests/test_verl_rules.py)
        raise ValueError(
            f"actor_rollout_ref.model.lora.rank={megatron_lora_rank} is the Megatron engine's LoRA key; verl's "
            "FSDP engine reads actor_rollout_ref.model.lora_rank (0 here), so this run would train full weights: "
            f"set actor_rollout_ref.model.lora_rank={megatron_lora_rank} (as the paper recipes do)"
        )
    for reason in (lora_sync_without_adapter(config), ulysses_without_flash_attention(config)):
        if reason is not None:
            raise ValueError(reason)
    distillation = config.get("distillation")
    if distillation is not None and distillation.get("enabled", False):
        raise ValueError("AMIR does not combine with on-policy distillation: set distillation.enabled=False")
    # verl reads parameter_sync_step under the trainer's mode, which an AMIR trainer reports as its base mode,
    # and in its rollout skip (skip.rollout_tq, the only other reader) under the configured AMIR mode
    # (tests/test_verl_rules.py): with the skip on, the two must agree
    trainer_mode = OmegaConf.select(config, AMIR_TRAINER_MODE_KEY, default=AMIR_TRAINER_MODE)
    base_mode = AMIR_TRAINER_MODES.get(trainer_mode, "sync")
    trainer_steps = base_parameter_sync_step(config, base_mode)
    skip_steps = OmegaConf.select(config, f"trainer.v1.{trainer_mode}.parameter_sync_step", default=1)
    if OmegaConf.select(config, "skip.rollout_tq.enable", default=False) and trainer_steps != skip_steps:
        raise ValueError(
            f"trainer.v1.{base_mode}.parameter_sync_step={trainer_steps} but trainer.v1.{trainer_mode}."
            f"parameter_sync_step={skip_steps}: the AMIR trainer (verl's {base_mode} trainer) reads the first, "
            f"verl's rollout skip (skip.rollout_tq.enable=True) the second; set both alike"
        )
    return amir


def check_amir_run(config: DictConfig) -> None:
    """For a run that asks for AMIR (loss mode or trainer mode): everything :func:`validate_amir_run`
    checks, plus that both switches are set and the V1 trainer is used. Other runs: nothing."""
    loss_mode = config.actor_rollout_ref.actor.policy_loss.get("loss_mode", "vanilla")
    trainer = config.get("trainer", {})
    trainer_mode = trainer.get("v1", {}).get("trainer_mode", "sync")
    if not asks_for_amir(config):
        return
    if loss_mode in AMIR_LOSS_MODES and not trainer.get("use_v1", True):
        raise ValueError(f"{LOSS_MODE_KEY}={loss_mode} needs verl's V1 trainer: set trainer.use_v1=True")
    if loss_mode in AMIR_LOSS_MODES and trainer_mode not in AMIR_TRAINER_MODES:
        amir_mode = next((m for m, base in AMIR_TRAINER_MODES.items() if base == trainer_mode), None)
        hint = (f"{AMIR_TRAINER_MODE_KEY}={amir_mode} (verl's {trainer_mode} schedule with AMIR)" if amir_mode else
                f"{AMIR_TRAINER_MODE_KEY}={AMIR_TRAINER_MODE} (or "
                + " / ".join(m for m in AMIR_TRAINER_MODES if m != AMIR_TRAINER_MODE)
                + " for verl's async schedules)")
        raise ValueError(
            f"{LOSS_MODE_KEY}={loss_mode} needs an AMIR trainer, which adds the preference term: add "
            f"{hint} (got {trainer_mode!r})"
        )
    validate_amir_run(config)


def install_early_config_check() -> None:
    """Wrap ``verl.utils.config.validate_config`` so that it also runs :func:`check_any_run` and
    :func:`check_amir_run`.

    ``verl.trainer.main_ppo.main`` calls it on the driver before ``ray.init``; ``main_ppo`` binds the
    name at import, after ``import verl`` has loaded this plugin, so it gets the wrapper. Guarded by
    ``tests/test_verl_seams.py``.
    """
    import verl.utils.config as verl_config

    upstream = verl_config.validate_config
    if getattr(upstream, "_amir_checked", False):
        return

    @functools.wraps(upstream)
    def validate_config(config, *args, **kwargs):
        result = upstream(config, *args, **kwargs)
        check_any_run(config)
        check_amir_run(config)
        return result

    validate_config._amir_checked = True
    verl_config.validate_config = validate_config
