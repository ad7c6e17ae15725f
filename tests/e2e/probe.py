"""A probe of the AMIR trainers for the end-to-end tests: records what each ``_compute_advantage`` saw and did.

verl's rollout dump keeps decoded text only, so the runs record AMIR's own inputs: a Ray worker setup hook
(:func:`install_probe`, set with ``+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=tests.e2e.probe.install_probe``
and the environment variable :data:`PROBE_DIR_ENV`) wraps ``AmirTrainerMixin._compute_advantage`` in the process
that runs the trainer. Each call (one per local update) saves ``step_<k>.pt`` (local update 0) or
``step_<k>_<j>.pt`` (local update j >= 1 of ``separate_async``): the sample keys and tags (verl's
``min_global_steps`` / ``max_global_steps``: the weight versions a trajectory was generated over), the
per-sample fields of :data:`PROBE_FIELDS` present in TransferQueue, and the ``amir/*`` metrics of the call;
and ``actor_<k>[_<j>].pt``, the ``actor/*`` metrics of the local update's actor update.

Ray workers import this module: verl and the test modules are imported lazily.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path

import torch

from amir_verl.metrics import PREFIX

PROBE_DIR_ENV = "AMIR_TEST_PROBE_DIR"
PROBE_FIELDS = ["prompts", "responses", "response_mask", "rm_scores", "old_log_probs", "ref_log_prob",
                "rollout_log_probs", "advantages", "rollout_is_weights", "amir_ref_seq_logp", "amir_partner_score",
                "amir_partner_sign"]


def _as_lists(tensor: torch.Tensor) -> list:
    """A TransferQueue field -> one Python list per sample (jagged fields have no padding)."""
    return [row.tolist() for row in tensor.unbind(0)] if tensor.is_nested else tensor.tolist()


def _record_file(folder: Path, trainer, prefix: str) -> Path:
    local = trainer.local_trigger_step
    return folder / (f"{prefix}_{trainer.global_steps}.pt" if local == 0 else f"{prefix}_{trainer.global_steps}_{local}.pt")


def _record_calls(trainer_cls, folder: Path) -> None:
    upstream = trainer_cls._compute_advantage

    def _compute_advantage(self, batch, metrics):
        import transfer_queue as tq

        batch = upstream(self, batch, metrics)
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=PROBE_FIELDS)
        record = {name: _as_lists(data[name]) for name in PROBE_FIELDS if name in data.keys()}
        record["keys"] = list(batch.keys)
        record["tags"] = [dict(tag) for tag in batch.tags]
        record["metrics"] = {k: float(v) for k, v in metrics.items() if k.startswith(PREFIX)}
        record["extra_info"] = {k: v for k, v in batch.extra_info.items() if k.startswith("amir_")}
        torch.save(record, _record_file(folder, self, "step"))
        return batch

    def _update_actor(self, batch, metrics):
        # the mixin defines no _update_actor: this runs verl's, and records this local update's actor metrics
        # (verl averages them over a step's local updates)
        seen = set(metrics)
        batch = super(trainer_cls, self)._update_actor(batch, metrics)
        torch.save({k: float(v) for k, v in metrics.items() if k not in seen and k.startswith("actor/")},
                   _record_file(folder, self, "actor"))
        return batch

    trainer_cls._compute_advantage = _compute_advantage
    trainer_cls._update_actor = _update_actor


class _PatchTrainerOnImport(importlib.abc.MetaPathFinder):
    """Wraps the AMIR trainers when ``amir_verl.trainer`` is imported (only verl processes import it, so the
    other Ray workers do not pay for importing verl)."""

    def __init__(self, folder: Path):
        self.folder = folder

    def find_spec(self, name, path, target=None):
        if name != "amir_verl.trainer":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _record_calls(module.AmirTrainerMixin, self.folder)

        spec.loader.exec_module = exec_module
        return spec


def install_probe() -> None:
    """Ray ``worker_process_setup_hook`` (a no-op without :data:`PROBE_DIR_ENV`)."""
    folder = os.environ.get(PROBE_DIR_ENV)
    if folder:
        sys.meta_path.insert(0, _PatchTrainerOnImport(Path(folder)))


def probed(command, workdir: Path, repo: Path):
    """``command`` (a :class:`amir_verl.cpu.launch.LoggedCommand` of main_ppo) with the probe, recording in
    ``workdir/probe``."""
    probe = workdir / "probe"
    probe.mkdir(parents=True)
    command.cmd.append(f"+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook={__name__}.install_probe")
    command.env[PROBE_DIR_ENV] = str(probe)
    command.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))
    return command
