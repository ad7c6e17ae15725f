"""A short supervised cold start that teaches a chat model amir-verl's answer template before RL.

A base SmolLM2-135M-Instruct earns reward 0 on the paper's template (it rarely writes an ``<answer>`` tag),
so every group's rewards are equal, no pair is mined and AMIR never acts; real pipelines start RL from a
model that already follows the format. This is plain full-parameter SFT with transformers (AdamW, loss on
the response tokens only) on generated problems with worked answers (:mod:`amir_verl.paper_pipeline.data`),
each prompt rendered exactly as verl renders it for the rollout: the chat template over
:func:`amir_verl.reward.template.build_prompt`, with the generation prompt.

    python -m amir_verl.paper_pipeline.cold_start --model DIR --out DIR [--steps 12] [--batch 8] [--lr 5e-5] [--seed 0]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

from amir_verl.paper_pipeline.data import cold_start_examples
from amir_verl.reward.template import build_prompt


def encode(tokenizer, question: str, response: str) -> tuple[list[int], list[int]]:
    """(token ids of prompt + response + eos, labels with the prompt masked as -100)."""
    prompt = tokenizer.apply_chat_template(build_prompt(question), add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"]
    answer = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt + answer, [-100] * len(prompt) + answer


def collate(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in examples)
    batch = {"input_ids": torch.full((len(examples), width), pad_id), "labels": torch.full((len(examples), width), -100),
             "attention_mask": torch.zeros((len(examples), width), dtype=torch.long)}
    for row, (ids, labels) in enumerate(examples):  # right padding: positions count from each row's start
        batch["input_ids"][row, : len(ids)] = torch.tensor(ids)
        batch["labels"][row, : len(ids)] = torch.tensor(labels)
        batch["attention_mask"][row, : len(ids)] = 1
    return batch


def cold_start(model_dir: Path, out: Path, steps: int = 12, batch_size: int = 8, lr: float = 5e-5, seed: int = 0,
               progress=print) -> list[float]:
    """Train ``steps`` steps of ``batch_size`` generated examples and save model + tokenizer to ``out``.
    Returns the loss of each step."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    examples = [encode(tokenizer, q, r) for q, r in cold_start_examples(steps * batch_size, seed)]
    losses = []
    for step in range(steps):
        start = time.monotonic()
        loss = model(**collate(examples[step * batch_size : (step + 1) * batch_size], tokenizer.pad_token_id)).loss
        if not math.isfinite(loss.item()):
            raise RuntimeError(f"cold start: loss {loss.item()} at step {step + 1}")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        progress(f"[cold start] step {step + 1}/{steps}  loss {loss.item():.3f}  {time.monotonic() - start:.1f} s")
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    return losses


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="HF folder to start from")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    cold_start(args.model, args.out, args.steps, args.batch, args.lr, args.seed, progress=lambda m: print(m, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
