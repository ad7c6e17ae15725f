"""The driver half of the glue on verl's real V1 data path: Ray + TransferQueue, no model workers.

``AmirPPOTrainer._compute_advantage`` runs verl's own advantage step, then mines the step's pairs and
stores the AMIR fields in TransferQueue. The actor batch is then read back from TransferQueue the way
the workers' ``tqbridge`` reads it, split across ranks and micro-batches, and the gradient of the
shipped loss is compared with brute-force autograd, as in ``test_exactness.py``.
"""

from functools import partial

import pytest
import ray
import torch
import transfer_queue as tq
from omegaconf import OmegaConf
from tensordict import TensorDict
from transfer_queue import KVBatchMeta

from amir_verl.actor_loss import amir_ppo_loss
from amir_verl.step_batch import (
    EXTRA_LAMBDA,
    EXTRA_NUM_MINI_BATCHES,
    EXTRA_NUM_PAIRS,
    FIELD_PARTNER_SCORE,
    FIELD_PARTNER_SIGN,
    FIELD_REF_SEQ_LOGP,
)
from amir_verl.trainer import AmirPPOTrainer
from tests.support import GRPO, compose_verl, start_local_ray
from tests.support import brute_force_gradient
from amir_verl.testing import (
    Layout,
    actor_config,
    actor_tensordict,
    assign_engine_batch_info,
    brute_force_pref_objective,
    grads,
    make_off_policy_step_batch,
    make_step_batch,
    nested,
    padded,
    response_log_probs,
    run_actor_update,
    tiny_model,
    token_log_probs,
)
from amir_verl.metrics import GRAD_SHARE, GROUPS_WITHOUT_PAIRS, LAMBDA, NUM_PAIRS, PG_GRAD_NORM, PREF_GRAD_NORM, PREF_LOSS
from verl.utils import tensordict_utils as tu
from verl.workers.utils.losses import ppo_loss

FIXED_LAMBDA = 0.5


@pytest.fixture(scope="module")
def transfer_queue():
    start_local_ray(num_cpus=8)
    config = compose_verl(GRPO)
    tq_conf = config.transfer_queue
    tq_conf.backend.SimpleStorage.num_data_storage_units = 1
    tq.init(tq_conf)
    yield
    tq.close()
    ray.shutdown()


def make_trainer(overrides):
    config = compose_verl(
        GRPO
        + ["actor_rollout_ref.actor.policy_loss.loss_mode=amir_grpo", "trainer.v1.trainer_mode=amir",
           "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.rollout.n=1",
           "actor_rollout_ref.actor.ppo_mini_batch_size=24", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
           "+amir.lambda_rule=fixed", f"+amir.lambda_init={FIXED_LAMBDA}"]
        + overrides
    )
    OmegaConf.resolve(config)
    # PPOTrainer.__init__ builds a replay buffer and dataloader state that need rollout servers; the
    # advantage step only reads self.config, so construct the object without them.
    trainer = AmirPPOTrainer.__new__(AmirPPOTrainer)
    trainer.config = config
    trainer.init_amir_state(config)
    trainer.local_trigger_step = 0  # PPOTrainer.__init__'s: the first local update of the step
    return trainer


def put_step_batch(batch, partition, rollout_log_probs=None):
    """What the rollout, old-log-prob and ref steps leave in TransferQueue for one step batch; with
    ``rollout_log_probs`` (one row per sample), also the rollout engine's log-probs."""
    n = len(batch)
    rm_scores = []
    for i in range(n):
        s = torch.zeros(len(batch.responses[i]))
        if batch.response_mask(i).sum() > 0:
            s[-1] = float(batch.rewards[i])
        rm_scores.append(s)
    fields = tu.get_tensordict(
        {
            "prompts": nested(batch.prompts),
            "responses": nested(batch.responses),
            "input_ids": nested([torch.cat([p, r]) for p, r in zip(batch.prompts, batch.responses)]),
            "response_mask": nested([batch.response_mask(i).long() for i in range(n)]),
            "loss_mask": nested([batch.response_mask(i).long() for i in range(n)]),  # as verl's agent loop
            "rm_scores": nested(rm_scores),
            "old_log_probs": nested(batch.old_log_probs),
            "ref_log_prob": nested(batch.ref_log_probs),
            "uid": list(batch.uids),
            **({} if rollout_log_probs is None else {"rollout_log_probs": nested(rollout_log_probs)}),
        }
    )
    tags = [{"is_padding": p} for p in batch.is_padding]
    tq.kv_batch_put(keys=batch.keys, partition_id=partition, fields=fields, tags=tags)
    return KVBatchMeta(keys=list(batch.keys), tags=tags, partition_id=partition)


@pytest.mark.parametrize("reference", ["ref", "ref_free"])
def test_compute_advantage_then_actor_update_is_exact(transfer_queue, reference):
    model, ref_model = tiny_model(seed=0), tiny_model(seed=1)
    batch = make_step_batch(model, ref_model, [6, 1, 5, 4, 4], seed=11, num_padding=4, empty_response_at=3)
    meta = put_step_batch(batch, partition=f"train_{reference}")
    trainer = make_trainer([f"+amir.reference={reference}", "+amir.beta_dpo=0.5"])

    metrics = {}
    meta = trainer._compute_advantage(meta, metrics)

    assert metrics[LAMBDA] == FIXED_LAMBDA
    assert metrics[NUM_PAIRS] > 0
    assert metrics[GROUPS_WITHOUT_PAIRS] >= 1  # the group of one
    extra = meta.extra_info
    assert (extra[EXTRA_LAMBDA], extra[EXTRA_NUM_PAIRS], extra[EXTRA_NUM_MINI_BATCHES]) == (
        FIXED_LAMBDA, metrics[NUM_PAIRS], 1)
    assert metrics[PG_GRAD_NORM] > 0 and metrics[PREF_GRAD_NORM] > 0
    assert metrics[GRAD_SHARE] == pytest.approx(
        metrics[PREF_GRAD_NORM] / (metrics[PG_GRAD_NORM] + metrics[PREF_GRAD_NORM]))
    # the workers' view (verl's tqbridge): the fields the returned meta lists, plus its extra_info
    assert FIELD_PARTNER_SCORE in meta.fields and "advantages" in meta.fields
    actor_batch = tq.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id, select_fields=meta.fields)
    expected, j_pref, _ = brute_force_gradient(model, batch, trainer.amir, actor_config("vanilla"), FIXED_LAMBDA)
    assert metrics[PREF_LOSS] == pytest.approx(-float(j_pref), rel=1e-6)

    loss_fn = partial(amir_ppo_loss, config=actor_config("vanilla"), beta_dpo=0.5)
    model.zero_grad()
    run_actor_update(
        model, batch, loss_fn, Layout(dp=2, micro_batch_size=3, seed=4), dict(meta.extra_info),
        from_store=actor_batch,
    )
    # TransferQueue keeps the AMIR fields in float32: agreement to float32 precision
    for a, e in zip(grads(model), expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-6)


def test_lambda_measurement_applies_verls_importance_weights(transfer_queue):
    """With algorithm.rollout_correction.rollout_is=token, verl's _compute_advantage stores truncated IS
    weights min(exp(old - rollout), 2) that the actor's loss multiplies into the policy-gradient term; the
    driver's pg_grad_norm (and with it grad_share, the lambda rule's input) is that loss's gradient norm.
    Brute force: vanilla token-mean at ratio 1 has gradient -A_t * w_t / (number of tokens) per token."""
    model, ref_model, behaviour = tiny_model(seed=0), tiny_model(seed=1), tiny_model(seed=2)
    batch = make_step_batch(model, ref_model, [6, 5, 4, 4, 5], seed=12)
    with torch.no_grad():
        rollout = [response_log_probs(behaviour, p, r) for p, r in zip(batch.prompts, batch.responses)]
    rollout[0] = rollout[0] - 1.0  # weights above verl's threshold 2: truncated
    meta = put_step_batch(batch, partition="train_is", rollout_log_probs=rollout)
    trainer = make_trainer(["algorithm.rollout_correction.rollout_is=token"])

    metrics = {}
    meta = trainer._compute_advantage(meta, metrics)

    stored = tq.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id,
                             select_fields=["advantages", "rollout_is_weights"])
    assert "rollout_is_weights" in meta.fields  # what the actor's ppo_loss will apply
    mask = padded([batch.response_mask(i) for i in range(len(batch))]).double()
    width = mask.shape[1]
    weights = (padded(batch.old_log_probs, width) - padded(rollout, width)).exp().clamp(max=2.0) * mask
    assert float((((weights - 1).abs() > 0.1) & mask.bool()).double().sum()) > 10 and float(weights.max()) == 2.0
    torch.testing.assert_close(stored["rollout_is_weights"].to_padded_tensor(0.0).double() * mask, weights,
                               rtol=1e-5, atol=1e-6)
    advantages = stored["advantages"].to_padded_tensor(0.0).double() * mask
    with_weights = float((advantages * weights).norm() / mask.sum())
    without_weights = float(advantages.norm() / mask.sum())
    assert metrics[PG_GRAD_NORM] == pytest.approx(with_weights, rel=1e-5)
    assert without_weights != pytest.approx(with_weights, rel=1e-2)
    assert metrics[GRAD_SHARE] == pytest.approx(
        metrics[PREF_GRAD_NORM] / (with_weights + metrics[PREF_GRAD_NORM]), rel=1e-5)


# ---------------------------------------------------------------- off-policy step batches (async schedules)


@pytest.fixture(scope="module")
def off_policy():
    """The current weights, the reference, and a step batch sampled by two other versions (some responses
    spliced from both), as verl's async trainers hand ``_compute_advantage`` one."""
    model, ref_model, versions = tiny_model(seed=0), tiny_model(seed=1), [tiny_model(seed=3), tiny_model(seed=4)]
    batch, rollout, tags = make_off_policy_step_batch(model, ref_model, versions, [6, 5, 4, 4, 5], seed=21)
    return model, batch, rollout, tags


def brute_force_weighted_gradient(model, batch, weights, amir, config, lambda_reg):
    """Autograd of verl's ppo_loss (base mode, whole batch, with the IS weights) + lambda * (-J_pref)."""
    order = list(range(len(batch)))
    td = actor_tensordict(batch, order)
    td["rollout_is_weights"] = nested(weights)
    assign_engine_batch_info([td], global_batch_size=len(batch))
    model.zero_grad()
    log_probs = nested([token_log_probs(model, x) for x in td["input_ids"].unbind()])
    base_loss, _ = ppo_loss(config, {"log_probs": log_probs}, td)
    j_pref = brute_force_pref_objective(model, batch.ref_log_probs, batch, amir)
    (base_loss + lambda_reg * (-j_pref)).backward()
    return grads(model), float(j_pref)


OFF_POLICY_LAYOUTS = [
    pytest.param(Layout(dp=1, micro_batch_size=24), id="dp1-one-micro-batch"),
    pytest.param(Layout(dp=2, micro_batch_size=3, seed=4), id="dp2-micro3"),
    pytest.param(Layout(dp=3, max_token_len=30, seed=7), id="dp3-dynamic-bsz"),
]


@pytest.mark.parametrize("layout", OFF_POLICY_LAYOUTS)
def test_an_off_policy_batch_gives_the_exact_gradient_at_the_current_weights(transfer_queue, off_policy, layout):
    """Responses from two other policies, some spliced from both (partial rollouts across a weight sync),
    old_log_probs recomputed at the current weights as verl's async trainers do: the update through
    _compute_advantage and amir_ppo_loss is the gradient of pg_IS + lambda * (-J_pref) at those weights."""
    model, batch, rollout, tags = off_policy
    assert any(int(t.min()) != int(t.max()) for t in tags) and len({int(t[0]) for t in tags}) == 2
    partition = f"off_policy_{layout.dp}_{layout.seed}"
    meta = put_step_batch(batch, partition=partition, rollout_log_probs=rollout)
    trainer = make_trainer(["algorithm.rollout_correction.rollout_is=token", "+amir.beta_dpo=0.5"])
    metrics = {}
    meta = trainer._compute_advantage(meta, metrics)
    assert metrics[NUM_PAIRS] > 0

    weights = [(old - r).exp().clamp(max=2.0) for old, r in zip(batch.old_log_probs, rollout)]  # verl's "token" TIS
    assert max(float((w - 1).abs().max()) for w in weights) > 0.3
    expected, j_pref = brute_force_weighted_gradient(model, batch, weights, trainer.amir, actor_config("vanilla"),
                                                     FIXED_LAMBDA)
    assert metrics[PREF_LOSS] == pytest.approx(-j_pref, rel=1e-6)
    actor_batch = tq.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id, select_fields=meta.fields)
    model.zero_grad()
    run_actor_update(model, batch, partial(amir_ppo_loss, config=actor_config("vanilla"), beta_dpo=0.5),
                     layout, dict(meta.extra_info), from_store=actor_batch)
    for a, e in zip(grads(model), expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-6)


def test_which_policy_generated_a_batch_changes_only_the_policy_gradients_weights(transfer_queue, off_policy):
    """The same tokens, once with the other versions' rollout log-probs and once as if the current weights
    had sampled them: the pairs, the preference loss and every AMIR field agree; only pg_grad_norm moves."""
    model, batch, rollout, _ = off_policy
    runs = {}
    for name, rollout_log_probs in (("off", rollout), ("on", batch.old_log_probs)):
        meta = put_step_batch(batch, partition=f"generator_{name}", rollout_log_probs=rollout_log_probs)
        metrics = {}
        meta = make_trainer(["algorithm.rollout_correction.rollout_is=token"])._compute_advantage(meta, metrics)
        fields = tq.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id,
                                 select_fields=[FIELD_PARTNER_SCORE, FIELD_PARTNER_SIGN, FIELD_REF_SEQ_LOGP])
        runs[name] = metrics, {k: v.to_padded_tensor(0.0) if v.is_nested else v for k, v in fields.items()}
    (off, off_fields), (on, on_fields) = runs["off"], runs["on"]
    for key in (NUM_PAIRS, PREF_LOSS, PREF_GRAD_NORM):
        assert off[key] == on[key], key
    for key in off_fields.keys():
        assert torch.equal(off_fields[key], on_fields[key]), key
    assert off[PG_GRAD_NORM] != pytest.approx(on[PG_GRAD_NORM], rel=1e-3)


def test_no_reference_in_store_fails_clearly(transfer_queue):
    model, ref_model = tiny_model(seed=0), tiny_model(seed=1)
    batch = make_step_batch(model, ref_model, [3, 3], seed=2)
    meta = put_step_batch(batch, partition="train_noref")
    tq.kv_clear(keys=meta.keys, partition_id=meta.partition_id)
    fields = tu.get_tensordict(
        {
            "response_mask": nested([batch.response_mask(i).long() for i in range(len(batch))]),
            "rm_scores": nested([torch.zeros(len(r)) for r in batch.responses]),
            "old_log_probs": nested(batch.old_log_probs),
            "uid": list(batch.uids),
        }
    )
    tq.kv_batch_put(keys=meta.keys, partition_id=meta.partition_id, fields=fields, tags=meta.tags)
    trainer = make_trainer([])
    with pytest.raises(RuntimeError, match="ref_log_prob"):
        trainer._compute_advantage(meta, {})


def test_fields_survive_the_store_as_dense_rows(transfer_queue):
    n, w = 5, 3
    keys = [f"k{i}_0_0" for i in range(n)]
    value = torch.arange(n * w, dtype=torch.float32).reshape(n, w)
    tq.kv_batch_put(keys=keys, partition_id="shape", fields=TensorDict({"x": value}, batch_size=n), tags=[{}] * n)
    back = tq.kv_batch_get(keys=keys, partition_id="shape")["x"]
    back = back.to_padded_tensor(0.0) if back.is_nested else back
    assert torch.equal(back, value)
