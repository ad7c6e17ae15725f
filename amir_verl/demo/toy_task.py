"""Everything the CPU quickstart trains on, made locally: no hub download.

- a character-level tokenizer with a chat template (``transformers.PreTrainedTokenizerFast``),
- a randomly initialised tiny Qwen2 (``save_pretrained``),
- a toy task in the schema of every amir-verl data file (:data:`amir_verl.datasets.ROW_SCHEMA`):
  "last digit of a + b", answered with one digit, and its rule reward :func:`compute_score`.

The task is small enough that a 0.1 M-parameter model moves its reward within a few CPU steps.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from amir_verl.datasets import make_row, write_rows

DATA_SOURCE = "amir_verl/toy_last_digit"
SPECIAL = ["<pad>", "<eos>"]
CHARS = list("0123456789+=?: abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.,#\n")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}A: {% endif %}"
)


def _byte_level(char: str) -> str:
    """GPT-2's byte-to-unicode map (the form Qwen2's byte-level tokenizer keeps its vocabulary in)."""
    byte = char.encode()[0]
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    if byte in printable:
        return chr(byte)
    return chr(256 + [b for b in range(256) if b not in printable].index(byte))


def make_tokenizer(out_dir: Path):
    """A one-token-per-character tokenizer saved to ``out_dir``.

    transformers 5 loads the tokenizer of a Qwen2 checkpoint as ``Qwen2Tokenizer`` (byte-level BPE with
    Qwen2's pre-tokenizer), whatever class saved it, so it is built in that form: a byte-level BPE
    whose vocabulary is the characters of the task and which has no merges.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + [_byte_level(c) for c in CHARS])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", model_input_names=["input_ids", "attention_mask"]
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def make_model(out_dir: Path, tokenizer, seed: int = 0, hidden: int = 64, layers: int = 2):
    """A randomly initialised Qwen2-shaped causal LM saved to ``out_dir`` (float32)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None
    )
    model.save_pretrained(out_dir)
    return model


def make_rows(n: int, split: str, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for index in range(n):
        a, b = rng.randrange(10), rng.randrange(10)
        question = f"q{index} {split[:2]}: {a}+{b}=?"  # unique text: no two groups share a prompt
        answer = str((a + b) % 10)
        rows.append(make_row(DATA_SOURCE, [{"role": "user", "content": question}], [answer], split, index,
                             f"{split}-{index}", question))
    return rows


def make_dataset(out_dir: Path, n_train: int = 256, n_test: int = 32, seed: int = 0) -> dict[str, Path]:
    paths = {}
    for split, n, s in (("train", n_train, seed), ("test", n_test, seed + 1)):
        paths[split] = out_dir / f"{split}.parquet"
        write_rows(make_rows(n, split, s), paths[split])
    return paths


_FIRST_DIGIT = re.compile(r"\d")


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> dict:
    """1.0 when the first digit of the response is the answer, 0.1 for any other digit, else 0.

    ``ground_truth``: the answer, or the rows' list of accepted answers (verl passes the list).

    The 0.1 gives a random model a reward gradient towards answering with a digit at all; with
    ``amir.delta_r=0.5`` only a correct-versus-wrong difference forms a preference pair.
    """
    match = _FIRST_DIGIT.search(solution_str or "")
    pred = match.group(0) if match else ""
    golds = [ground_truth] if isinstance(ground_truth, str) else [str(g) for g in ground_truth]
    acc = float(pred in golds)
    return {"score": acc if acc else (0.1 if pred else 0.0), "acc": acc, "pred": pred}


def make_assets(out_dir: Path, n_train: int = 256, n_test: int = 32, hidden: int = 64) -> dict[str, str]:
    """Tokenizer + model in ``out_dir/model``, parquet files in ``out_dir/data``; returns their paths.
    ``hidden``: the model's width (4 heads: head size hidden / 4); vLLM's CPU attention needs a head size of
    at least 32, so its runs ask for 128."""
    out_dir = Path(out_dir)
    model_dir = out_dir / "model"
    tokenizer = make_tokenizer(model_dir)
    make_model(model_dir, tokenizer, hidden=hidden)
    data = make_dataset(out_dir / "data", n_train, n_test)
    return {"model": str(model_dir), "train": str(data["train"]), "test": str(data["test"])}


def main() -> None:
    p = argparse.ArgumentParser(description="make the CPU quickstart's tiny model, tokenizer and toy data")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--train", type=int, default=256)
    p.add_argument("--test", type=int, default=32)
    args = p.parse_args()
    print(json.dumps(make_assets(args.out, args.train, args.test), indent=2))


if __name__ == "__main__":
    main()
