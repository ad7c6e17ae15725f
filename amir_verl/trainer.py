"""Driver side of the verl glue: the V1 trainer modes ``amir``, ``amir_colocate_async`` and ``amir_separate_async``.

``trainer.v1.trainer_mode=<mode>`` selects one of three classes, each :class:`AmirTrainerMixin` put before
one of verl's V1 trainers, so that there is one copy of the AMIR logic whatever the schedule
(:data:`amir_verl.run_config.AMIR_TRAINER_MODES`):

- ``amir``: :class:`AmirPPOTrainer` on ``PPOTrainerSync``;
- ``amir_colocate_async``: :class:`AmirColocateAsyncTrainer` on ``PPOTrainerColocateAsync`` (rollout and
  training share the devices; partial rollouts resume under new weights);
- ``amir_separate_async``: :class:`AmirSeparateAsyncTrainer` on ``PPOTrainerSeparateAsync`` (a standalone
  rollout pool; ``parameter_sync_step`` local updates per weight sync).

The mixin's additions, each calling the upstream method first:

- ``__init__``: validates the AMIR config before any worker or model starts.
- ``on_init_end``: installs :func:`amir_verl.actor_loss.amir_ppo_loss` on the actor workers
  (``ActorRolloutRefWorker.set_loss_fn``).
- ``_compute_advantage``: after verl's advantages (and importance weights), mines the pairs of the batch
  it is given (the whole step in sync mode, one local update's batch in the async modes), measures both
  terms' gradients at the start of the update (verl's registered base policy loss with verl's
  ``rollout_is_weights``, differentiated on the driver), lets the lambda controller pick the update's
  lambda, and stores each sequence's AMIR fields in TransferQueue beside ``advantages``; logs ``amir/*``.
- ``_log_rollout_data`` (with ``trainer.rollout_data_dir``): each dumped sequence also carries its AMIR
  fields (:data:`DUMPED_FIELDS`), so that a step's pairs and preference loss can be recomputed from the dump.
- ``_save_checkpoint`` / ``_load_checkpoint``: the controller's state travels with verl's checkpoint.

The upstream sources of these methods are pinned by ``tests/test_verl_seams.py``; every read of the
trainer mode in verl is listed, with how each class handles it, in ``tests/test_verl_rules.py``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from functools import partial

import transfer_queue as tq
from omegaconf import DictConfig
from tensordict import TensorDict

from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path
from verl.utils.config import omega_conf_to_dataclass

from amir_verl.actor_loss import amir_ppo_loss, base_actor_config
from amir_verl.lambda_control import LambdaController
from amir_verl.run_config import (
    AMIR_COLOCATE_ASYNC_MODE,
    AMIR_SEPARATE_ASYNC_MODE,
    AMIR_TRAINER_MODE,
    AMIR_TRAINER_MODES,
    SPLIT_INVARIANT_BASE_MODES,
    base_parameter_sync_step,
    resolve_base_loss_mode,
    validate_amir_run,
)
from amir_verl.step_batch import (
    FIELD_PARTNER_SCORE,
    FIELD_PARTNER_SIGN,
    FIELD_REF_SEQ_LOGP,
    driver_step,
)

logger = logging.getLogger(__name__)

STATE_FILE = "amir_state.json"
# Per-sequence fields added to verl's rollout dump: l_old (the length-normalised log-prob the update starts
# from), l_ref, and the partner table the actor's loss reads (amir_verl.preference.partner_table).
FIELD_OLD_SEQ_LOGP = "amir_old_seq_logp"
DUMPED_FIELDS = (FIELD_OLD_SEQ_LOGP, FIELD_REF_SEQ_LOGP, FIELD_PARTNER_SCORE, FIELD_PARTNER_SIGN)


def run_base_actor_config(config: DictConfig):
    """The run's actor config as verl's dataclass, with the AMIR loss mode replaced by its base mode."""
    amir = validate_amir_run(config)
    base_mode = resolve_base_loss_mode(config.actor_rollout_ref.actor.policy_loss.loss_mode, amir)
    return amir, base_actor_config(omega_conf_to_dataclass(config.actor_rollout_ref.actor), base_mode)


def make_amir_loss_fn(config: DictConfig):
    """The actor loss for ``set_loss_fn``: verl's ``ppo_loss`` with the base loss mode, plus AMIR."""
    amir, actor_config = run_base_actor_config(config)
    return partial(amir_ppo_loss, config=actor_config, beta_dpo=amir.beta_dpo)


def whole_batch_policy_loss(actor_config, num_sequences: int, num_tokens: int):
    """verl's registered base policy loss over a whole step batch as one piece (dp 1, one mini-batch).

    Returns a callable of ``old_log_prob, log_prob, advantages, response_mask, rollout_is_weights`` for
    :func:`amir_verl.step_batch.gradient_signal`; ``actor_config`` carries the base loss mode.
    """
    whole = dataclasses.replace(actor_config, global_batch_info={
        "dp_size": 1, "batch_num_tokens": num_tokens, "global_batch_size": num_sequences,
        "loss_scale_factor": actor_config.loss_scale_factor,
    })
    return partial(get_policy_loss_fn(whole.policy_loss.loss_mode), loss_agg_mode=whole.loss_agg_mode, config=whole)


def describe_update_semantics(config: DictConfig, base_mode: str) -> str | None:
    """One line on how the term behaves under the schedule's local updates, mini-batches and epochs; None
    when each step is one optimizer step on data whose partners are frozen at the update's starting weights.

    verl splits a step into ``parameter_sync_step`` local updates (``PPOTrainer.step``), each sampling
    ``train_batch_size / parameter_sync_step`` prompts, recomputing ``old_log_probs`` and running
    ``_compute_advantage`` (so mining the pairs and picking a lambda) and the actor update, which splits
    its batch into mini-batches. ``old_log_probs`` are the actor's current weights, except in
    ``separate_async`` local updates j >= 1, where verl restores the cycle's starting weights (pi_old) first.
    """
    actor = config.actor_rollout_ref.actor
    local_updates = base_parameter_sync_step(config, base_mode)
    mini_batches = config.data.train_batch_size // local_updates // actor.ppo_mini_batch_size
    epochs = actor.get("ppo_epochs", 1)
    lines = []
    if local_updates > 1:
        where = ("pi_old, the weights at the start of the sync cycle (verl's decoupled PPO): the term is exact "
                 "for local update 0 and an anchored surrogate for the later ones" if base_mode == "separate_async"
                 else "the weights each local update starts from")
        lines.append(f"AMIR: {local_updates} local updates per step ({base_mode}), each mining its own pairs and "
                     f"picking its own lambda; partners are frozen at {where}; verl averages the amir/* metrics "
                     "over the local updates.")
    if mini_batches > 1 or epochs > 1:
        update = "step" if local_updates == 1 else "local update"
        lines.append(
            f"AMIR: {mini_batches} mini-batch(es) x {epochs} epoch(s) per {update}: each sequence's pair terms use "
            "its current log-prob against its partners' log-probs frozen at the start of the update (like the "
            f"advantages); the term is exact only for the first optimizer step. Each {update} weighs it by the "
            "number of mini-batches (docs/schedules.md, 'Mini-batches and epochs')."
        )
    return " ".join(lines) or None


def write_amir_state(folder: str, global_steps: int, controller: LambdaController) -> None:
    """Save the lambda controller into a verl ``global_step_N`` checkpoint folder."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, STATE_FILE), "w") as f:
        json.dump({"global_steps": global_steps, "lambda_controller": controller.state_dict()}, f)


def read_amir_state(folder: str, controller: LambdaController) -> bool:
    """Restore the controller from ``folder``; False when the checkpoint has no AMIR state."""
    path = os.path.join(folder, STATE_FILE)
    if not os.path.exists(path):
        return False
    with open(path) as f:
        controller.load_state_dict(json.load(f)["lambda_controller"])
    logger.info("restored the AMIR lambda controller from %s: lambda=%s", path, controller.value)
    return True


class AmirTrainerMixin:
    """AMIR's additions to one of verl's V1 trainers (see the module docstring); put before verl's class.

    ``AMIR_MODE`` is the configured ``trainer.v1.trainer_mode``; ``BASE_MODE`` the verl mode whose schedule
    the class runs, which is what the trainer object reports as ``trainer_mode``.
    """

    AMIR_MODE: str
    BASE_MODE: str  # set from the mode table (run_config.AMIR_TRAINER_MODES) for each subclass

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.BASE_MODE = AMIR_TRAINER_MODES[cls.AMIR_MODE]

    def __init__(self, config: DictConfig):
        self.init_amir_state(config)
        semantics = describe_update_semantics(config, self.BASE_MODE)
        if semantics:
            logger.warning(semantics)
        super().__init__(config)

    def init_amir_state(self, config: DictConfig) -> None:
        """What the AMIR steps read besides verl's state: the run's AMIR config, the base loss's actor config
        and the lambda controller (also what a test needs to run the advantage step without verl's
        ``__init__``, which starts rollout servers)."""
        self.amir, self.base_actor_config = run_base_actor_config(config)
        self.lambda_controller = self.amir.make_lambda_controller()

    # verl 0.9.1 compares ``trainer_mode`` with "sync" in _build_replay_buffer, _init_dataloader,
    # _load_checkpoint, _save_checkpoint, _reissue_inflight_prompts and _submit_batch_to_rollout, and
    # reads its options from ``trainer.v1.<trainer_mode>``. Each AMIR class runs its base class's schedule,
    # so it reports the base mode there; PPOTrainer.__init__ assigns the configured name, which is ignored.
    # Every read of the mode in verl is listed in tests/test_verl_rules.py.
    @property
    def trainer_mode(self) -> str:
        return self.BASE_MODE

    @trainer_mode.setter
    def trainer_mode(self, value: str) -> None:
        if value != self.AMIR_MODE:
            raise ValueError(f"{type(self).__name__} is trainer mode {self.AMIR_MODE!r}, got {value!r}")

    def on_init_end(self):
        super().on_init_end()
        self.actor_rollout_wg.set_loss_fn(make_amir_loss_fn(self.config))

    def _compute_advantage(self, batch, metrics: dict):
        batch = super()._compute_advantage(batch, metrics)
        # rollout_is_weights: written by super() when algorithm.rollout_correction.rollout_is is set (a field
        # absent from the store is left out of the answer, as in verl's own select list)
        fields = ["uid", "response_mask", "rm_scores", "old_log_probs", "advantages", "rollout_is_weights"]
        if not self.amir.reference_free:
            fields.append("ref_log_prob")
        if self.config.algorithm.use_kl_in_reward:
            fields.append("token_level_rewards")
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
        if not self.amir.reference_free and "ref_log_prob" not in data.keys():
            raise RuntimeError("amir.reference=ref but verl computed no ref_log_prob for this batch")
        padded = data.to_padded_tensor()
        reward_field = "token_level_rewards" if self.config.algorithm.use_kl_in_reward else "rm_scores"
        actor = self.config.actor_rollout_ref.actor
        step = driver_step(
            self.amir,
            self.lambda_controller,
            whole_batch_policy_loss(self.base_actor_config, len(batch), int(padded["response_mask"].sum())),
            sequence_rewards=padded[reward_field].float().sum(dim=-1),
            uids=[str(u) for u in padded.pop("uid").tolist()],  # as PPOTrainer._compute_advantage reads it
            response_mask=padded["response_mask"],
            old_log_probs=padded["old_log_probs"],
            ref_log_probs=padded["ref_log_prob"] if not self.amir.reference_free else None,
            advantages=padded["advantages"],
            mini_batch_sequences=actor.ppo_mini_batch_size * self.config.actor_rollout_ref.rollout.n,
            sample_keys=list(batch.keys),
            is_padding=[bool(tag.get("is_padding", False)) for tag in batch.tags],
            rollout_is_weights=padded["rollout_is_weights"] if "rollout_is_weights" in padded.keys() else None,
            chunked=self.base_actor_config.policy_loss.loss_mode in SPLIT_INVARIANT_BASE_MODES,
        )
        fields = step.fields
        # verl dumps a step's rollouts once, after its last local update (PPOTrainer.fit): collect them all
        if self.local_trigger_step == 0:
            self._step_dump_fields = {name: {} for name in DUMPED_FIELDS}
        for name, values in zip(DUMPED_FIELDS, (fields.old_seq_logp, fields.ref_seq_logp, fields.partner_score,
                                                fields.partner_sign)):
            self._step_dump_fields[name].update(zip(batch.keys, values.tolist()))
        # The workers fetch exactly the fields the returned meta lists (verl's tqbridge), so keep it.
        stored = tq.kv_batch_put(
            keys=batch.keys,
            partition_id=batch.partition_id,
            fields=TensorDict(
                {
                    FIELD_REF_SEQ_LOGP: fields.ref_seq_logp.float(),
                    FIELD_PARTNER_SCORE: fields.partner_score.float(),
                    FIELD_PARTNER_SIGN: fields.partner_sign.float(),
                },
                batch_size=len(batch),
            ),
        )
        stored.extra_info = {**batch.extra_info, **(stored.extra_info or {}), **step.extra_info}
        metrics.update(step.metrics)
        return stored

    def _log_rollout_data(self, batch, timing_raw: dict, rollout_data_dir: str):
        # PPOTrainerBase._log_rollout_data dumps prompt, response, score and the sample key (as "uid", sorted)
        # through self._dump_generations(..., reward_extra_infos_dict=...), whose every column of one value
        # per sample becomes a field of that sample's line: AMIR's columns are added there, by key.
        fields, upstream_dump = self._step_dump_fields, self._dump_generations

        def dump_with_amir_fields(**kwargs):
            columns = kwargs["reward_extra_infos_dict"]
            keys = columns["uid"]
            columns.update({name: [values[key] for key in keys] for name, values in fields.items()})
            return upstream_dump(**kwargs)

        self._dump_generations = dump_with_amir_fields
        try:
            super()._log_rollout_data(batch, timing_raw, rollout_data_dir)
        finally:
            del self._dump_generations

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
        """The global_step folder PPOTrainer._load_checkpoint resumed from (it does not keep it); the
        same folder in every resume_mode (tests/test_verl_rules.py)."""
        if self.config.trainer.resume_mode == "resume_path":
            folder = self.config.trainer.resume_from_path
        else:
            folder = find_latest_ckpt_path(self.config.trainer.default_local_dir)
        return folder if os.path.isabs(folder) else os.path.join(os.getcwd(), folder)



@register_trainer(AMIR_TRAINER_MODE)
class AmirPPOTrainer(AmirTrainerMixin, PPOTrainerSync):
    """verl's synchronous V1 trainer plus AMIR's preference term."""

    AMIR_MODE = AMIR_TRAINER_MODE


@register_trainer(AMIR_COLOCATE_ASYNC_MODE)
class AmirColocateAsyncTrainer(AmirTrainerMixin, PPOTrainerColocateAsync):
    """verl's colocated asynchronous V1 trainer plus AMIR's preference term."""

    AMIR_MODE = AMIR_COLOCATE_ASYNC_MODE


@register_trainer(AMIR_SEPARATE_ASYNC_MODE)
class AmirSeparateAsyncTrainer(AmirTrainerMixin, PPOTrainerSeparateAsync):
    """verl's separated asynchronous V1 trainer (decoupled PPO) plus AMIR's preference term."""

    AMIR_MODE = AMIR_SEPARATE_ASYNC_MODE
