"""Cost of AMIR over its base mode, measured in one run (issue 2, item 9).

1. An actor update (forward + backward of every micro-batch through verl 0.9.1's loss path) on a
   randomly initialised Qwen2-shaped model, group size 8, responses of a few hundred tokens, base
   mode (`vanilla` / `gspo`) and AMIR alternating; prints median times, their ratio, forward passes,
   the peak bytes the autograd graph holds, and (in child processes) the peak RSS of each mode.
2. The driver's per-step work for 8,192 groups of 8: pair mining and the per-sequence fields.
3. The driver's gradient signal for the lambda rule (issue 9) on 1,024 groups of 8 with 2,048-token
   responses (16.8 M tokens): both gradients at log_prob = old_log_prob, verl's base loss by autograd.

    python benchmarks/bench_actor_update.py [--device cuda --dtype bfloat16 --hidden 896 --layers 24] [--record]

``--record`` also writes the output to docs/results/bench_actor_update.md (:mod:`amir_verl.results_page`; with a
``--device`` other than cpu: bench_actor_update_gpu.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from functools import partial

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from amir_verl.actor_loss import amir_ppo_loss
from amir_verl.config import AmirConfig
from amir_verl.preference import dpo_logits, length_normalised_log_probs, mine_preference_pairs, partner_table
from amir_verl.results_page import print_or_record
from amir_verl.run_config import SPLIT_INVARIANT_BASE_MODES
from amir_verl.step_batch import compute_step_fields, gradient_signal
from amir_verl.testing import (
    StepBatch,
    actor_config,
    actor_tensordict,
    amir_step_fields,
    assign_engine_batch_info,
    extra_info_for,
    nested,
)
from amir_verl.trainer import whole_batch_policy_loss
from verl.utils import tensordict_utils as tu
from verl.workers.engine.utils import prepare_micro_batches
from verl.workers.utils.losses import ppo_loss


def build_model(args):
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3, num_hidden_layers=args.layers,
        num_attention_heads=max(2, args.hidden // 64), num_key_value_heads=max(1, args.hidden // 128),
        max_position_embeddings=4096, tie_word_embeddings=True,
    )
    config._attn_implementation = "sdpa"
    return Qwen2ForCausalLM(config).to(device=args.device, dtype=getattr(torch, args.dtype))


class ForwardCounter:
    def __init__(self, model):
        self.calls = 0
        model.register_forward_hook(self._hook)

    def _hook(self, *_):
        self.calls += 1


def micro_batch_log_probs(model, input_ids_rows):
    """One padded forward per micro-batch (right padding), log-probs back in verl's jagged layout."""
    lengths = [len(r) for r in input_ids_rows]
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long, device=input_ids_rows[0].device)
    attn = torch.zeros_like(ids)
    for i, r in enumerate(input_ids_rows):
        ids[i, : len(r)] = r
        attn[i, : len(r)] = 1
    logits = model(input_ids=ids, attention_mask=attn).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    lp = torch.cat([lp, lp.new_zeros(len(lengths), 1)], dim=1)
    return nested([lp[i, :n] for i, n in enumerate(lengths)])


def make_batch(args, model):
    """The step batch as the actor receives it (one mini-batch, dp 1, on ``args.device``); returns
    (actor TensorDict, pairs, response tokens)."""
    rng = random.Random(0)
    n = args.groups * args.group_size
    prompts, responses, rewards, uids, keys = [], [], [], [], []
    for g in range(args.groups):
        prompt = torch.tensor([rng.randrange(1, args.vocab) for _ in range(args.prompt_len)])
        for s in range(args.group_size):
            prompts.append(prompt)
            responses.append(torch.tensor([rng.randrange(1, args.vocab) for _ in range(rng.randint(*args.response_len))]))
            rewards.append(rng.choice([0.0, 1.0]) + 0.1 * rng.random())
            uids.append(f"g{g}")
            keys.append(f"g{g}_{s}_0")
    with torch.no_grad():
        full = micro_batch_log_probs(model, [torch.cat([p, r]).to(args.device) for p, r in zip(prompts, responses)])
    rows = full.unbind()
    old = [rows[i][len(prompts[i]) - 1 : len(prompts[i]) + len(responses[i]) - 1].float().cpu() for i in range(n)]
    ref = [o + 0.01 for o in old]
    adv = [torch.full_like(o, rewards[i] - 0.55) for i, o in enumerate(old)]
    batch = StepBatch(prompts, responses, torch.tensor(rewards, dtype=torch.float64), uids, keys, [False] * n,
                      old, ref, adv)
    fields = amir_step_fields(batch, AmirConfig(delta_r=0.5))
    td = actor_tensordict(batch, list(range(n)), fields, extra_info_for(fields, lambda_reg=0.05))
    assign_engine_batch_info([td], global_batch_size=n)
    tu.assign_non_tensor(td, use_dynamic_bsz=False, micro_batch_size_per_gpu=args.micro_batch)
    return td.to(args.device), fields.num_pairs, tu.get(td, "batch_num_tokens")


def actor_update(model, optimizer, td, loss_fn, saved_bytes):
    optimizer.zero_grad(set_to_none=True)
    micro_batches, _ = prepare_micro_batches(td)
    for mb in micro_batches:
        with torch.autograd.graph.saved_tensors_hooks(saved_bytes.pack, saved_bytes.unpack):
            log_probs = micro_batch_log_probs(model, mb["input_ids"].unbind())
            loss, _ = loss_fn(model_output={"log_probs": log_probs}, data=mb)
        loss.backward()
        saved_bytes.end_micro_batch()
    optimizer.step()


class SavedBytes:
    """Peak bytes of tensors the autograd graph keeps for backward, within one micro-batch."""

    def __init__(self):
        self.current = self.peak = 0

    def pack(self, t):
        self.current += t.numel() * t.element_size()
        self.peak = max(self.peak, self.current)
        return t

    def unpack(self, t):
        return t

    def end_micro_batch(self):
        self.current = 0


def loss_functions(args):
    base_mode, agg = ("gspo", "seq-mean-token-mean") if args.gspo else ("vanilla", "token-mean")
    config = actor_config(base_mode, agg, micro=args.micro_batch)
    return {
        "base": partial(ppo_loss, config=config),
        "amir": partial(amir_ppo_loss, config=config, beta_dpo=0.2),
    }


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def bench_update(args):
    model = build_model(args)
    counter = ForwardCounter(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7)
    td, num_pairs, tokens = make_batch(args, model)
    fns = loss_functions(args)
    times = {k: [] for k in fns}
    forwards, saved, peak_gpu = {}, {}, {}
    for rep in range(args.warmup + args.reps):
        for mode in (("base", "amir") if rep % 2 == 0 else ("amir", "base")):
            tracker = SavedBytes()
            counter.calls = 0
            if args.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            gc.collect()
            sync(args.device)
            t0 = time.perf_counter()
            actor_update(model, optimizer, td, fns[mode], tracker)
            sync(args.device)
            if rep >= args.warmup:
                times[mode].append(time.perf_counter() - t0)
            forwards[mode] = counter.calls
            saved[mode] = tracker.peak
            if args.device == "cuda":
                peak_gpu[mode] = torch.cuda.max_memory_allocated()
    return dict(times=times, forwards=forwards, saved=saved, peak_gpu=peak_gpu, num_pairs=num_pairs, tokens=tokens,
                params=sum(p.numel() for p in model.parameters()))


def bench_loss_only(args, reps=30):
    """The loss functions alone (forward + backward to the log-probs) on the update's micro-batches:
    isolates what AMIR adds from the model's forward/backward, which dominates and is identical."""
    model = build_model(args)
    td, _, _ = make_batch(args, model)
    micro_batches, _ = prepare_micro_batches(td)
    with torch.no_grad():
        inputs = [micro_batch_log_probs(model, mb["input_ids"].unbind()) for mb in micro_batches]
    fns = loss_functions(args)
    total = {k: [] for k in fns}
    for rep in range(reps):
        for mode in (("base", "amir") if rep % 2 == 0 else ("amir", "base")):
            sync(args.device)
            t0 = time.perf_counter()
            for mb, lp in zip(micro_batches, inputs):
                leaf = torch.nested.as_nested_tensor([r.clone().requires_grad_() for r in lp.unbind()],
                                                     layout=torch.jagged)
                loss, _ = fns[mode](model_output={"log_probs": leaf}, data=mb)
                loss.backward()
            sync(args.device)
            total[mode].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in total.items()}


def rss_of_mode(mode, argv):
    """Peak RSS (MiB) of a child process running only ``mode`` updates (the parent's RSS mixes both)."""
    out = subprocess.run([sys.executable, __file__, *argv, "--only", mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["max_rss_mib"]


def bench_mining(num_groups=8192, group_size=8, response_len=16, reps=7):
    gen = torch.Generator().manual_seed(0)
    n = num_groups * group_size
    rewards = torch.randint(0, 2, (n,), generator=gen).double() + 0.3 * torch.rand(n, generator=gen, dtype=torch.float64)
    group_ids = torch.arange(num_groups).repeat_interleave(group_size)
    mask = torch.ones(n, response_len)
    old = -torch.rand(n, response_len, generator=gen)
    ref = old + 0.01 * torch.randn(n, response_len, generator=gen)
    uids = [f"{uuid_like(g)}" for g in range(num_groups) for _ in range(group_size)]
    keys = [f"{uids[i]}_{i % group_size}_0" for i in range(n)]
    amir = AmirConfig()

    def core():
        l_old = length_normalised_log_probs(old, mask)
        l_ref = length_normalised_log_probs(ref, mask)
        pairs = mine_preference_pairs(rewards, group_ids, amir.delta_r)
        dpo_logits(l_old, l_ref, pairs, amir.beta_dpo)
        partner_table(pairs, n, l_old - l_ref)
        return len(pairs)

    def driver_step():
        return compute_step_fields(amir, rewards, uids, mask, old, ref, keys).num_pairs

    result = {}
    for name, fn in (("mining_and_coefficients", core), ("driver_step_fields", driver_step)):
        fn()
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            pairs = fn()
            samples.append(time.perf_counter() - t0)
        result[name] = dict(median_ms=1000 * statistics.median(samples), pairs=pairs)
    return result


def bench_grad_signal(num_groups=1024, group_size=8, response_len=2048, reps=5):
    """Median wall and process-CPU seconds of :func:`gradient_signal` per base mode, as the trainer calls it
    (in chunks of sequences for split-invariant modes) and with the batch as one piece, and the seconds of
    the step fields before it; every response ``response_len`` tokens (the issue's 16.8 M tokens)."""
    gen = torch.Generator().manual_seed(0)
    n = num_groups * group_size
    rewards = (torch.rand(n, generator=gen) < 0.4).double()
    uids = [uuid_like(g) for g in range(num_groups) for _ in range(group_size)]
    keys = [f"{uids[i]}_{i % group_size}_0" for i in range(n)]
    mask = torch.ones(n, response_len)
    old = -torch.rand(n, response_len, generator=gen) * mask
    ref = old + 0.01 * torch.randn(n, response_len, generator=gen) * mask
    grouped = rewards.view(num_groups, group_size)
    adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).view(n, 1).float() * mask
    amir = AmirConfig()
    fields = compute_step_fields(amir, rewards, uids, mask, old, ref, keys)
    result = {}
    for base, agg in (("vanilla", "token-mean"), ("gspo", "seq-mean-token-mean")):
        loss_fn = whole_batch_policy_loss(actor_config(base, agg), n, int(mask.sum()))
        for how, chunked in (("", base in SPLIT_INVARIANT_BASE_MODES), ("_one_piece", False)):
            samples, cpu = [], []
            for _ in range(reps + 1):
                t0, c0 = time.perf_counter(), time.process_time()
                gradient_signal(loss_fn, fields, old, adv, mask, amir.beta_dpo, chunked=chunked)
                samples.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
            result[base + how] = statistics.median(samples[1:])
            result[base + how + "_cpu"] = statistics.median(cpu[1:])
    t0 = time.perf_counter()
    compute_step_fields(amir, rewards, uids, mask, old, ref, keys)
    result["step_fields"] = time.perf_counter() - t0
    return dict(result, tokens=int(mask.sum()), pairs=fields.num_pairs)


def uuid_like(g: int) -> str:
    return f"{(g * 2654435761) % 2**32:08x}-{g:04x}-4abc-8def-{g * 7919 % 10**12:012d}"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--response-len", type=int, nargs=2, default=(200, 400))
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--gspo", action="store_true", help="compare amir_gspo with gspo instead of amir_grpo with vanilla")
    p.add_argument("--no-rss", action="store_true", help="skip the per-mode child processes")
    p.add_argument("--record", action="store_true",
                   help="also write the output to docs/results/bench_actor_update.md "
                        "(a --device other than cpu: bench_actor_update_gpu.md)")
    p.add_argument("--only", choices=["base", "amir"], help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))

    if args.only:  # child process for the RSS measurement
        model = build_model(args)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7)
        td, _, _ = make_batch(args, model)
        for _ in range(2):
            actor_update(model, optimizer, td, loss_functions(args)[args.only], SavedBytes())
        print(json.dumps({"max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
        return
    name = "bench_actor_update" if args.device == "cpu" else "bench_actor_update_gpu"
    print_or_record(name if args.record else None, lambda: report(args))


def report(args):
    base_name = "gspo" if args.gspo else "vanilla"
    print(f"actor update: {args.groups} groups x {args.group_size}, responses {args.response_len[0]}-"
          f"{args.response_len[1]} tokens, micro-batch {args.micro_batch}, {args.device} {args.dtype}", flush=True)
    r = bench_update(args)
    tb, ta = statistics.median(r["times"]["base"]), statistics.median(r["times"]["amir"])
    print(f"  model parameters        {r['params'] / 1e6:.1f} M, response tokens {r['tokens']}, pairs {r['num_pairs']}")
    print(f"  median update time      {base_name} {tb * 1000:.1f} ms   amir {ta * 1000:.1f} ms   ratio {ta / tb:.4f}")
    print(f"  per-rep ratios          {', '.join(f'{a / b:.3f}' for a, b in zip(r['times']['amir'], r['times']['base']))}")
    print(f"  forward passes / update {base_name} {r['forwards']['base']}   amir {r['forwards']['amir']}")
    print(f"  autograd saved (peak)   {base_name} {r['saved']['base'] / 2**20:.2f} MiB   amir "
          f"{r['saved']['amir'] / 2**20:.2f} MiB   ratio {r['saved']['amir'] / r['saved']['base']:.4f}")
    if r["peak_gpu"]:
        print(f"  peak GPU memory         {base_name} {r['peak_gpu']['base'] / 2**30:.3f} GiB   amir "
              f"{r['peak_gpu']['amir'] / 2**30:.3f} GiB   delta {(r['peak_gpu']['amir'] - r['peak_gpu']['base']) / 2**20:.1f} MiB")
    loss = bench_loss_only(args)
    extra = loss["amir"] - loss["base"]
    print(f"  loss functions alone    {base_name} {loss['base'] * 1000:.2f} ms   amir {loss['amir'] * 1000:.2f} ms   "
          f"AMIR adds {extra * 1000:.2f} ms = {100 * extra / tb:.3f}% of the base update")
    if not args.no_rss:
        argv = [a for a in sys.argv[1:]]
        rb, ra = rss_of_mode("base", argv), rss_of_mode("amir", argv)
        print(f"  peak RSS (own process)  {base_name} {rb:.0f} MiB   amir {ra:.0f} MiB   ratio {ra / rb:.4f}")
    print("driver step, 8192 groups x 8 (CPU):", flush=True)
    for name, m in bench_mining().items():
        print(f"  {name:<24} {m['median_ms']:.1f} ms  ({m['pairs']} pairs)")
    g = bench_grad_signal()
    print(f"driver gradient signal, 1024 groups x 8, 2048-token responses ({g['tokens'] / 1e6:.1f} M response "
          f"tokens, {g['pairs']} pairs; CPU, {torch.get_num_threads()} threads):", flush=True)
    for how, label in (("", "as the trainer runs it"), ("_one_piece", "batch as one piece")):
        print(f"  gradient_signal, {label:<22} vanilla {g['vanilla' + how]:.3f} s   gspo {g['gspo' + how]:.3f} s "
              f"wall; process CPU time (all threads) vanilla {g['vanilla' + how + '_cpu']:.3f} s   "
              f"gspo {g['gspo' + how + '_cpu']:.3f} s")
    print(f"  step fields before it    {g['step_fields']:.3f} s")


if __name__ == "__main__":
    main()
