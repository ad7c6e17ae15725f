"""Behavioural pins of the verl 0.9.1 rules that AMIR re-implements or depends on.

Each test feeds verl's own code an input and checks the rule AMIR assumes, so a change of behaviour in
verl fails here even where the source fingerprints of tests/test_verl_seams.py would not notice (a
function AMIR does not override), and a comment edit in verl does not fail here.
"""

import ast
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import verl
from verl.protocol import DataProto
from verl.trainer.ppo.core_algos import AdvantageEstimator
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync
from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories
from verl.utils.skip.rollout_skip import RolloutTqSkip

from amir_verl.config import AmirConfig
from amir_verl.run_config import AMIR_TRAINER_MODES, validate_amir_run
from amir_verl.step_batch import session_final_mask
from amir_verl.trainer import AmirPPOTrainer, AmirTrainerMixin, write_amir_state
from tests.support import AMIR, GRPO, compose_verl

# ------------------------------------------------------------ which outputs of an agent session count


def grpo_advantages(keys: list[str], uids: list[str], rewards: list[float]) -> torch.Tensor:
    """(N,) verl's V1 GRPO advantage of each sample (responses of 2 tokens, the reward on the last).

    No std normalisation: then raising a reward always moves its own advantage when its group has two or
    more final outputs (with it, a group of two gets +-0.707 whatever the rewards)."""
    n = len(keys)
    data = DataProto.from_dict(
        tensors={"token_level_rewards": torch.tensor([[0.0, r] for r in rewards], dtype=torch.float64),
                 "response_mask": torch.ones(n, 2)},
        non_tensors={"uid": np.array(uids, dtype=object)},
    )
    out = compute_advantage_for_multi_trajectories(data, keys, AdvantageEstimator.GRPO,
                                                   norm_adv_by_std_in_grpo=False)
    return out.batch["advantages"][:, 0]


def rows_whose_reward_verl_reads(keys: list[str], uids: list[str]) -> list[bool]:
    """Raise one sample's reward at a time: verl reads it iff some advantage of the batch changes."""
    rewards = [0.1 * (i % 7) for i in range(len(keys))]
    base = grpo_advantages(keys, uids, rewards)
    read = []
    for i in range(len(keys)):
        bumped = list(rewards)
        bumped[i] += 1.0
        read.append(not torch.equal(grpo_advantages(keys, uids, bumped), base))
    return read


def uid_of(key: str) -> str:
    return key.rsplit("_", 2)[0]


# Sessions of several outputs, indexes above 0 with no 0, index 10 after 9 (a string comparison would
# pick 9), a session listed out of order, and uids with underscores: "p" session "1" (keys p_1_*) next
# to "p_1" session "0" (keys p_1_0_*). Every uid has two or more sessions (see grpo_advantages).
MULTI_OUTPUT_KEYS = [
    "u_a_0_9", "v_1_1", "u_a_0_0", "p_1_3", "u_a_1_0", "u_a_2_1", "v_0_0", "p_1_0_0", "u_a_0_10",
    "u_a_2_0", "v_1_0", "u_a_3_2", "p_1_0", "p_1_2_5", "v_2_3", "p_4_0", "p_1_2_0",
]
# decided from the rule "the highest index of each {uid}_{session}", by hand
MULTI_OUTPUT_FINAL = [
    False, True, False, True, True, True, True, True, True,
    False, False, True, False, True, True, True, False,
]


def test_session_final_mask_marks_exactly_the_outputs_verls_grpo_advantage_reads():
    uids = [uid_of(k) for k in MULTI_OUTPUT_KEYS]
    assert session_final_mask(MULTI_OUTPUT_KEYS).tolist() == MULTI_OUTPUT_FINAL
    assert rows_whose_reward_verl_reads(MULTI_OUTPUT_KEYS, uids) == MULTI_OUTPUT_FINAL
    # the other outputs of a session get its final output's advantage
    advantages = grpo_advantages(MULTI_OUTPUT_KEYS, uids, [0.1 * i for i in range(len(uids))])
    final_of = {k.rsplit("_", 1)[0]: a for k, a, f in zip(MULTI_OUTPUT_KEYS, advantages, MULTI_OUTPUT_FINAL) if f}
    assert all(a == final_of[k.rsplit("_", 1)[0]] for k, a in zip(MULTI_OUTPUT_KEYS, advantages))


def test_single_output_sessions_all_count():
    keys = ["u_a_0_0", "u_a_1_0", "u_a_2_0", "v_0_0", "v_1_0", "w_b_c_0_0", "w_b_c_7_0"]
    uids = [uid_of(k) for k in keys]
    assert session_final_mask(keys).tolist() == [True] * len(keys)
    assert rows_whose_reward_verl_reads(keys, uids) == [True] * len(keys)


# ------------------------------------------------------------ which checkpoint folder a resume reads


class RecordingActorWorkers:
    """Stands in for the actor worker group: records the folder ``_load_checkpoint`` loads."""

    def __init__(self):
        self.folders = []

    def load_checkpoint(self, local_path, del_local_after_load):
        self.folders.append(os.path.dirname(local_path))


def checkpoint_tree(root: Path) -> None:
    """root/ckpts/global_step_{2,4,6,8} (tracker: 6, not the newest), root/empty/ (no tracker),
    root/stale/ (tracker naming a missing folder), root/other/global_step_3; each folder's AMIR state
    records its own step as the controller's num_updates."""
    steps = {"ckpts": [2, 4, 6, 8], "other": [3], "stale": [1]}
    for name, numbers in steps.items():
        for step in numbers:
            controller = AmirConfig(lambda_rule="fixed").make_lambda_controller()
            controller.num_updates = step
            write_amir_state(str(root / name / f"global_step_{step}"), step, controller)
    (root / "ckpts" / "latest_checkpointed_iteration.txt").write_text("6")
    (root / "stale" / "latest_checkpointed_iteration.txt").write_text("5")
    (root / "empty").mkdir()


RESUME_CASES = [  # resume_mode, default_local_dir, resume_from_path, folder verl must load (None: none)
    ("auto", "{root}/ckpts", None, "{root}/ckpts/global_step_6"),
    ("auto", "ckpts", None, "{root}/ckpts/global_step_6"),  # relative to the working directory
    ("auto", "{root}/empty", None, None),
    ("auto", "{root}/stale", None, None),
    ("resume_path", "{root}/ckpts", "{root}/other/global_step_3", "{root}/other/global_step_3"),
    ("resume_path", "{root}/ckpts", "other/global_step_3", "{root}/other/global_step_3"),
    ("disable", "{root}/ckpts", None, None),
]


@pytest.mark.parametrize("mode, local_dir, resume_from, expected", RESUME_CASES)
def test_amir_state_comes_from_the_folder_verl_resumes_from(tmp_path, monkeypatch, mode, local_dir, resume_from,
                                                            expected):
    checkpoint_tree(tmp_path)
    monkeypatch.chdir(tmp_path)
    fill = lambda s: None if s is None else s.format(root=tmp_path)  # noqa: E731
    trainer = AmirPPOTrainer.__new__(AmirPPOTrainer)  # _load_checkpoint needs no workers or data beyond these
    trainer.config = OmegaConf.create({"trainer": {
        "resume_mode": mode, "default_local_dir": fill(local_dir), "resume_from_path": fill(resume_from),
        "del_local_ckpt_after_load": False}})
    trainer.actor_rollout_wg = RecordingActorWorkers()
    trainer.use_critic = False
    trainer.lambda_controller = AmirConfig(lambda_rule="fixed").make_lambda_controller()

    trainer._load_checkpoint()  # AMIR's override: verl's PPOTrainer._load_checkpoint, then the AMIR state

    if fill(expected) is None:
        assert trainer.actor_rollout_wg.folders == [] and trainer.global_steps == 0
        assert trainer.lambda_controller.num_updates == 0
        return
    assert trainer.actor_rollout_wg.folders == [fill(expected)]
    assert trainer._resumed_folder() == fill(expected)
    step = int(fill(expected).rsplit("_", 1)[1])
    assert trainer.global_steps == step and trainer.lambda_controller.num_updates == step


# ------------------------------------------------------------ every read of trainer_mode / trainer.v1.<mode>

VERL_ROOT = Path(verl.__file__).parent

# Every place verl 0.9.1 reads ``trainer_mode`` or ``trainer.v1.*`` (found by scanning verl's source:
# the attributes ``trainer_mode`` / ``v1`` and config paths in strings), keyed by file, enclosing
# function and source line, with how the AMIR trainers handle it. Each AMIR trainer object answers its base
# mode (amir -> sync, amir_colocate_async -> colocate_async, amir_separate_async -> separate_async); the
# config keeps the AMIR name.
BASE = ("the trainer object reports its base mode: verl's behaviour for that schedule, which the AMIR class runs "
        "(test_each_amir_trainer_runs_on_its_base_modes_sections)")
INHERITED = ("inherited by the AMIR class on this base, which reads the base section as verl's own class does "
             "(test_each_amir_trainer_runs_on_its_base_modes_sections)")
TRAINER_MODE_READS = {
    ("trainer/main_ppo.py", "TaskRunnerV1.run", "trainer_cls = get_trainer_cls(config.trainer.v1.trainer_mode)"):
        "config 'amir*' -> the AMIR class on that base (test_verl_seams: registered through the plugin)",
    ("trainer/ppo/v1/trainer_base.py", "PPOTrainer.__init__",
     "self.trainer_mode = self.config.trainer.v1.trainer_mode"):
        "the setter accepts only the class's own AMIR name and ignores it",
    ("trainer/ppo/v1/trainer_base.py", "PPOTrainer.__init__",
     'self.parameter_sync_step = self.config.trainer.v1.get(self.trainer_mode, {}).get("parameter_sync_step", 1)'):
        "reads the base mode's section; must equal rollout_skip's read when the skip is on",
    ("trainer/ppo/v1/trainer_base.py", "PPOTrainer._build_replay_buffer",
     'sampler_cls = ReplayBuffer if self.trainer_mode == "sync" else ReplayBufferAsync'): BASE,
    ("trainer/ppo/v1/trainer_base.py", "PPOTrainer._build_replay_buffer",
     "sampler_config = self.config.trainer.v1.sampler"): "mode-independent section, used as is",
    ("trainer/ppo/v1/trainer_base.py", "PPOTrainer._build_replay_buffer",
     "trainer_config=self.config.trainer.v1.get(self.trainer_mode, {}),"): BASE,
    ("trainer/ppo/v1/trainer_base.py", "PPOTrainer._build_replay_buffer", "trainer_mode=self.trainer_mode,"):
        "the replay buffer gets the base mode (stored only, ReplayBuffer.__init__ below)",
    ("trainer/ppo/v1/replay_buffer.py", "ReplayBuffer.__init__", "self.trainer_mode = trainer_mode"):
        "stored, never read by ReplayBuffer",
    ("trainer/ppo/v1/trainer_base.py", "PPOTrainer._init_dataloader",
     'requires_exact_refill = self.trainer_mode != "sync" or dapo_enabled or sync_refill_failed_groups'): BASE,
    ("trainer/ppo/v1/trainer_base.py", "PPOTrainer._init_dataloader",
     'sync_refill_failed_groups = bool(self.config.trainer.v1.sampler.get("sync_refill_failed_groups", False))'):
        "mode-independent section, used as is",
    ("trainer/ppo/v1/trainer_base.py", "PPOTrainer._load_checkpoint", 'if self.trainer_mode != "sync":'):
        BASE + "; async: verl restores TransferQueue before AMIR restores lambda (AMIR's override calls super first)",
    ("trainer/ppo/v1/trainer_base.py", "PPOTrainer._reissue_inflight_prompts", 'if self.trainer_mode == "sync":'): BASE,
    ("trainer/ppo/v1/trainer_base.py", "PPOTrainer._save_checkpoint", 'if self.trainer_mode != "sync":'):
        BASE + "; amir_state.json is written before super(), whose tracker file comes last",
    ("trainer/ppo/v1/trainer_base.py", "PPOTrainer._submit_batch_to_rollout", 'if self.trainer_mode != "sync":'): BASE,
    ("trainer/ppo/v1/trainer_colocate_async.py", "PPOTrainerColocateAsync.on_train_begin",
     "self._add_async_warmup_batches(self.config.trainer.v1.colocate_async.num_warmup_batches)"): INHERITED,
    ("trainer/ppo/v1/trainer_separate_async.py", "PPOTrainerSeparateAsync.__init__",
     "parameter_sync_step = config.trainer.v1.separate_async.parameter_sync_step"):
        INHERITED + "; the same section as PPOTrainer.__init__'s read, as the trainer reports separate_async",
    ("trainer/ppo/v1/trainer_separate_async.py", "PPOTrainerSeparateAsync.__init__",
     "self.config.trainer.v1.separate_async.hybrid_rollout"): INHERITED,
    ("trainer/ppo/v1/trainer_separate_async.py", "PPOTrainerSeparateAsync.on_train_begin",
     "self._add_async_warmup_batches(self.config.trainer.v1.separate_async.num_warmup_batches)"): INHERITED,
    ("utils/skip/rollout_skip.py", "RolloutTqSkip.__init__",
     'f"trainer.v1.{global_config.trainer.v1.trainer_mode}.parameter_sync_step",'):
        "reads trainer.v1.<AMIR name> (the config's mode), default 1: with skip.rollout_tq.enable, validate_amir_run "
        "requires it to equal the base section's (test_parameter_sync_step_reads_agree_or_the_run_is_refused)",
}


def trainer_mode_read_sites() -> set[tuple[str, str, str]]:
    """(file, enclosing function, stripped line) of every ``trainer_mode`` / ``v1`` attribute and every
    config path string (no whitespace) naming ``trainer_mode`` or ``trainer.v1`` in verl's sources."""

    def names_a_mode(text: str) -> bool:
        return not any(c.isspace() for c in text) and ("trainer_mode" in text or "trainer.v1" in text)

    sites = set()
    for path in sorted(VERL_ROOT.rglob("*.py")):
        source = path.read_text()
        if "trainer_mode" not in source and "v1" not in source:
            continue
        lines = source.splitlines()

        def visit(node, scope):
            for child in ast.iter_child_nodes(node):
                inner = scope
                if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    inner = f"{scope}.{child.name}" if scope else child.name
                if isinstance(child, ast.JoinedStr):
                    text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in child.values)
                    hit = names_a_mode(text)
                else:
                    hit = ((isinstance(child, ast.Attribute) and child.attr in ("trainer_mode", "v1"))
                           or (isinstance(child, ast.Name) and child.id == "trainer_mode")
                           or (isinstance(child, ast.Constant) and isinstance(child.value, str)
                               and names_a_mode(child.value)))
                if hit:
                    sites.add((str(path.relative_to(VERL_ROOT)), scope, lines[child.lineno - 1].strip()))
                visit(child, inner)

        visit(ast.parse(source), "")
    return sites


def test_every_trainer_mode_read_in_verl_is_accounted_for():
    found = trainer_mode_read_sites()
    new = sorted(found - set(TRAINER_MODE_READS))
    gone = sorted(set(TRAINER_MODE_READS) - found)
    assert not new, f"verl reads trainer_mode / trainer.v1.* in places AMIR has not checked: {new}"
    assert not gone, f"these reads are no longer in verl (update the table): {gone}"


def amir_run(overrides, mode="amir"):
    return compose_verl(GRPO + [AMIR[0], f"trainer.v1.trainer_mode={mode}", "actor_rollout_ref.actor.use_kl_loss=True",
                                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"] + overrides)


# what verl's PPOTrainerSeparateAsync.__init__ asserts: train_batch_size = parameter_sync_step * mini-batch,
# a standalone rollout pool, a checkpoint engine other than naive
SEPARATE = ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1",
            "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl"]
MODES = {  # AMIR mode -> (its verl base class, overrides it needs, parameter_sync_step set in the base section)
    "amir": ("PPOTrainerSync", [], 2),
    "amir_colocate_async": ("PPOTrainerColocateAsync", [], 2),
    "amir_separate_async": ("PPOTrainerSeparateAsync", SEPARATE, 2),  # 8 = 2 x 4
}


@pytest.mark.parametrize("mode", list(MODES))
def test_each_amir_trainer_runs_on_its_base_modes_sections(mode):
    import verl.trainer.ppo.v1 as v1

    base_name, overrides, steps = MODES[mode]
    base = AMIR_TRAINER_MODES[mode]
    config = amir_run(overrides + [f"++trainer.v1.{base}.parameter_sync_step={steps}"], mode)
    cls = v1.get_trainer_cls(mode)
    assert cls.__mro__[1:3] == (AmirTrainerMixin, getattr(v1, base_name))
    assert v1.get_trainer_cls(base) is getattr(v1, base_name)  # verl's own mode name, its own class
    trainer = cls(config)  # verl's PPOTrainer.__init__ with the config's AMIR name
    assert trainer.trainer_mode == base
    assert trainer.parameter_sync_step == steps
    assert type(trainer.replay_buffer) is (ReplayBuffer if base == "sync" else ReplayBufferAsync)
    assert trainer.replay_buffer.trainer_config == config.trainer.v1[base]
    with pytest.raises(ValueError, match=f"trainer mode '{mode}'"):
        trainer.trainer_mode = base


def test_the_mode_table_names_every_amir_trainer():
    import verl.trainer.ppo.v1 as v1

    registered = {name: cls for name, cls in v1.trainer_base.TRAINER_REGISTRY.items()
                  if isinstance(cls, type) and issubclass(cls, AmirTrainerMixin)}
    assert {name: cls.BASE_MODE for name, cls in registered.items()} == AMIR_TRAINER_MODES
    assert all(cls.AMIR_MODE == name for name, cls in registered.items())


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("mode, overrides, trainer_reads, skip_reads", [
    ("amir", [], 1, 1),
    ("amir", ["+trainer.v1.sync.parameter_sync_step=2"], 2, 1),
    ("amir", ["+trainer.v1.amir.parameter_sync_step=3"], 1, 3),
    ("amir_colocate_async", [], 1, 1),
    ("amir_colocate_async", ["+trainer.v1.colocate_async.parameter_sync_step=2"], 2, 1),
    ("amir_separate_async", [], 4, 1),  # verl's default separate_async section: 4 local updates
    ("amir_separate_async", ["+trainer.v1.amir_separate_async.parameter_sync_step=4"], 4, 4),
])
def test_parameter_sync_step_reads_agree_or_the_run_is_refused(mode, overrides, trainer_reads, skip_reads, skip):
    config = amir_run(overrides + (["skip.rollout_tq.enable=True"] if skip else []), mode)
    base = AMIR_TRAINER_MODES[mode]
    assert config.trainer.v1.get(base, {}).get("parameter_sync_step", 1) == trainer_reads  # PPOTrainer's read
    assert RolloutTqSkip(config.skip.rollout_tq, config).parameter_sync_step == skip_reads
    if trainer_reads == skip_reads or not skip:  # the skip is the only reader of the AMIR section
        validate_amir_run(config)
    else:
        with pytest.raises(ValueError, match=rf"trainer\.v1\.{base}\.parameter_sync_step.*trainer\.v1\.{mode}\."):
            validate_amir_run(config)


# ------------------------------------------------------------ which LoRA key each part of verl reads

def test_fsdp_reads_lora_rank_while_the_trainer_also_reads_lora_dot_rank_so_the_mix_is_refused():
    """verl 0.9.1: the V1 trainer's ref_in_actor (reference = actor with adapters off) reads model.lora.rank
    first, while FSDPEngine decides LoRA from model.lora_rank alone. With only lora.rank set, an FSDP run
    would train full weights and ask the actor for an adapter it lacks: validate_amir_run refuses it."""
    import inspect

    from verl.trainer.ppo.utils import Role
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    def grpo_run(overrides):  # verl's own sync trainer, no AMIR
        return compose_verl(GRPO + ["actor_rollout_ref.actor.use_kl_loss=True",
                                    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"] + overrides)

    def roles(overrides):  # the worker roles verl's trainer plans (ref_in_actor: no separate reference role)
        trainer = PPOTrainerSync(grpo_run(overrides))
        trainer._init_resource_pool_mgr()
        return set(trainer.role_worker_mapping)

    assert roles([]) == {Role.ActorRolloutRef}
    assert roles(["actor_rollout_ref.model.lora.rank=16"]) == {Role.ActorRollout}
    assert roles(["actor_rollout_ref.model.lora_rank=16"]) == {Role.ActorRollout}
    assert "self._is_lora = self.model_config.lora_rank > 0" in inspect.getsource(FSDPEngine.__init__)

    megatron_key_only = amir_run(["actor_rollout_ref.model.lora.rank=16"])
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.model\.lora_rank=16"):
        validate_amir_run(megatron_key_only)
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.model\.lora_rank=16"):
        AmirPPOTrainer(megatron_key_only)
    for keys in (["actor_rollout_ref.model.lora_rank=16"],  # what the recipes set
                 ["actor_rollout_ref.model.lora.rank=16", "actor_rollout_ref.model.lora_rank=16"]):
        validate_amir_run(amir_run(keys))


@pytest.mark.parametrize("mode, overrides, expected", [
    ("amir", ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8"], None),  # exact: silent
    ("amir", ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4"],
     ["AMIR: 2 mini-batch(es) x 1 epoch(s) per step"]),
    ("amir_colocate_async", ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                             "++trainer.v1.colocate_async.parameter_sync_step=2"],
     ["2 local updates per step (colocate_async)", "the weights each local update starts from"]),
    ("amir_separate_async", SEPARATE + ["++trainer.v1.separate_async.parameter_sync_step=2"],
     ["2 local updates per step (separate_async)", "exact for local update 0",
                                       "anchored surrogate"]),
])
def test_the_start_line_states_the_schedules_semantics(mode, overrides, expected):
    from amir_verl.trainer import describe_update_semantics

    line = describe_update_semantics(amir_run(overrides, mode), AMIR_TRAINER_MODES[mode])
    if expected is None:
        assert line is None
    else:
        assert all(part in line for part in expected), line
        assert "mini-batch(es)" not in line or mode == "amir"  # one mini-batch per local update otherwise
