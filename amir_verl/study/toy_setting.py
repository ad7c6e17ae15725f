"""The toy study's setting: a task the demo's tiny model visibly learns with GRPO in a few dozen CPU steps.

The demo's own task (the last digit of a + b, 0.1 for any digit) is barely learned in its 40 steps (validation
accuracy 0.016 -> about 0.08; the model mostly learns to print a digit), and a study of how AMIR changes
learning needs a policy that learns. From the demo's random model (hidden 64, 2 layers) GRPO with a 1/0 reward
did not learn to copy a digit either: 40 steps at lr 3e-3 took validation accuracy from 0.045 to 0.085 on the
task below and from 0.03 to 0.12 on "answer b of a+b" with 32 prompts a step (it learns to print some digit,
at about chance). So the study does what the paper pipeline does, a short supervised cold start, then RL:

- the task, **copy the digit**: "<tag> <split>: copy <d>" answered with the digit ``d``, the prompt's only
  digit (``tag``: the row's number in three letters, so that no two prompts of a split are the same text);
  reward 1 when the response's first digit is ``d``, else 0 (:func:`compute_score`: no partial credit, so
  printing any digit is not an optimum);
- the starting policy, shared by every run and seed: the demo's model (:func:`amir_verl.demo.toy_task.make_model`,
  seed 0) after :data:`COLD_START_STEPS` steps of supervised training on the training rows' "<d><eos>"
  (:func:`cold_start`), stopped where the copy is partly learned (validation accuracy 0.34 before training, so
  GRPO's groups have both outcomes and AMIR mines pairs from the first step); GRPO then raises it to about 0.65
  in 60 steps at lr 2e-3 with a 10-step warm-up (seed 0; without the warm-up, from an 80-step cold start,
  Adam's first full-size steps undid part of it);
- the validation rows (:func:`validation_rows`), ten of each digit, are also the probe prompts: the probe set is
  each of them with the ten digits as responses (:func:`amir_verl.study.probes.toy_probe_set`).

:func:`prepare_setting` writes the model and the data once into a study's folder; :func:`setting_overrides` are the
main_ppo overrides that point the demo's runs at them (given after the demo's own, they win).
"""

from __future__ import annotations

import random
import re
import string
from pathlib import Path

DATA_SOURCE = "amir_verl/toy_copy_digit"
TRAIN_ROWS = 1024
VALIDATION_ROWS = 100  # ten of each digit
COLD_START_STEPS = 100  # supervised steps of COLD_START_BATCH rows from the demo's random model
COLD_START_BATCH = 32
COLD_START_LR = 3e-3
LEARNING_RATE = 2e-3  # the GRPO runs' (the demo's is 3e-3)
WARMUP_STEPS = 10  # linear warm-up of the GRPO runs' learning rate: Adam's first full-size steps undo the cold start
SAVE_EVERY = 10  # steps between checkpoints: the probe curve's points
VALIDATE_EVERY = 20  # steps between validations (and before training)
SETTING_FOLDER = "setting"  # in the study's folder: model/ and data/, shared by every seed
# what study.json records of this setting: a study made with other values is not mixed with this one
RECORD = {"task": DATA_SOURCE, "train_rows": TRAIN_ROWS, "validation_rows": VALIDATION_ROWS,
          "cold_start": [COLD_START_STEPS, COLD_START_BATCH, COLD_START_LR], "lr": LEARNING_RATE, "warmup": WARMUP_STEPS,
          "save_every": SAVE_EVERY, "validate_every": VALIDATE_EVERY}


def tag(number: int) -> str:
    """``number`` (0 <= number < 26**3) in three lower-case letters, least significant first: 0 -> "aaa"."""
    if not 0 <= number < 26 ** 3:
        raise ValueError(f"{number} has no three-letter tag")
    letters = ""
    for _ in range(3):
        number, rest = divmod(number, 26)
        letters += string.ascii_lowercase[rest]
    return letters


def copy_row(number: int, split: str, digit: int) -> dict:
    """One row of the task (:data:`amir_verl.datasets.ROW_SCHEMA`): "<tag> <split[:2]>: copy <digit>" -> digit."""
    from amir_verl.datasets import make_row

    question = f"{tag(number)} {split[:2]}: copy {digit}"
    return make_row(DATA_SOURCE, [{"role": "user", "content": question}], [str(digit)], split, number,
                    f"{split}-{number}", question)


def training_rows(n: int = TRAIN_ROWS, seed: int = 0) -> list[dict]:
    """``n`` rows, their digits drawn uniformly by ``random.Random(seed)``."""
    rng = random.Random(seed)
    return [copy_row(number, "train", rng.randrange(10)) for number in range(n)]


def validation_rows(n: int = VALIDATION_ROWS) -> list[dict]:
    """Row ``k``'s digit is ``k mod 10``: each digit equally often, no sampling."""
    return [copy_row(number, "test", number % 10) for number in range(n)]


_FIRST_DIGIT = re.compile(r"\d")


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> dict:
    """1.0 when the first digit of the response is the answer, else 0 (verl's custom reward function).
    ``ground_truth``: the answer, or the row's list of accepted answers (verl passes the list)."""
    match = _FIRST_DIGIT.search(solution_str or "")
    pred = match.group(0) if match else ""
    golds = [ground_truth] if isinstance(ground_truth, str) else [str(g) for g in ground_truth]
    acc = float(pred in golds)
    return {"score": acc, "acc": acc, "pred": pred}


def cold_start(model, tokenizer, rows: list[dict], steps: int = COLD_START_STEPS, batch: int = COLD_START_BATCH,
               lr: float = COLD_START_LR) -> list[float]:
    """Supervised training of ``model`` in place on "<answer><eos>" after each row's prompt (as verl renders it),
    the rows in order (cycled), ``batch`` a step, AdamW at ``lr``; returns each step's loss, the mean over the
    batch of the mean over the two target tokens of -log pi(token | prompt, earlier tokens).

    The prompts of a batch must have the same length (the task's all do: no padding)."""
    import torch

    from amir_verl.study.probes import prompt_ids

    eos = tokenizer.eos_token_id
    sequences = []
    for row in rows:
        answer = tokenizer(row["reward_model"]["ground_truth"][0], add_special_tokens=False)["input_ids"]
        sequences.append((prompt_ids(tokenizer, list(row["prompt"])), answer + [eos]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for step in range(steps):
        chunk = [sequences[(step * batch + k) % len(sequences)] for k in range(batch)]
        prompt_length, target_length = len(chunk[0][0]), len(chunk[0][1])
        if any((len(p), len(t)) != (prompt_length, target_length) for p, t in chunk):
            raise ValueError("cold_start batches prompts of one length only")
        ids = torch.tensor([p + t for p, t in chunk])  # (batch, prompt + target)
        logits = model(input_ids=ids).logits[:, prompt_length - 1:-1]  # (batch, target, vocab): predicts the targets
        log_probs = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, prompt_length:, None]).squeeze(-1)
        loss = -log_probs.mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def prepare_setting(study_dir: Path) -> dict[str, str]:
    """The starting model (``<study_dir>/setting/model``: tokenizer and cold-started weights) and the data
    (``setting/data/{train,test}.parquet``), made once and read back after; returns their paths as
    :func:`amir_verl.demo.toy_task.make_assets` does. The model is written last, so a folder with its
    ``config.json`` is complete."""
    import torch

    from amir_verl.datasets import write_rows
    from amir_verl.demo.toy_task import make_model, make_tokenizer

    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # "Writing model shards" bars would interleave the study's lines
    folder = Path(study_dir) / SETTING_FOLDER
    paths = {"model": folder / "model", "train": folder / "data" / "train.parquet",
             "test": folder / "data" / "test.parquet"}
    if not (paths["model"] / "config.json").exists():
        train = training_rows()
        write_rows(train, paths["train"])
        write_rows(validation_rows(), paths["test"])
        staging = folder / "model.partial"
        tokenizer = make_tokenizer(staging)
        model = make_model(staging, tokenizer, seed=0)
        torch.manual_seed(0)
        cold_start(model, tokenizer, train)
        model.save_pretrained(staging)
        staging.rename(paths["model"])
    return {name: str(path) for name, path in paths.items()}


def setting_overrides(assets: dict[str, str]) -> list[str]:
    """main_ppo overrides that turn a demo run into the study's: its model, data, reward, learning rate,
    checkpoints every :data:`SAVE_EVERY` steps (all kept) and validation every :data:`VALIDATE_EVERY`."""
    return [
        f"actor_rollout_ref.model.path={assets['model']}",
        f"data.train_files={assets['train']}",
        f"data.val_files={assets['test']}",
        "reward.custom_reward_function.path=pkg://amir_verl.study.toy_setting",
        "reward.custom_reward_function.name=compute_score",
        f"actor_rollout_ref.actor.optim.lr={LEARNING_RATE}",
        f"actor_rollout_ref.actor.optim.lr_warmup_steps={WARMUP_STEPS}",
        f"trainer.save_freq={SAVE_EVERY}",
        f"trainer.test_freq={VALIDATE_EVERY}",
    ]
