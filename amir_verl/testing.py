"""verl 0.9.1's actor update on one CPU process, for the tests and the benchmarks (no GPU, no Ray).

A step batch in the V1 actor layout (:class:`StepBatch`, :func:`make_step_batch`), a tiny random Qwen2
model, and :func:`run_actor_update`, which feeds the loss exactly as ``FSDPEngine.forward_backward_batch``
does on each data-parallel rank: the engine's batch values (:func:`assign_engine_batch_info`: tokens
counted on ``loss_mask`` over all ranks, ``dp_size``), verl's ``prepare_micro_batches`` split of the
rank's share (fixed size or dynamic), ``model_output["log_probs"]`` as a jagged tensor over
prompt+response tokens, one backward per micro-batch, and the rank gradients averaged as FSDP does.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
from tensordict import TensorDict
from transformers import Qwen2Config, Qwen2ForCausalLM

from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
from verl.utils import tensordict_utils as tu
from verl.workers.config import ActorConfig, PolicyLossConfig
from verl.workers.engine.utils import prepare_micro_batches

from amir_verl.config import AmirConfig
from amir_verl.step_batch import (
    EXTRA_LAMBDA,
    EXTRA_NUM_MINI_BATCHES,
    EXTRA_NUM_PAIRS,
    FIELD_PARTNER_SCORE,
    FIELD_PARTNER_SIGN,
    FIELD_REF_SEQ_LOGP,
    compute_step_fields,
)

VOCAB = 48


def tiny_model(seed: int = 0, dtype=torch.float64) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
    )
    config._attn_implementation = "eager"
    return Qwen2ForCausalLM(config).to(dtype)


def token_log_probs(model, input_ids: torch.Tensor) -> torch.Tensor:
    """(L,) verl's NO_PADDING convention: entry t is log p(input_ids[t+1] | input_ids[:t+1]); last is 0."""
    logits = model(input_ids=input_ids.unsqueeze(0)).logits[0]
    lp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, input_ids[1:].unsqueeze(-1)).squeeze(-1)
    return torch.cat([lp, lp.new_zeros(1)])


def nested(rows: list[torch.Tensor]) -> torch.Tensor:
    """A jagged nested tensor (verl's NO_PADDING layout); keeps the autograd graph of ``rows``."""
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


@dataclass
class StepBatch:
    """One step batch: per-sample python lists plus the actor TensorDict verl would hand the workers."""

    prompts: list[torch.Tensor]
    responses: list[torch.Tensor]
    rewards: torch.Tensor  # (N,)
    uids: list[str]
    keys: list[str]
    is_padding: list[bool]
    old_log_probs: list[torch.Tensor]  # per sample, response length
    ref_log_probs: list[torch.Tensor]
    advantages: list[torch.Tensor]
    # per sample, response length: 0 on tokens the loss must skip inside a response (the tool outputs of a
    # multi-turn agent loop, which verl's agent loop masks out of response_mask); None: every token counts
    masks: list[torch.Tensor] | None = None

    def __len__(self):
        return len(self.uids)

    def response_mask(self, i: int) -> torch.Tensor:
        if self.is_padding[i]:
            return torch.zeros(len(self.responses[i]))
        return self.masks[i].clone() if self.masks is not None else torch.ones(len(self.responses[i]))


def response_log_probs(model, prompt, response) -> torch.Tensor:
    ids = torch.cat([prompt, response])
    lp = token_log_probs(model, ids)
    return lp[len(prompt) - 1 : len(ids) - 1]


def make_step_batch(
    model, ref_model, group_sizes, *, seed=0, reward_values=(0.0, 0.25, 1.0, 1.1, 1.35), num_padding=0,
    empty_response_at=None, max_response=10, tool_outputs=False,
) -> StepBatch:
    """Random groups of ``group_sizes`` (one prompt each), old/ref log-probs from the two models, and
    GRPO advantages from verl's estimator; ``num_padding`` filler samples as verl's upsampling adds.
    ``tool_outputs``: a run of tokens inside each response of 4 or more tokens is a tool's output, mask 0 (as
    verl's tool agent loop leaves it), between the model's own tokens; the last token is always the model's."""
    rng = random.Random(seed)
    prompts, responses, rewards, uids, keys, pad = [], [], [], [], [], []
    for g, size in enumerate(group_sizes):
        uid = f"u{g:03d}x{rng.randrange(10**6)}"
        prompt = torch.tensor([rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 5))])
        constant = rng.choice(reward_values) if size > 2 and g % 4 == 3 else None  # some all-equal groups
        for s in range(size):
            prompts.append(prompt)
            responses.append(torch.tensor([rng.randrange(1, VOCAB) for _ in range(rng.randint(1, max_response))]))
            rewards.append(constant if constant is not None else rng.choice(reward_values))
            uids.append(uid)
            keys.append(f"{uid}_{s}_0")
            pad.append(False)
    if empty_response_at is not None:
        responses[empty_response_at] = torch.tensor([], dtype=torch.long)
    pad_uid = "pad0123"
    for s in range(num_padding):  # like verl's upsample_batch_to_divisible_size: one uid, 1-token responses
        prompts.append(prompts[0])
        responses.append(torch.tensor([1]))
        rewards.append(0.0)
        uids.append(pad_uid)
        keys.append(f"{pad_uid}_{s}_0")
        pad.append(True)
    masks = None
    if tool_outputs:
        masks = [torch.ones(len(r)) for r in responses]
        for mask in masks:
            if len(mask) >= 4:
                start = rng.randint(1, len(mask) - 3)
                mask[start : rng.randint(start + 1, len(mask) - 1)] = 0
    return complete_step_batch(model, ref_model, prompts, responses, rewards, uids, keys, pad, masks)


def complete_step_batch(model, ref_model, prompts, responses, rewards, uids, keys, pad, masks=None) -> StepBatch:
    """The :class:`StepBatch` of these samples: old log-probs from ``model`` (the weights the update starts
    from), reference log-probs from ``ref_model``, GRPO advantages from verl's estimator."""
    with torch.no_grad():
        old = [response_log_probs(model, p, r) for p, r in zip(prompts, responses)]
        ref = [response_log_probs(ref_model, p, r) for p, r in zip(prompts, responses)]
    rewards_t = torch.tensor(rewards, dtype=torch.float64)
    batch = StepBatch(prompts, responses, rewards_t, uids, keys, pad, old, ref, [], masks)
    # GRPO advantages with verl's estimator on the padded layout (reward on the last response token)
    width = max(1, max(len(r) for r in responses))
    mask = torch.zeros(len(uids), width)
    scores = torch.zeros(len(uids), width)
    for i in range(len(uids)):
        m = batch.response_mask(i)
        mask[i, : len(m)] = m
        if m.sum() > 0:
            scores[i, len(m) - 1] = rewards[i]
    adv, _ = compute_grpo_outcome_advantage(scores, mask, np.array(uids, dtype=object))
    batch.advantages = [adv[i, : len(responses[i])].to(torch.float64) for i in range(len(uids))]
    return batch


@torch.no_grad()
def sample_response(versions, prompt: torch.Tensor, segments: list[tuple[int, int]], generator: torch.Generator):
    """A response sampled token by token, segment ``(v, n)`` drawing ``n`` tokens from ``versions[v]`` given
    everything so far: a partial rollout resumed under other weights, as verl's async client makes one.

    Returns (response (T,), rollout log-probs (T,), each token's log-prob under the version that drew it,
    version index per token (T,)).
    """
    ids, logps, tags = prompt.clone(), [], []
    for version, length in segments:
        for _ in range(length):
            logits = versions[version](input_ids=ids.unsqueeze(0)).logits[0, -1].double()
            probs = torch.softmax(logits, dim=-1)
            token = torch.multinomial(probs, 1, generator=generator)
            logps.append(torch.log(probs[token]))
            tags.append(version)
            ids = torch.cat([ids, token])
    return ids[len(prompt):], torch.cat(logps), torch.tensor(tags)


def make_off_policy_step_batch(model, ref_model, versions, group_sizes, *, seed=0,
                               reward_values=(0.0, 0.25, 1.0, 1.1, 1.35)):
    """Groups whose responses were sampled by other policies than ``model``, as an async step batch holds:
    sample s of group g is drawn from ``versions[(g + s) % V]``, and every third is a partial rollout whose
    prefix comes from one version and whose suffix from the next.

    Returns the :class:`StepBatch` (its old log-probs are ``model``'s, as verl recomputes them), the rollout
    log-probs of each sample (per token, under the version that drew it), and each sample's version per token.
    """
    rng, generator = random.Random(seed), torch.Generator().manual_seed(seed)
    prompts, responses, rewards, uids, keys, rollout, tags = [], [], [], [], [], [], []
    for g, size in enumerate(group_sizes):
        uid = f"u{g:03d}x{rng.randrange(10**6)}"
        prompt = torch.tensor([rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 5))])
        for s in range(size):
            first, length = (g + s) % len(versions), rng.randint(2, 9)
            split = [(first, length // 2), ((first + 1) % len(versions), length - length // 2)]
            response, logp, tag = sample_response(versions, prompt, split if s % 3 == 2 else [(first, length)],
                                                  generator)
            prompts.append(prompt)
            responses.append(response)
            rollout.append(logp)
            tags.append(tag)
            rewards.append(rng.choice(reward_values))
            uids.append(uid)
            keys.append(f"{uid}_{s}_0")
    batch = complete_step_batch(model, ref_model, prompts, responses, rewards, uids, keys, [False] * len(uids))
    return batch, rollout, tags


def padded(rows: list[torch.Tensor], width: int | None = None) -> torch.Tensor:
    """(len(rows), width) right-padded with zeros; width defaults to the longest row (at least 1)."""
    width = width if width is not None else max(1, max(len(r) for r in rows))
    out = torch.zeros(len(rows), width, dtype=rows[0].dtype if rows else torch.float64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def amir_step_fields(batch: StepBatch, amir: AmirConfig):
    masks = [batch.response_mask(i) for i in range(len(batch))]
    return compute_step_fields(
        amir,
        sequence_rewards=batch.rewards,
        uids=batch.uids,
        response_mask=padded(masks),
        old_log_probs=padded(batch.old_log_probs, padded(masks).shape[1]),
        ref_log_probs=padded(batch.ref_log_probs, padded(masks).shape[1]),
        sample_keys=batch.keys,
        is_padding=batch.is_padding,
    )


def actor_tensordict(batch: StepBatch, order: list[int], fields=None, extra: dict | None = None) -> TensorDict:
    """The actor's view of samples ``order`` (V1: nested per-sample tensors, uid as NonTensorStack).

    ``loss_mask`` is the ``response_mask``, as verl's agent loop (``agent_loop_tq``) and its padding
    samples (``padding_utils``) store it; the engine counts the batch's tokens on it.
    """
    response_mask = nested([batch.response_mask(i).long() for i in order])
    tensors = {
        "prompts": nested([batch.prompts[i] for i in order]),
        "responses": nested([batch.responses[i] for i in order]),
        "input_ids": nested([torch.cat([batch.prompts[i], batch.responses[i]]) for i in order]),
        "response_mask": response_mask,
        "loss_mask": response_mask,
        "old_log_probs": nested([batch.old_log_probs[i] for i in order]),
        "ref_log_prob": nested([batch.ref_log_probs[i] for i in order]),
        "advantages": nested([batch.advantages[i] for i in order]),
        "uid": [batch.uids[i] for i in order],
    }
    if fields is not None:
        tensors[FIELD_REF_SEQ_LOGP] = fields.ref_seq_logp[order]
        tensors[FIELD_PARTNER_SCORE] = fields.partner_score[order]
        tensors[FIELD_PARTNER_SIGN] = fields.partner_sign[order]
    return tu.get_tensordict(tensor_dict=tensors, non_tensor_dict=extra or {})


def actor_config(loss_mode="vanilla", loss_agg_mode="token-mean", kl_coef=0.001, micro=2, mini=8,
                 loss_scale_factor=None, **policy_loss) -> ActorConfig:
    """verl's actor config; ``amir_ppo_loss`` takes the one of the BASE loss mode."""
    gspo = loss_mode.endswith("gspo")
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_mini_batch_size=mini,
        ppo_micro_batch_size_per_gpu=micro,
        use_kl_loss=kl_coef is not None,
        kl_loss_coef=kl_coef or 0.0,
        kl_loss_type="low_var_kl",
        loss_agg_mode=loss_agg_mode,
        loss_scale_factor=loss_scale_factor,
        clip_ratio_low=3e-4 if gspo else 0.2,
        clip_ratio_high=4e-4 if gspo else 0.28,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode, **policy_loss),
    )


@dataclass
class Layout:
    """How the step batch reaches the loss: a permutation, ``dp`` contiguous rank shares, micro-batches."""

    dp: int
    micro_batch_size: int | None = None  # fixed-size micro-batches
    max_token_len: int | None = None  # dynamic batch size (verl's rearrange_micro_batches)
    seed: int = 0


def assign_engine_batch_info(rank_shares: list[TensorDict], global_batch_size: int) -> None:
    """Set on each rank's share of one mini-batch the values ``FSDPEngine.forward_backward_batch`` sets.

    ``batch_num_tokens``: the sum of ``loss_mask`` over every rank's share (the engine all-reduces each
    rank's sum over the data-parallel group); ``dp_size``: the number of shares. ``global_batch_size``
    (sequences of the mini-batch) is what the actor's ``_update_actor`` passes; verl's loss reads all
    three through ``global_batch_info``.
    """
    batch_num_tokens = int(sum(int(share["loss_mask"].sum()) for share in rank_shares))
    for share in rank_shares:
        tu.assign_non_tensor(share, batch_num_tokens=batch_num_tokens, dp_size=len(rank_shares),
                             global_batch_size=global_batch_size)


def run_actor_update(model, batch: StepBatch, loss_fn, layout: Layout, extra: dict, fields=None, from_store=None):
    """Accumulate the update's gradient on ``model`` exactly as the ranks' FSDP average would.

    The actor data is built from ``batch`` (plus ``fields``), or taken from ``from_store``: the
    TensorDict TransferQueue returns for the batch's keys. Returns (loss, metrics) per micro-batch.
    """
    n = len(batch)
    assert n % layout.dp == 0
    order = list(range(n))
    random.Random(layout.seed).shuffle(order)
    share = n // layout.dp
    rank_shares = []
    for rank in range(layout.dp):
        rank_order = order[rank * share : (rank + 1) * share]
        if from_store is not None:
            td = tu.index_select_tensor_dict(from_store, rank_order)
            tu.assign_non_tensor(td, **extra)
        else:
            td = actor_tensordict(batch, rank_order, fields, extra)
        if layout.max_token_len is not None:
            tu.assign_non_tensor(td, use_dynamic_bsz=True, max_token_len_per_gpu=layout.max_token_len)
        else:
            tu.assign_non_tensor(td, use_dynamic_bsz=False, micro_batch_size_per_gpu=layout.micro_batch_size)
        rank_shares.append(td)
    assign_engine_batch_info(rank_shares, global_batch_size=n)
    outputs = []
    for td in rank_shares:
        micro_batches, _ = prepare_micro_batches(td)
        for mb in micro_batches:
            ids = mb["input_ids"].unbind()
            log_probs = nested([token_log_probs(model, x) for x in ids])
            loss, metrics = loss_fn(model_output={"log_probs": log_probs}, data=mb)
            (loss / layout.dp).backward()  # FSDP averages gradients over data-parallel ranks
            outputs.append((loss.detach(), metrics))
    return outputs


def brute_force_pref_objective(model, ref_model_logps, batch: StepBatch, amir: AmirConfig,
                               frozen_partner_log_probs: list[torch.Tensor] | None = None) -> torch.Tensor:
    """J_pref by the definition: python loops over groups and ordered pairs, l_theta with the graph.

    With ``frozen_partner_log_probs`` (per sample, response length), the anchored surrogate instead: each pair
    adds one term with its preferred member live and its rejected one frozen at those log-probs, and one the
    other way round, so that its gradient is each member's pull against its partner's frozen score.
    """
    l_theta, l_frozen, l_ref = {}, {}, {}
    for i in range(len(batch)):
        m = batch.response_mask(i).to(torch.float64)
        if m.sum() == 0:
            continue
        # the model's own tokens only: a masked (tool output) token is neither summed nor counted in |o|
        lp = response_log_probs(model, batch.prompts[i], batch.responses[i])
        l_theta[i] = (lp * m).sum() / m.sum()
        if frozen_partner_log_probs is not None:
            l_frozen[i] = float((frozen_partner_log_probs[i] * m).sum() / m.sum())
        l_ref[i] = 0.0 if amir.reference_free else float((ref_model_logps[i] * m).sum() / m.sum())
    terms = []
    for i in l_theta:
        for j in l_theta:
            if i == j or batch.uids[i] != batch.uids[j] or batch.is_padding[i] or batch.is_padding[j]:
                continue
            if float(batch.rewards[i]) - float(batch.rewards[j]) > amir.delta_r:
                if frozen_partner_log_probs is None:
                    margins = [(l_theta[i] - l_ref[i]) - (l_theta[j] - l_ref[j])]
                else:
                    margins = [(l_theta[i] - l_ref[i]) - (l_frozen[j] - l_ref[j]),
                               (l_frozen[i] - l_ref[i]) - (l_theta[j] - l_ref[j])]
                terms.extend(torch.nn.functional.logsigmoid(amir.beta_dpo * z) for z in margins)
    if not terms:
        return torch.zeros((), dtype=torch.float64)
    pairs = len(terms) if frozen_partner_log_probs is None else len(terms) // 2
    return torch.stack(terms).sum() / pairs


def extra_info_for(fields, lambda_reg: float, mini_batches: int = 1) -> dict:
    """verl's batch ``extra_info`` as the AMIR trainer sets it (default: one mini-batch, the whole batch)."""
    return {EXTRA_LAMBDA: lambda_reg, EXTRA_NUM_PAIRS: fields.num_pairs, EXTRA_NUM_MINI_BATCHES: mini_batches}


def plain_metrics(metrics: dict) -> dict:
    """verl metrics (floats or ``Metric`` objects) as comparable python values."""
    from verl.utils.metric import Metric

    def plain(v):
        if isinstance(v, Metric):
            return (v.aggregation, [plain(x) for x in v.values])
        return float(v.detach()) if isinstance(v, torch.Tensor) else v

    return {k: plain(v) for k, v in metrics.items()}


def grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
