"""AMIR's loss on a GPU (or the CPU): exactness under bf16, FSDP1/FSDP2 and LoRA, and its cost (issue 24, item 6).

Needs only torch and transformers (peft for the LoRA rows, skipped with a reason without it); no verl, ray
or vllm, nothing downloaded: the model is a randomly initialised Qwen2ForCausalLM built from a config in
code. It imports only the project's pure-torch modules (``amir_verl.preference``, ``step_batch``,
``lambda_control``, ``config``) and the pure-Python ``results_page``, loaded without running
``amir_verl/__init__.py``, and fails if any of verl, ray or vllm ends up imported.

What it checks, for one on-policy update (one mini-batch, one epoch), the exact case of the project's claim:
the gradient accumulated over a split of the step batch into simulated data-parallel ranks and micro-batches,
each micro-batch's loss normalised as verl's actor normalises it, equals the gradient of
``pg_loss + lambda * (-J_pref)`` over the whole batch in one piece, J_pref by its definition (python loops
over the ordered pairs of each group). The split side uses the shipped pieces: the driver's step fields
(``compute_step_fields``, run on the check's device), lambda from the ``grad_share`` controller fed by
``gradient_signal``, and per micro-batch the actor's share (``length_normalised_log_probs``,
``pair_log_likelihood_per_sequence``, ``preference_loss_share`` with ``preference_term_weight``).

The normalisation is verl's (``FSDPEngine`` + ``ppo_loss`` + ``agg_loss``, as amir_verl/testing.py replays
it and tests/test_exactness.py checks it): on each rank, each micro-batch's base loss is
``masked_sum(loss) / batch_num_tokens * dp_size`` with ``batch_num_tokens`` the response tokens of the whole
mini-batch over all ranks; the AMIR share has weight ``lambda * M * dp / P``; every micro-batch calls
backward on its loss, gradients add up over micro-batches, and FSDP averages them over the ranks (here: each
loss is divided by dp). The base loss is the clipped surrogate of verl's ``vanilla`` mode (PPO, dual clip
3.0, clip 0.2 / 0.28) with ``token-mean``, written here from its definition, since verl is not installed.

Both sides of each comparison run under the same precision (the same autocast, the same FSDP mixed
precision, fp32 master weights and gradients), so the difference measures the split, not bf16 against
fp32. The figure is the largest, over the trainable parameter tensors, of ||g_split - g_whole|| /
||g_whole||. A control row drops the dp factor from the term's weight: the check must see it.

    python benchmarks/gpu_check.py                 # on a GPU: the GPU size; under 5 minutes on one GPU
    python benchmarks/gpu_check.py --device cpu    # seconds, a smaller size
    ... --record                                   # also writes its output to docs/results/gpu_check_<gpu|cpu>.md

Exit status 1 when an exactness row fails its tolerance, the control goes unseen, or a row errors.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import socket
import statistics
import sys
import time
import types
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

START = time.perf_counter()  # before torch and transformers load: the wall time printed includes them

import torch
import torch.nn.functional as F
import transformers
from transformers import Qwen2Config, Qwen2ForCausalLM

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = ("verl", "ray", "vllm")
PURE_MODULES = ("lambda_control", "preference", "config", "step_batch", "results_page")

# Tolerances on the max relative gradient difference (split against whole batch, same precision).
# fp32: only summation order differs (micro-batch shapes, padding widths): ~1e-6 measured.
# bf16: the two sides round their bf16 activations differently (other shapes, other kernels) and the
# on-policy partners are the whole-batch forward's bf16 log-probs: ~1e-3..1e-2 measured
# (docs/results/gpu_check_cpu.md).
TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2}
CLIP_LOW, CLIP_HIGH, DUAL_CLIP = 0.2, 0.28, 3.0  # verl's defaults for vanilla
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def load_pure_modules() -> dict[str, types.ModuleType]:
    """The project's pure-torch modules, imported from this checkout without ``amir_verl/__init__.py``.

    The package is entered as a bare namespace module (its ``__path__`` only), so whatever the package's
    ``__init__`` may import one day (verl, for the plugin) never runs here; the submodules themselves
    import only torch, numpy and each other, which the check below enforces.
    """
    if "amir_verl" not in sys.modules:
        package = types.ModuleType("amir_verl")
        package.__path__ = [str(ROOT / "amir_verl")]
        package.__package__ = "amir_verl"
        sys.modules["amir_verl"] = package
    modules = {name: importlib.import_module(f"amir_verl.{name}") for name in PURE_MODULES}
    assert_no_forbidden_imports()
    return modules


def assert_no_forbidden_imports() -> None:
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in FORBIDDEN)
    if leaked:
        raise SystemExit(f"gpu_check must not import {FORBIDDEN}, but these are imported: {leaked[:8]}")


AMIR = load_pure_modules()
AmirConfig = AMIR["config"].AmirConfig
pref = AMIR["preference"]
step_batch = AMIR["step_batch"]


@dataclass(frozen=True)
class Size:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    groups: int
    group_size: int
    prompt: tuple[int, int]
    response: tuple[int, int]
    dp: int
    micro: int
    repeats: int


SIZES = {
    "small": Size(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, groups=6, group_size=4,
                  prompt=(3, 8), response=(2, 16), dp=2, micro=3, repeats=7),
    "gpu": Size(vocab=16384, hidden=512, layers=4, heads=8, kv_heads=2, intermediate=1536, groups=16, group_size=8,
                prompt=(16, 64), response=(16, 256), dp=4, micro=4, repeats=5),
}
REWARD_VALUES = (0.0, 0.25, 1.0, 1.35)


@dataclass
class Batch:
    """A step batch laid out for a plain HF forward: prompt + response, right-padded."""

    ids: torch.Tensor  # (N, L)
    attention: torch.Tensor  # (N, L)
    prompt_len: torch.Tensor  # (N,)
    response_len: torch.Tensor  # (N,)
    response_mask: torch.Tensor  # (N, R) float32
    rewards: torch.Tensor  # (N,) float32
    advantages: torch.Tensor  # (N, R) float32
    uids: list[str]
    keys: list[str]

    def __len__(self) -> int:
        return len(self.uids)


def make_batch(size: Size, device: torch.device, seed: int) -> Batch:
    gen = torch.Generator().manual_seed(seed)

    def randint(lo, hi):
        return int(torch.randint(lo, hi + 1, (), generator=gen))

    prompts, responses, rewards, uids, keys = [], [], [], [], []
    for g in range(size.groups):
        prompt = torch.randint(1, size.vocab, (randint(*size.prompt),), generator=gen)
        constant = REWARD_VALUES[g % len(REWARD_VALUES)] if g % 5 == 4 else None  # a group without pairs
        for s in range(size.group_size):
            prompts.append(prompt)
            responses.append(torch.randint(1, size.vocab, (randint(*size.response),), generator=gen))
            reward = constant if constant is not None else REWARD_VALUES[randint(0, len(REWARD_VALUES) - 1)]
            rewards.append(reward)
            uids.append(f"g{g:03d}")
            keys.append(f"g{g:03d}_{s}_0")
    n = len(uids)
    prompt_len = torch.tensor([len(p) for p in prompts])
    response_len = torch.tensor([len(r) for r in responses])
    width, resp_width = int((prompt_len + response_len).max()), int(response_len.max())
    ids = torch.zeros(n, width, dtype=torch.long)
    attention = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, resp_width)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, : len(p) + len(r)] = torch.cat([p, r])
        attention[i, : len(p) + len(r)] = 1
        mask[i, : len(r)] = 1
    rewards_t = torch.tensor(rewards)
    advantages = torch.zeros(n)
    for uid in sorted(set(uids)):  # GRPO: (r - mean) / (std + eps) inside the group, std unbiased
        rows = torch.tensor([i for i, u in enumerate(uids) if u == uid])
        r = rewards_t[rows]
        advantages[rows] = (r - r.mean()) / (r.std() + 1e-6)
    return Batch(ids.to(device), attention.to(device), prompt_len.to(device), response_len.to(device),
                 mask.to(device), rewards_t.to(device), (advantages[:, None] * mask).to(device), uids, keys)


@dataclass(frozen=True)
class Precision:
    name: str  # "fp32" or "bf16"
    device_type: str

    def autocast(self):
        if self.name == "bf16":
            return torch.autocast(self.device_type, dtype=torch.bfloat16)
        return contextlib.nullcontext()


def build_model(size: Size, device: torch.device, seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.intermediate,
        num_hidden_layers=size.layers, num_attention_heads=size.heads, num_key_value_heads=size.kv_heads,
        max_position_embeddings=1024, tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa",
    )
    model = Qwen2ForCausalLM(config).to(device)  # fp32 master weights
    model.train()
    return model


def add_lora(model, seed: int):
    """A LoRA r16 adapter (alpha 16) on every projection; B drawn at random (a trained adapter's B is non-zero,
    and at B = 0 every lora_A gradient would be exactly 0)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    return model


def response_log_probs(model, batch: Batch, rows: torch.Tensor, precision: Precision):
    """(B, R) log-probs of the response tokens of ``rows`` (trimmed to their own widths) and the (B, R) mask."""
    p, r = batch.prompt_len[rows], batch.response_len[rows]
    width, resp_width = int((p + r).max()), int(r.max())
    ids, attention = batch.ids[rows, :width], batch.attention[rows, :width]
    with precision.autocast():
        logits = model(input_ids=ids, attention_mask=attention).logits
    t = torch.arange(resp_width, device=ids.device)
    mask = (t[None] < r[:, None]).to(torch.float32)
    position = ((p - 1)[:, None] + t[None]).clamp(max=width - 2)  # logits at position t predict token t + 1
    targets = ids.gather(1, position + 1)
    picked = logits.gather(1, position[..., None].expand(-1, -1, logits.shape[-1]))
    log_probs = torch.log_softmax(picked.float(), dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    return log_probs * mask, mask


def vanilla_token_mean(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights=None, *,
                       batch_num_tokens=None, dp_size=1):
    """The clipped surrogate of verl's ``vanilla`` mode aggregated by ``token-mean`` (written from its
    definition): mean over tokens of max(-A r, -A clip(r, 1 - 0.2, 1 + 0.28)), capped at -3 A for A < 0;
    with ``batch_num_tokens`` (the mini-batch's tokens over all ranks) and ``dp_size`` as verl's agg_loss
    normalises a micro-batch. Same signature and return as verl's registered losses."""
    mask = response_mask.to(torch.float32)
    ratio = torch.exp((log_prob - old_log_prob).clamp(-20.0, 20.0))
    surrogate = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH))
    surrogate = torch.where(advantages < 0, torch.minimum(surrogate, -advantages * DUAL_CLIP), surrogate)
    if rollout_is_weights is not None:
        surrogate = surrogate * rollout_is_weights
    tokens = mask.sum() if batch_num_tokens is None else batch_num_tokens
    return (surrogate * mask).sum() / tokens * dp_size, {}


def brute_force_pref_objective(seq_logp, ref_seq_logp, batch: Batch, delta_r: float, beta: float):
    """J_pref by the definition: every ordered pair (i, j) of a group with r_i - r_j > delta_r."""
    rewards = batch.rewards.tolist()
    members = defaultdict(list)
    for i, uid in enumerate(batch.uids):
        members[uid].append(i)
    preferred, rejected = [], []
    for rows in members.values():
        for i in rows:
            for j in rows:
                if i != j and rewards[i] - rewards[j] > delta_r:
                    preferred.append(i)
                    rejected.append(j)
    if not preferred:
        return seq_logp.sum() * 0, 0
    score = seq_logp - ref_seq_logp
    z = beta * (score[preferred] - score[rejected])
    return F.logsigmoid(z).mean(), len(preferred)


def trainable_gradients(model) -> dict[str, torch.Tensor]:
    """The full fp32 gradient of every trainable parameter, named as in the unwrapped model."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(model, FullyShardedDataParallel):  # FSDP1: the original parameters with their full gradients
        with FullyShardedDataParallel.summon_full_params(model, writeback=False, with_grads=True):
            return _gradients(model)
    return _gradients(model)


def _gradients(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        g = p.grad
        if g is None:
            g = torch.zeros(p.shape, device=p.device)
        elif hasattr(g, "full_tensor"):  # FSDP2: a DTensor
            g = g.full_tensor()
        out[name.replace("_fsdp_wrapped_module.", "")] = g.detach().float().clone()
    return out


def relative_difference(actual: dict, expected: dict) -> tuple[float, str, float]:
    """(max over tensors of ||a - e|| / ||e||, that tensor's name, the same over all tensors together)."""
    worst, worst_name, num2, den2 = 0.0, "", 0.0, 0.0
    for name, e in expected.items():
        diff, norm = float((actual[name] - e).norm()), float(e.norm())
        num2, den2 = num2 + diff**2, den2 + norm**2
        rel = diff / norm if norm > 0 else (0.0 if diff == 0 else math.inf)
        if rel >= worst:
            worst, worst_name = rel, name
    return worst, worst_name, math.sqrt(num2 / den2) if den2 > 0 else 0.0


@dataclass
class Step:
    """The driver's work for the step: old log-probs, fields (float32 as the trainer ships them), lambda."""

    old: torch.Tensor
    ref_seq: torch.Tensor
    partner_score: torch.Tensor
    partner_sign: torch.Tensor
    num_pairs: int
    lambda_reg: float
    pref_loss: float
    driver_s: float


def driver_step(model, batch: Batch, ref: torch.Tensor, amir, precision: Precision) -> Step:
    all_rows = torch.arange(len(batch), device=batch.ids.device)
    with torch.no_grad():
        old, _ = response_log_probs(model, batch, all_rows, precision)  # verl's compute_log_prob
    sync(batch.ids.device)
    start = time.perf_counter()
    fields = step_batch.compute_step_fields(amir, sequence_rewards=batch.rewards, uids=batch.uids,
                                            response_mask=batch.response_mask, old_log_probs=old,
                                            ref_log_probs=ref, sample_keys=batch.keys)
    signal = step_batch.gradient_signal(vanilla_token_mean, fields, old, batch.advantages, batch.response_mask,
                                        amir.beta_dpo)
    lambda_reg = amir.make_lambda_controller().step(signal)
    sync(batch.ids.device)
    driver_s = time.perf_counter() - start
    return Step(old, fields.ref_seq_logp.float(), fields.partner_score.float(), fields.partner_sign.float(),
                fields.num_pairs, lambda_reg, fields.stats.pref_loss, driver_s)


def whole_batch_gradient(model, batch: Batch, step: Step, amir, precision: Precision, split_terms: bool):
    """Gradient of pg_loss + lambda * (-J_pref) over the whole batch in one piece (and, with ``split_terms``,
    the preference term's part of it)."""
    model.zero_grad(set_to_none=True)
    all_rows = torch.arange(len(batch), device=batch.ids.device)
    log_probs, mask = response_log_probs(model, batch, all_rows, precision)
    base, _ = vanilla_token_mean(step.old, log_probs, batch.advantages, mask)
    seq = (log_probs * mask).sum(-1) / mask.sum(-1)
    j_pref, num_pairs = brute_force_pref_objective(seq, step.ref_seq, batch, amir.delta_r, amir.beta_dpo)
    if num_pairs != step.num_pairs:
        raise AssertionError(f"the driver mined {step.num_pairs} pairs, the definition {num_pairs}")
    term = step.lambda_reg * (-j_pref)
    if not split_terms:
        (base + term).backward()
        return trainable_gradients(model), None, float(j_pref.detach())
    base.backward(retain_graph=True)
    base_grads = trainable_gradients(model)
    term.backward()
    total = trainable_gradients(model)
    return total, {k: total[k] - base_grads[k] for k in total}, float(j_pref.detach())


def split_gradient(model, batch: Batch, step: Step, amir, precision: Precision, size: Size, seed: int,
                   amir_term: bool = True, weight_dp: int | None = None):
    """The actor's update: a shuffled batch, dp contiguous rank shares, fixed-size micro-batches."""
    model.zero_grad(set_to_none=True)
    n, dp = len(batch), size.dp
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).to(batch.ids.device)
    share = n // dp
    batch_num_tokens = float(batch.response_mask.sum())  # the mini-batch's tokens, all-reduced over the ranks
    weight = step_batch.preference_term_weight(step.lambda_reg, step.num_pairs, num_mini_batches=1,
                                               dp_size=dp if weight_dp is None else weight_dp)
    for rank in range(dp):
        rank_rows = order[rank * share:(rank + 1) * share]
        for start in range(0, share, size.micro):
            rows = rank_rows[start:start + size.micro]
            log_probs, mask = response_log_probs(model, batch, rows, precision)
            width = log_probs.shape[1]
            loss, _ = vanilla_token_mean(step.old[rows, :width], log_probs, batch.advantages[rows, :width], mask,
                                         batch_num_tokens=batch_num_tokens, dp_size=dp)
            if amir_term and weight:
                seq = pref.length_normalised_log_probs(log_probs, mask)
                f = pref.pair_log_likelihood_per_sequence(seq, step.ref_seq[rows], step.partner_score[rows],
                                                          step.partner_sign[rows], amir.beta_dpo)
                loss = loss + pref.preference_loss_share(f, weight)
            (loss / dp).backward()  # FSDP averages the ranks' gradients
    return trainable_gradients(model)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def process_group(device: torch.device):
    """A one-process group (nccl on CUDA, gloo on the CPU), initialised in-process from MASTER_ADDR/PORT."""
    import torch.distributed as dist

    if not os.environ.get("MASTER_PORT"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def decoder_layers(model):
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    return [m for m in model.modules() if isinstance(m, Qwen2DecoderLayer)]


def wrap_fsdp1(model, device: torch.device, precision: Precision):
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    mixed = None
    if precision.name == "bf16":  # verl's FSDP default: bf16 compute, fp32 reduction and master weights
        mixed = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.float32)
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Qwen2DecoderLayer}),
                                    mixed_precision=mixed, use_orig_params=True,
                                    sharding_strategy=ShardingStrategy.FULL_SHARD, **kwargs)


def wrap_fsdp2(model, device: torch.device, precision: Precision):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (1,))
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if precision.name == "bf16" else MixedPrecisionPolicy())
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


@dataclass
class Row:
    name: str
    precision: str
    status: str  # PASS / FAIL / SKIP / ERROR
    max_rel: float | None = None
    worst_tensor: str = ""
    global_rel: float | None = None
    tolerance: float | None = None
    pref_share: float | None = None
    lambda_reg: float | None = None
    num_pairs: int | None = None
    note: str = ""


def exactness_row(name, size, device, precision, batch, ref_plain, amir, seed, wrapper=None, lora=False,
                  control=False, fault=False) -> list[Row]:
    model = build_model(size, device, seed)
    ref = ref_plain
    if lora:
        model = add_lora(model, seed + 100)
        with torch.no_grad(), model.disable_adapter():  # LoRA's reference: the base model, adapters off
            ref, _ = response_log_probs(model, batch, torch.arange(len(batch), device=device), precision)
    if wrapper is not None:
        model = wrapper(model, device, precision)
    step = driver_step(model, batch, ref, amir, precision)
    expected, pref_part, _ = whole_batch_gradient(model, batch, step, amir, precision, split_terms=wrapper is None)
    actual = split_gradient(model, batch, step, amir, precision, size, seed=seed + 1, weight_dp=1 if fault else None)
    worst, worst_name, overall = relative_difference(actual, expected)
    tolerance = TOLERANCE[precision.name]
    share = None
    if pref_part is not None:
        pref_norm = math.sqrt(sum(float(v.norm()) ** 2 for v in pref_part.values()))
        total_norm = math.sqrt(sum(float(v.norm()) ** 2 for v in expected.values()))
        share = pref_norm / total_norm
    rows = [Row(name, precision.name, "PASS" if worst <= tolerance else "FAIL", worst, worst_name, overall,
                tolerance, share, step.lambda_reg, step.num_pairs)]
    if control:  # the same split with the dp factor dropped from the weight: must be seen
        wrong = split_gradient(model, batch, step, amir, precision, size, seed=seed + 1, weight_dp=1)
        c_worst, c_name, c_overall = relative_difference(wrong, expected)
        rows.append(Row(f"control: {name}, weight without dp", precision.name,
                        "DETECTED" if c_worst > tolerance else "MISSED", c_worst, c_name, c_overall, tolerance,
                        note="must exceed the tolerance"))
    return rows


def time_updates(size, device, precision, batch, ref, amir, seed):
    """Actor-update time (every micro-batch's forward + backward) with the AMIR loss against the base loss
    alone, alternating; on CUDA also each one's peak memory."""
    model = build_model(size, device, seed)
    step = driver_step(model, batch, ref, amir, precision)

    def once(amir_term):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        sync(device)
        start = time.perf_counter()
        split_gradient(model, batch, step, amir, precision, size, seed=seed + 1, amir_term=amir_term)
        sync(device)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        return time.perf_counter() - start, peak

    once(False), once(True)  # warm-up
    base_t, amir_t, ratios, peaks = [], [], [], {}
    for r in range(size.repeats):
        result = {}
        for amir_term in ((False, True) if r % 2 == 0 else (True, False)):
            result[amir_term] = once(amir_term)
        base_t.append(result[False][0])
        amir_t.append(result[True][0])
        ratios.append(result[True][0] / result[False][0])
        peaks = {"base": result[False][1], "amir": result[True][1]}
    return {"ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "base_s": statistics.median(base_t), "amir_s": statistics.median(amir_t), "driver_s": step.driver_s,
            "peak_bytes": peaks, "repeats": size.repeats}


def peft_missing_reason() -> str | None:
    try:
        import peft  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure to import means no LoRA rows
        return f"peft is not importable ({type(e).__name__}: {e})"
    return None


def fmt(x) -> str:
    return "-" if x is None else f"{x:.2e}"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="cuda, cpu, or auto (cuda when available)")
    parser.add_argument("--size", default="auto", choices=["auto", *SIZES], help="auto: gpu on CUDA, small on CPU")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-fsdp", action="store_true", help="skip the FSDP rows")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads (default 1: the small size is faster on one, and a busy machine does not "
                             "stall it); 0 keeps torch's default")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--record", action="store_true",
                        help="also write the output to docs/results/gpu_check_gpu.md (on the CPU: gpu_check_cpu.md)")
    parser.add_argument("--inject-fault", action="store_true",
                        help="check the check: every row uses the control's wrong weight, so the run must fail")
    args = parser.parse_args(argv)
    if args.record and args.inject_fault:
        parser.error("--record with --inject-fault would record a run that fails on purpose")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        # fp32 rows in true fp32 (no TF32), so that their tolerance means what it says
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    if not args.record:
        return check(args, device)
    page = AMIR["results_page"]
    with page.printed() as out:
        status = check(args, device)
    command = page.script_command(None if argv is None else [__file__, *argv])
    path = page.write_results(f"gpu_check_{'gpu' if device.type == 'cuda' else 'cpu'}", command,
                              page.text_block(out.getvalue()))
    print(f"wrote {path}")
    return status


def check(args: argparse.Namespace, device: torch.device) -> int:
    size = SIZES[args.size if args.size != "auto" else ("gpu" if device.type == "cuda" else "small")]
    if device.type == "cpu" and args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    fp32, bf16 = Precision("fp32", device.type), Precision("bf16", device.type)
    amir = AmirConfig(beta_dpo=0.5, delta_r=0.5, lambda_init=1.0)  # large lambda: a wrong term cannot hide
    batch = make_batch(size, device, args.seed)
    with torch.no_grad():  # the reference policy: another random model (LoRA rows: the base, adapters off)
        ref_model = build_model(size, device, args.seed + 1)
        ref, _ = response_log_probs(ref_model, batch, torch.arange(len(batch), device=device), fp32)
        del ref_model
    n_params = sum(p.numel() for p in build_model(size, device, args.seed).parameters())

    gpu_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"amir-verl gpu_check on {device} ({gpu_name}); torch {torch.__version__}, transformers "
          f"{transformers.__version__}; imports no verl/ray/vllm")
    print(f"model: random Qwen2ForCausalLM, {size.layers} layers, hidden {size.hidden}, heads {size.heads}/"
          f"{size.kv_heads} kv, vocab {size.vocab}, sdpa attention, {n_params / 1e6:.2f} M parameters, fp32 master "
          f"weights")
    print(f"batch: {len(batch)} sequences in {size.groups} groups of {size.group_size}, "
          f"{int(batch.response_mask.sum())} response tokens; split: {size.dp} simulated dp ranks x micro-batches "
          f"of {size.micro} ({len(batch) // size.dp // size.micro * size.dp} backward passes), one mini-batch")
    print(f"amir: beta_dpo {amir.beta_dpo}, delta_r {amir.delta_r}, lambda from the grad_share rule started at "
          f"{amir.lambda_settings().lambda_init}")
    print(f"tolerances (max over parameter tensors of ||g_split - g_whole|| / ||g_whole||, both sides at the same "
          f"precision): fp32 {TOLERANCE['fp32']:.0e}, bf16 {TOLERANCE['bf16']:.0e}")

    rows: list[Row] = []
    plans = [("plain fp32", fp32, None, False, False), ("plain bf16 autocast", bf16, None, False, True)]
    lora_skip = peft_missing_reason()
    if not args.no_fsdp:
        plans += [("fsdp1 bf16", bf16, wrap_fsdp1, False, False), ("fsdp2 bf16", bf16, wrap_fsdp2, False, False),
                  ("fsdp1 bf16 lora-r16", bf16, wrap_fsdp1, True, False),
                  ("fsdp2 bf16 lora-r16", bf16, wrap_fsdp2, True, False)]
    group = process_group(device) if not args.no_fsdp else contextlib.nullcontext()
    with group:
        for name, precision, wrapper, lora, control in plans:
            before = len(rows)
            if lora and lora_skip:
                rows.append(Row(name, precision.name, "SKIP", note=lora_skip))
            else:
                try:
                    rows += exactness_row(name, size, device, precision, batch, ref, amir, args.seed, wrapper,
                                          lora, control, args.inject_fault)
                except Exception as e:  # noqa: BLE001 - reported as a failed row
                    if device.type == "cpu" and wrapper is wrap_fsdp1 and "accelerator" in str(e):
                        # torch's FSDP1 refuses a CPU-only process; FSDP2 runs there
                        rows.append(Row(name, precision.name, "SKIP", note=f"FSDP1 on the CPU: {e}"))
                    else:
                        rows.append(Row(name, precision.name, "ERROR", note=f"{type(e).__name__}: {e}"))
            for r in rows[before:]:
                extra = ""
                if r.pref_share is not None:
                    extra = f"; lambda {r.lambda_reg:.3g}, {r.num_pairs} pairs, preference part {r.pref_share:.2f} " \
                            f"of the gradient norm"
                elif r.lambda_reg is not None:
                    extra = f"; lambda {r.lambda_reg:.3g}, {r.num_pairs} pairs"
                worst = f" (worst: {r.worst_tensor})" if r.worst_tensor else ""
                note = f" [{r.note}]" if r.note else ""
                print(f"  {r.name:<42} max rel {fmt(r.max_rel)}  global {fmt(r.global_rel)}  tol "
                      f"{fmt(r.tolerance)}  {r.status}{worst}{extra}{note}", flush=True)

    timing = time_updates(size, device, bf16, batch, ref, amir, args.seed)
    peak = timing["peak_bytes"]
    memory = ""
    if peak.get("base"):
        memory = f"; peak memory {peak['amir'] / 2**20:.0f} MiB vs {peak['base'] / 2**20:.0f} MiB " \
                 f"(ratio {peak['amir'] / peak['base']:.4f})"
    print(f"time (bf16 autocast, whole update of {len(batch)} sequences): AMIR / base {timing['ratio_median']:.3f} "
          f"median of {timing['repeats']} (per repetition {timing['ratio_min']:.3f}-{timing['ratio_max']:.3f}); "
          f"base {timing['base_s'] * 1e3:.1f} ms, AMIR {timing['amir_s'] * 1e3:.1f} ms; driver step (fields, "
          f"gradient signal, lambda) {timing['driver_s'] * 1e3:.1f} ms{memory}")

    assert_no_forbidden_imports()
    failed = [r for r in rows if r.status in ("FAIL", "ERROR", "MISSED")]
    checked = [r for r in rows if r.status in ("PASS", "FAIL", "ERROR")]
    controls = [r for r in rows if r.status in ("DETECTED", "MISSED")]
    elapsed = time.perf_counter() - START
    verdict = "PASS" if not failed and controls else "FAIL"
    print(f"RESULT: {verdict} ({sum(r.status == 'PASS' for r in rows)}/{len(checked)} exactness rows pass, "
          f"{sum(r.status == 'SKIP' for r in rows)} skipped, control "
          f"{'seen' if controls and all(r.status == 'DETECTED' for r in controls) else 'MISSED'}); "
          f"wall {elapsed:.1f} s (imports included)")
    if args.json:
        figures = {"device": str(device), "size": asdict(size), "rows": [asdict(r) for r in rows], "timing": timing,
                   "verdict": verdict, "wall_s": elapsed}
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
