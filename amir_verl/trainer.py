"""Driver side of the verl glue: the V1 trainer mode ``amir``.

``trainer.v1.trainer_mode=amir`` selects :class:`AmirPPOTrainer`, verl's synchronous trainer
(``PPOTrainerSync``) with these small additions, each calling the upstream method first:

- ``__init__``: validates the AMIR config before any worker or model starts.
- ``on_init_end``: installs :func:`amir_verl.actor_loss.amir_ppo_loss` on the actor workers
  (``ActorRolloutRefWorker.set_loss_fn``).
- ``_compute_advantage``: after verl's advantages, mines the step's pairs over the whole batch and
  stores each sequence's AMIR fields in TransferQueue beside ``advantages``; logs ``amir/*``.
- ``_update_actor``: after the update, feeds the step's losses to the lambda controller.
- ``_save_checkpoint`` / ``_load_checkpoint``: the controller's state travels with verl's checkpoint.

The upstream sources of these methods are pinned by ``tests/test_verl_seams.py``.
"""

from __future__ import annotations

import json
import logging
import os
from functools import partial

import numpy as np
import transfer_queue as tq
from omegaconf import DictConfig
from tensordict import TensorDict

from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path
from verl.utils.config import omega_conf_to_dataclass

from amir_verl.actor_loss import AMIR_TRAINER_MODE, amir_ppo_loss
from amir_verl.lambda_control import AdaptiveLambdaController
from amir_verl.run_config import validate_amir_run
from amir_verl.step_batch import (
    EXTRA_LOSS_SCALE,
    FIELD_PARTNER_SCORE,
    FIELD_PARTNER_SIGN,
    FIELD_REF_SEQ_LOGP,
    compute_step_fields,
    loss_scale,
)

logger = logging.getLogger(__name__)

STATE_FILE = "amir_state.json"


def make_amir_loss_fn(config: DictConfig):
    """The actor loss for ``set_loss_fn``: verl's ``ppo_loss`` on the worker's ActorConfig, plus AMIR."""
    amir = validate_amir_run(config)
    actor_config = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    return partial(amir_ppo_loss, config=actor_config, beta_dpo=amir.beta_dpo)


def write_amir_state(folder: str, global_steps: int, controller: AdaptiveLambdaController) -> None:
    """Save the lambda controller into a verl ``global_step_N`` checkpoint folder."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, STATE_FILE), "w") as f:
        json.dump({"global_steps": global_steps, "lambda_controller": controller.state_dict()}, f)


def read_amir_state(folder: str, controller: AdaptiveLambdaController) -> bool:
    """Restore the controller from ``folder``; False when the checkpoint has no AMIR state."""
    path = os.path.join(folder, STATE_FILE)
    if not os.path.exists(path):
        return False
    with open(path) as f:
        controller.load_state_dict(json.load(f)["lambda_controller"])
    logger.info("restored the AMIR lambda controller from %s: lambda=%s", path, controller.value)
    return True


@register_trainer(AMIR_TRAINER_MODE)
class AmirPPOTrainer(PPOTrainerSync):
    """verl's synchronous V1 trainer plus AMIR's preference term (see the module docstring)."""

    def __init__(self, config: DictConfig):
        self.amir = validate_amir_run(config)
        self.lambda_controller = self.amir.make_lambda_controller()
        self._pending_pref = None  # (pref_loss, num_pairs) of the step in flight
        super().__init__(config)

    # verl 0.9.1 tests ``trainer_mode == "sync"`` in _build_replay_buffer, _init_dataloader,
    # _load_checkpoint, _save_checkpoint, _reissue_inflight_prompts and _submit_batch_to_rollout.
    # AMIR runs PPOTrainerSync's schedule, so it reports "sync" there; PPOTrainer.__init__ assigns
    # the configured name, which is ignored.
    @property
    def trainer_mode(self) -> str:
        return "sync"

    @trainer_mode.setter
    def trainer_mode(self, value: str) -> None:
        if value != AMIR_TRAINER_MODE:
            raise ValueError(f"AmirPPOTrainer is trainer mode {AMIR_TRAINER_MODE!r}, got {value!r}")

    def on_init_end(self):
        super().on_init_end()
        self.actor_rollout_wg.set_loss_fn(make_amir_loss_fn(self.config))

    def _compute_advantage(self, batch, metrics: dict):
        batch = super()._compute_advantage(batch, metrics)
        fields = ["uid", "response_mask", "rm_scores", "old_log_probs"]
        if not self.amir.reference_free:
            fields.append("ref_log_prob")
        if self.config.algorithm.use_kl_in_reward:
            fields.append("token_level_rewards")
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
        if not self.amir.reference_free and "ref_log_prob" not in data.keys():
            raise RuntimeError("amir.reference=ref but verl computed no ref_log_prob for this batch")
        padded = data.to_padded_tensor()
        uids = [str(u) for u in padded.pop("uid").tolist()]  # as PPOTrainer._compute_advantage reads it
        rewards = padded["token_level_rewards" if self.config.algorithm.use_kl_in_reward else "rm_scores"]
        step = compute_step_fields(
            self.amir,
            sequence_rewards=rewards.float().sum(dim=-1),
            uids=uids,
            response_mask=padded["response_mask"],
            old_log_probs=padded["old_log_probs"],
            ref_log_probs=padded["ref_log_prob"] if not self.amir.reference_free else None,
            sample_keys=list(batch.keys),
            is_padding=[bool(tag.get("is_padding", False)) for tag in batch.tags],
        )
        # The workers fetch exactly the fields the returned meta lists (verl's tqbridge), so keep it.
        stored = tq.kv_batch_put(
            keys=batch.keys,
            partition_id=batch.partition_id,
            fields=TensorDict(
                {
                    FIELD_REF_SEQ_LOGP: step.ref_seq_logp.float(),
                    FIELD_PARTNER_SCORE: step.partner_score.float(),
                    FIELD_PARTNER_SIGN: step.partner_sign.float(),
                },
                batch_size=len(batch),
            ),
        )
        stored.extra_info = {**batch.extra_info, **(stored.extra_info or {})}
        batch = stored
        mini_batch = self.config.actor_rollout_ref.actor.ppo_mini_batch_size * self.config.actor_rollout_ref.rollout.n
        lambda_reg = self.lambda_controller.value
        batch.extra_info[EXTRA_LOSS_SCALE] = loss_scale(lambda_reg, step.num_pairs, len(batch), mini_batch)
        metrics.update(step.stats.as_metrics())
        metrics["amir/lambda"] = lambda_reg
        self._pending_pref = (step.stats.pref_loss, step.num_pairs)
        return batch

    def _update_actor(self, batch, metrics: dict):
        batch = super()._update_actor(batch, metrics)
        pref_loss, num_pairs = self._pending_pref
        pg_loss = metrics.get("actor/pg_loss")
        if pg_loss is None:
            raise RuntimeError("verl reported no actor/pg_loss; the lambda controller needs it")
        self.lambda_controller.update(float(np.mean(pg_loss)), pref_loss, num_pairs)
        if self.lambda_controller.last_ratio is not None:
            metrics["amir/pref_ratio"] = self.lambda_controller.last_ratio
        return batch

    def _save_checkpoint(self):
        # Written before verl's tracker file (latest_checkpointed_iteration.txt), which super() writes
        # last, so a checkpoint that resume can find always has the controller state.
        folder = os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}")
        write_amir_state(folder, self.global_steps, self.lambda_controller)
        super()._save_checkpoint()

    def _load_checkpoint(self):
        super()._load_checkpoint()
        if self.global_steps == 0:
            return
        folder = self._resumed_folder()
        if not read_amir_state(folder, self.lambda_controller):
            logger.warning(
                "resumed from %s, which has no %s (not an AMIR run?): lambda restarts at amir.lambda_init",
                folder, STATE_FILE,
            )

    def _resumed_folder(self) -> str:
        """The global_step folder PPOTrainer._load_checkpoint resumed from (it does not keep it)."""
        if self.config.trainer.resume_mode == "resume_path":
            folder = self.config.trainer.resume_from_path
        else:
            folder = find_latest_ckpt_path(self.config.trainer.default_local_dir)
        return folder if os.path.isabs(folder) else os.path.join(os.getcwd(), folder)

