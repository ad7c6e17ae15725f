"""A LoRA adapter in its initial state, drawn from a stated seed, for runs that must start from the same weights.

    python -m amir_verl.lora_init --model PATH --rank 16 --alpha 16 --seed 0 --out DIR
    ... actor_rollout_ref.model.lora_adapter_path=DIR   # in every run to compare (lora_rank / lora_alpha as above)

Without ``lora_adapter_path``, verl's FSDP engine draws the adapter itself (``FSDPEngine._build_lora_module``:
peft's ``get_peft_model``, A Kaiming-uniform, B = 0) from whatever state the process's random generator is in,
so two runs of the same recipe start with different A matrices: the policy is the same (B = 0) but from the
first update on the runs differ in their adapter as well as in what is compared. This writes the adapter that
``get_peft_model`` would draw, with verl's LoRA settings (``task_type`` causal LM, no bias), after
``torch.manual_seed(seed)``; verl loads it with ``PeftModel.from_pretrained(..., is_trainable=True)``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def write_initial_adapter(model: str, out: Path, rank: int, alpha: int, seed: int,
                          target_modules: str | list[str] = "all-linear") -> int:
    """Write peft's adapter folder (``adapter_config.json``, ``adapter_model.safetensors``) for ``model`` to
    ``out``; returns the number of adapter tensors (A and B of each adapted module)."""
    import torch
    from peft import LoraConfig, TaskType, get_peft_model
    from transformers import AutoModelForCausalLM

    if rank <= 0:
        raise ValueError(f"--rank must be positive, got {rank}")
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    torch.manual_seed(seed)
    peft_model = get_peft_model(base, LoraConfig(task_type=TaskType.CAUSAL_LM, r=rank, lora_alpha=alpha,
                                                 target_modules=target_modules, bias="none"))
    adapter = {name: p for name, p in peft_model.named_parameters() if "lora_" in name}
    if not adapter or any(float(p.detach().abs().max()) != 0 for name, p in adapter.items() if "lora_B" in name):
        raise RuntimeError("peft did not initialise B = 0: the adapter would change the starting policy")
    peft_model.save_pretrained(out)
    return len(adapter)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the base model (HF folder or hub id) the runs train")
    parser.add_argument("--rank", type=int, required=True, help="the runs' actor_rollout_ref.model.lora_rank")
    parser.add_argument("--alpha", type=int, required=True, help="the runs' actor_rollout_ref.model.lora_alpha")
    parser.add_argument("--target-modules", nargs="+", default=["all-linear"],
                        help="the runs' actor_rollout_ref.model.target_modules (default: verl's all-linear)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    targets = args.target_modules[0] if args.target_modules == ["all-linear"] else args.target_modules
    try:
        written = write_initial_adapter(args.model, args.out, args.rank, args.alpha, args.seed, targets)
    except (OSError, ValueError, RuntimeError) as error:
        print(f"amir_verl.lora_init: error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} ({written} tensors, B = 0); pass actor_rollout_ref.model.lora_adapter_path={args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
