"""A fixed probe set per task, and the score of a policy on it: what AMIR's term moves, measured without sampling
noise. Pure Python, torch and transformers (peft for a LoRA adapter); no verl import (verl's merger is run as a
command where a checkpoint needs it).

The probe set is a list of prompts, each with a fixed set of graded responses that depends on neither run of a
pair, so every checkpoint of both runs is scored on the same sequences:

- the toy task (:mod:`amir_verl.demo.toy_task`): :func:`toy_probe_set`, for each of its 100 questions
  (:func:`toy_probe_rows`; or the validation file's prompts) the ten digits as responses, the right one correct
  and the nine others incorrect (the task's own grading, one token each);
- a real task (the paper pipeline's SmolLM2): :func:`sampled_probe_set`, responses sampled once from the common
  starting policy (the cold-started model; the pair's initial adapter has B = 0, so it is that model) and graded
  by the task's reward.

Prompts are token ids as verl's agent loop renders them (the tokenizer's chat template with the generation
prompt, :func:`prompt_ids`); responses are token ids (sampled ones exactly as sampled, up to and with the first
EOS). A policy's score (:func:`score_policy`) is, per prompt with both outcomes, the mean length-normalised
log-prob (mean over the response's tokens of log pi(token | prompt, earlier tokens), temperature 1) of the
correct responses minus that of the incorrect ones (the **probe margin**), and the share of (correct, incorrect)
pairs with the correct one scored strictly higher (the **probe pair accuracy**), each averaged over those prompts.

A run's checkpoints (verl's ``<default_local_dir>/global_step_<N>/actor``, written every ``trainer.save_freq``
steps and at the last step, all kept by default) are scored by :func:`score_run`: step 0 is the starting model
folder, step N the checkpoint, loaded in this process in float32 for a world-size-1 FSDP checkpoint, full weights
or LoRA (:func:`load_checkpoint_policy`, as ``tests/e2e/support.py::load_policy`` and ``load_checkpoint`` do),
and otherwise through verl's own ``python -m verl.model_merger merge --backend fsdp`` (:func:`merge_with_verl`,
as the paper pipeline merges; it writes bfloat16).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from amir_verl.evaluation.scores import mean_token_log_probs

PROBE_FILE = "probes.json"  # a pair's probe set, written once per seed and read by both runs' scoring
SCORES_FILE = "probe_scores.json"  # a run's scores: {probe set fingerprint, {step: ProbeScore}}
SCORING_BATCH = 64  # sequences per forward pass
STEP_FOLDER = re.compile(r"^global_step_(\d+)$")
SHARD = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
DIGITS = "0123456789"


# ---- the probe set ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ProbeResponse:
    token_ids: tuple[int, ...]
    correct: bool
    text: str = ""  # for reading; the ids are what is scored


@dataclass(frozen=True)
class ProbePrompt:
    problem_id: str
    prompt_ids: tuple[int, ...]
    responses: tuple[ProbeResponse, ...]
    prompt: str = ""  # for reading

    @property
    def has_both(self) -> bool:
        return any(r.correct for r in self.responses) and not all(r.correct for r in self.responses)


@dataclass(frozen=True)
class ProbeSet:
    task: str
    description: str  # how it was built, in words (what a report states)
    prompts: tuple[ProbePrompt, ...]

    def fingerprint(self) -> str:
        """sha256 of the ids and grades: two scorings compare only on the same probe set."""
        content = [[p.problem_id, list(p.prompt_ids), [[list(r.token_ids), r.correct] for r in p.responses]]
                   for p in self.prompts]
        return hashlib.sha256(json.dumps([self.task, content]).encode()).hexdigest()[:16]

    def save(self, path: Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"fingerprint": self.fingerprint(), **asdict(self)}, indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: Path) -> ProbeSet:
        raw = json.loads(Path(path).read_text())
        probes = cls(raw["task"], raw["description"], tuple(
            ProbePrompt(p["problem_id"], tuple(p["prompt_ids"]),
                        tuple(ProbeResponse(tuple(r["token_ids"]), bool(r["correct"]), r.get("text", ""))
                              for r in p["responses"]), p.get("prompt", ""))
            for p in raw["prompts"]))
        if raw.get("fingerprint") not in (None, probes.fingerprint()):
            raise ValueError(f"{path}: the probe set does not match its recorded fingerprint (edited by hand?)")
        return probes


def read_rows(paths: Path | Sequence[Path]) -> list[dict]:
    """The rows of amir-verl parquet files (:data:`amir_verl.datasets.ROW_SCHEMA`), in file order."""
    import pyarrow.parquet as pq

    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    return [row for path in paths for row in pq.read_table(path).to_pylist()]


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """A row's prompt as verl's agent loop tokenizes it: ``apply_chat_template(messages, tokenize=True,
    add_generation_prompt=True)`` (transformers 5 returns a BatchEncoding, 4 a list)."""
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if hasattr(out, "keys") and "input_ids" in out.keys():
        out = out["input_ids"]
    out = out.tolist() if hasattr(out, "tolist") else list(out)
    if out and isinstance(out[0], (list, tuple)):
        (out,) = out
    return [int(i) for i in out]


def _problem_id(row: dict, number: int) -> str:
    extra = row.get("extra_info") or {}
    return str(extra.get("id") or extra.get("index", number))


def toy_probe_rows(split: str = "test") -> list[dict]:
    """Every question of the toy task once, in its row form: "q<i> <split[:2]>: a+b=?" for the 100 (a, b), i = 10a + b
    (validation's prefix by default, so that the prompts are as new to the policy as the validation ones). A probe
    set of these has no sampling of prompts at all; the validation file's 32 are a sample of them."""
    from amir_verl.datasets import make_row
    from amir_verl.demo.toy_task import DATA_SOURCE

    rows = []
    for index in range(100):
        a, b = divmod(index, 10)
        question = f"q{index} {split[:2]}: {a}+{b}=?"
        rows.append(make_row(DATA_SOURCE, [{"role": "user", "content": question}], [str((a + b) % 10)], split, index,
                             f"probe-{index}", question))
    return rows


def toy_probe_set(source: Path | Sequence[Path] | Sequence[dict], tokenizer,
                  grade: Callable[..., dict] | None = None) -> ProbeSet:
    """For each toy row (``source``: the validation file(s), or rows such as :func:`toy_probe_rows`): the ten
    digits as one-token responses, graded by ``grade`` (default the task's own
    :func:`amir_verl.demo.toy_task.compute_score`; the study's copy task:
    :func:`amir_verl.study.toy_setting.compute_score`), 1 correct and 9 incorrect. No EOS: the probe asks which
    digit the policy answers with first."""
    from amir_verl.demo.toy_task import DATA_SOURCE as TOY_SUM_SOURCE

    if grade is None:
        from amir_verl.demo.toy_task import compute_score as grade

    digit_ids = {}
    for digit in DIGITS:
        ids = tokenizer(digit, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise ValueError(f"the digit {digit!r} is {len(ids)} tokens under this tokenizer: not the toy's")
        digit_ids[digit] = tuple(ids)
    given_rows = not isinstance(source, (str, Path)) and all(isinstance(r, dict) for r in source)
    rows = list(source) if given_rows else read_rows(source)
    prompts = []
    for number, row in enumerate(rows):
        golds = list(row["reward_model"]["ground_truth"])
        responses = tuple(ProbeResponse(digit_ids[d], grade(row["data_source"], d, golds)["acc"] == 1.0, d)
                          for d in DIGITS)
        prompts.append(ProbePrompt(_problem_id(row, number), tuple(prompt_ids(tokenizer, list(row["prompt"]))),
                                   responses, row["prompt"][-1]["content"]))
    every_sum = given_rows and rows and rows[0]["data_source"] == TOY_SUM_SOURCE
    return ProbeSet("toy", f"{len(prompts)} prompts{' (every a+b once)' if every_sum else ''}, each with the ten "
                           "digits as responses (1 correct, 9 incorrect), one token each", tuple(prompts))


def sampled_probe_set(model_dir: Path, rows: Sequence[dict], samples_per_prompt: int = 8,
                      max_new_tokens: int = 64, temperature: float = 1.0, seed: int = 0,
                      grade: Callable[..., dict] | None = None, adapter: Path | None = None,
                      task: str = "sampled", keep_without_both: bool = False) -> ProbeSet:
    """Responses sampled once from the starting policy ``model_dir`` (with ``adapter`` merged in, if given) for
    each row, at ``temperature`` with no top-k or top-p (verl's validation sampling), graded by ``grade``
    (``grade(data_source, text, ground_truth, extra_info) -> {"acc": 0 or 1, ...}``; default the paper's reward
    :func:`amir_verl.reward.calibrated.compute_score`). Prompts whose samples are all correct or all incorrect
    have no margin and are dropped unless ``keep_without_both``. Each prompt samples from a random stream of its
    own, seeded by :func:`prompt_seed` (``seed`` and the prompt's text): its samples depend neither on the
    other prompts nor on its place among them, and two prompts do not share the draws (with one stream for
    every prompt, a draw that turns one response wrong turned the same response of every similar prompt wrong)."""
    import torch

    from amir_verl.evaluation.analyses import load_model

    if grade is None:
        from amir_verl.reward.calibrated import compute_score as grade
    model, tokenizer = load_model(str(model_dir))
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().eval()
    eos = _eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    prompts = []
    for number, row in enumerate(rows):
        ids = prompt_ids(tokenizer, list(row["prompt"]))
        torch.manual_seed(prompt_seed(seed, row["prompt"]))
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                                 max_new_tokens=max_new_tokens, num_return_sequences=samples_per_prompt,
                                 eos_token_id=eos, pad_token_id=pad)
        responses = []
        for sequence in out[:, len(ids):].tolist():
            cut = next((k + 1 for k, t in enumerate(sequence) if t in eos), len(sequence))
            sequence = sequence[:cut]
            text = tokenizer.decode(sequence, skip_special_tokens=True)
            verdict = grade(row["data_source"], text, list(row["reward_model"]["ground_truth"]),
                            dict(row.get("extra_info") or {}))
            responses.append(ProbeResponse(tuple(sequence), float(verdict["acc"]) == 1.0, text))
        prompt = ProbePrompt(_problem_id(row, number), tuple(ids), tuple(responses), row["prompt"][-1]["content"])
        if prompt.has_both or keep_without_both:
            prompts.append(prompt)
    return ProbeSet(task, f"{samples_per_prompt} responses per prompt sampled once from {Path(model_dir).name} "
                          f"(temperature {temperature}, up to {max_new_tokens} tokens, seed {seed}) and graded; "
                          f"prompts with both outcomes" + (" and the others" if keep_without_both else ""),
                    tuple(prompts))


def prompt_seed(seed: int, messages: Sequence[dict]) -> int:
    """The seed of a prompt's random stream in :func:`sampled_probe_set`: ``seed`` and the prompt's messages,
    hashed (SHA-256, the first 8 bytes)."""
    text = json.dumps([seed, [dict(m) for m in messages]], sort_keys=True)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def _eos_ids(model, tokenizer) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    eos = eos if eos is not None else tokenizer.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos)


# ---- scoring ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ProbeScore:
    """One policy on one probe set; each mean is over the prompts with both outcomes."""

    prompts: int  # prompts with both a correct and an incorrect response
    margin: float  # mean of (mean log-prob of the correct responses - that of the incorrect ones)
    pair_accuracy: float  # mean share of (correct, incorrect) pairs with the correct one scored strictly higher
    correct_log_prob: float  # mean of the correct responses' mean log-prob
    incorrect_log_prob: float
    top_correct: float  # share of prompts whose highest-scored response is correct (ties: the first listed)


def response_log_probs(model, probes: ProbeSet, batch_size: int = SCORING_BATCH) -> list[list[float]]:
    """``[prompt][response]``: the mean log-prob per token of each probe response given its prompt, temperature 1,
    batched as :func:`amir_verl.evaluation.scores.mean_token_log_probs` batches (padding changes nothing)."""
    flat = [(k, p.prompt_ids, r.token_ids) for k, p in enumerate(probes.prompts) for r in p.responses]
    if any(not response for *_, response in flat):
        raise ValueError("a probe response has no tokens")
    scores = iter(mean_token_log_probs(model, [(prompt, response) for _, prompt, response in flat], batch_size))
    return [[next(scores) for _ in p.responses] for p in probes.prompts]


def probe_score(probes: ProbeSet, log_probs: Sequence[Sequence[float]]) -> ProbeScore:
    """The probe margin, pair accuracy and the rest from per-response mean log-probs (:func:`response_log_probs`)."""
    margins, accuracies, right_means, wrong_means, tops = [], [], [], [], []
    for prompt, scores in zip(probes.prompts, log_probs, strict=True):
        right = [s for r, s in zip(prompt.responses, scores, strict=True) if r.correct]
        wrong = [s for r, s in zip(prompt.responses, scores, strict=True) if not r.correct]
        if not right or not wrong:
            continue
        right_means.append(sum(right) / len(right))
        wrong_means.append(sum(wrong) / len(wrong))
        margins.append(right_means[-1] - wrong_means[-1])
        accuracies.append(sum(c > w for c in right for w in wrong) / (len(right) * len(wrong)))
        tops.append(float(prompt.responses[max(range(len(scores)), key=lambda j: scores[j])].correct))
    n = len(margins)
    mean = (lambda values: sum(values) / n) if n else (lambda values: math.nan)
    return ProbeScore(n, mean(margins), mean(accuracies), mean(right_means), mean(wrong_means), mean(tops))


def score_policy(model, probes: ProbeSet, batch_size: int = SCORING_BATCH) -> ProbeScore:
    return probe_score(probes, response_log_probs(model, probes, batch_size))


# ---- a run's checkpoints ----------------------------------------------------------------------------------------

def run_checkpoints(checkpoint_dir: Path) -> dict[int, Path]:
    """{step: its actor folder} of verl's checkpoints under ``checkpoint_dir`` (a run's
    ``trainer.default_local_dir``): every ``global_step_<N>/actor`` holding a model shard, by step."""
    found = {}
    for folder in Path(checkpoint_dir).glob("global_step_*/actor"):
        match = STEP_FOLDER.match(folder.parent.name)
        if match and any(SHARD.match(f.name) for f in folder.iterdir()):
            found[int(match.group(1))] = folder
    return dict(sorted(found.items()))


def _world_size(actor_dir: Path) -> int:
    sizes = {int(m.group(1)) for f in Path(actor_dir).iterdir() if (m := SHARD.match(f.name))}
    if len(sizes) != 1:
        raise ValueError(f"{actor_dir}: model shards of world sizes {sorted(sizes)}: not one verl checkpoint")
    return sizes.pop()


def loads_in_process(actor_dir: Path) -> bool:
    """A checkpoint of one rank (the toy's, the CPU pipeline's): its one shard is the whole state dict."""
    return _world_size(actor_dir) == 1


def _load_shard(actor_dir: Path) -> dict:
    import torch

    mesh_log = logging.getLogger("torch.distributed.device_mesh")
    level = mesh_log.level
    mesh_log.setLevel(logging.ERROR)  # unpickling FSDP2's DTensors warns that their mesh has no process group
    try:
        saved = torch.load(Path(actor_dir) / "model_world_size_1_rank_0.pt", map_location="cpu", weights_only=False)
    finally:
        mesh_log.setLevel(level)
    return {name: tensor.to_local() if hasattr(tensor, "to_local") else tensor for name, tensor in saved.items()}


def load_checkpoint_policy(actor_dir: Path, initial_model: Path | None = None, adapter: Path | None = None):
    """The float32 policy of a world-size-1 FSDP checkpoint, its weights exactly as saved (DTensors made local).

    - Full weights (the toy's): the model built from the checkpoint's ``huggingface/config.json`` (else
      ``initial_model``'s config), every weight from ``model_world_size_1_rank_0.pt``; only a tied
      ``lm_head.weight`` may be absent.
    - LoRA (``lora_train_meta.json`` beside the shard, the paper pipeline's runs): ``initial_model`` (the base)
      with the adapter's structure (``adapter``, the run's ``lora_adapter_path``, else peft's ``all-linear``
      with the saved rank and alpha, verl's default), the saved tensors loaded into it (adapter-only shards of
      ``save_lora_only`` keep the base's weights), then merged into the weights (``merge_and_unload``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    actor_dir = Path(actor_dir)
    if not loads_in_process(actor_dir):
        raise ValueError(f"{actor_dir} is a multi-rank checkpoint: merge it with merge_with_verl")
    state = _load_shard(actor_dir)
    meta_path = actor_dir / "lora_train_meta.json"
    if meta_path.exists():
        if initial_model is None:
            raise ValueError(f"{actor_dir} is a LoRA checkpoint: give its base model's folder")
        from peft import LoraConfig, PeftModel, get_peft_model

        base = AutoModelForCausalLM.from_pretrained(initial_model, dtype=torch.float32)
        if adapter is not None:
            model = PeftModel.from_pretrained(base, str(adapter), is_trainable=True)
        else:
            meta = json.loads(meta_path.read_text())
            model = get_peft_model(base, LoraConfig(r=meta["r"], lora_alpha=meta["lora_alpha"],
                                                    target_modules="all-linear", task_type="CAUSAL_LM"))
        lora_only = all("lora_" in name for name in state)
        allowed = {name for name in model.state_dict() if lora_only and "lora_" not in name}
    else:
        saved_config = actor_dir / "huggingface"
        config_dir = saved_config if (saved_config / "config.json").exists() else initial_model
        if config_dir is None:
            raise ValueError(f"{actor_dir} has no huggingface/config.json: give the initial model's folder")
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.float32)
        allowed = set()
    missing, unexpected = model.load_state_dict(state, strict=False)
    if model.config.tie_word_embeddings:
        allowed |= {name for name in missing if name.endswith("lm_head.weight")}
    if not set(missing) <= allowed or unexpected:
        raise ValueError(f"{actor_dir}: the checkpoint does not fit its model "
                         f"(missing {sorted(set(missing) - allowed)}, unexpected {unexpected})")
    if meta_path.exists():
        return model.merge_and_unload().eval()
    if "lm_head.weight" in missing and (
            model.get_output_embeddings().weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()):
        raise ValueError(f"{actor_dir}: lm_head.weight is not saved and not tied to the embeddings")
    return model.eval()


def merge_with_verl(actor_dir: Path, target_dir: Path, timeout: float = 1800) -> Path:
    """``python -m verl.model_merger merge --backend fsdp`` of a checkpoint into an HF folder (a LoRA run's
    adapter lands in ``target_dir/lora_adapter``, which :func:`amir_verl.evaluation.analyses.load_model` merges).
    verl 0.9.1's merger writes bfloat16 (``FSDPModelMerger``: ``tensor.bfloat16()``): the weights lose their
    float32 digits (on the toy's step-20 checkpoint, up to 4e-3 per weight and 1e-4 on the probe margin), so
    world-size-1 checkpoints are loaded in process instead (:func:`load_checkpoint_policy`)."""
    result = subprocess.run([sys.executable, "-m", "verl.model_merger", "merge", "--backend", "fsdp", "--local_dir",
                             str(actor_dir), "--target_dir", str(target_dir)], capture_output=True, text=True,
                            timeout=timeout)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"verl's merger failed on {actor_dir} (exit {result.returncode}): {tail[0][:300]}")
    return Path(target_dir)


def checkpoint_policy(actor_dir: Path, initial_model: Path, merged_dir: Path | None = None,
                      adapter: Path | None = None):
    """A checkpoint's policy: in this process where it loads so (:func:`loads_in_process`), else merged by verl
    into ``merged_dir`` (default: ``<actor_dir>/../merged_for_probes``) and loaded from there."""
    if loads_in_process(actor_dir):
        return load_checkpoint_policy(actor_dir, initial_model, adapter)
    from amir_verl.evaluation.analyses import load_model

    target = merged_dir or Path(actor_dir).parent / "merged_for_probes"
    if not (target / "config.json").exists():
        merge_with_verl(actor_dir, target)
    return load_model(str(target))[0]


def score_run(checkpoint_dir: Path, initial_model: Path, probes: ProbeSet, steps: Sequence[int] | None = None,
              batch_size: int = SCORING_BATCH, progress: Callable[[str], None] | None = None,
              adapter: Path | None = None) -> dict[int, ProbeScore]:
    """{step: score}: step 0 the starting model (``initial_model``, an HF folder: for a LoRA run with a B = 0
    initial adapter, the base model), then every checkpoint of the run (or those of ``steps``; a LoRA run's
    with the structure of its initial ``adapter``, if it had one)."""
    from amir_verl.evaluation.analyses import load_model

    checkpoints = run_checkpoints(checkpoint_dir)
    wanted = list(checkpoints) if steps is None else [s for s in steps if s != 0]
    absent = [s for s in wanted if s not in checkpoints]
    if absent:
        raise ValueError(f"{checkpoint_dir} has no checkpoint of step(s) {absent} (it has {list(checkpoints)})")
    scores = {0: score_policy(load_model(str(initial_model))[0], probes, batch_size)}
    for step in wanted:
        scores[step] = score_policy(checkpoint_policy(checkpoints[step], initial_model, adapter=adapter), probes,
                                    batch_size)
        if progress:
            progress(f"step {step}: probe margin {scores[step].margin:+.4f}, pair accuracy "
                     f"{scores[step].pair_accuracy:.3f}")
    return dict(sorted(scores.items()))


def write_scores(path: Path, probes: ProbeSet, scores: dict[int, ProbeScore]) -> Path:
    path = Path(path)
    path.write_text(json.dumps({"probe_set": probes.fingerprint(), "task": probes.task,
                                "scores": {str(step): asdict(s) for step, s in sorted(scores.items())}}, indent=1)
                    + "\n")
    return path


def read_scores(path: Path, probes: ProbeSet | None = None) -> dict[int, ProbeScore]:
    """A run's scores; with ``probes``, refused unless they were scored on that probe set."""
    raw = json.loads(Path(path).read_text())
    if probes is not None and raw["probe_set"] != probes.fingerprint():
        raise ValueError(f"{path} was scored on probe set {raw['probe_set']}, not {probes.fingerprint()}")
    return {int(step): ProbeScore(**values) for step, values in raw["scores"].items()}


# ---- a pair of the demo's runs (the toy study's seed) -------------------------------------------------------------

DEMO_RUNS = ("grpo", "amir_grpo")  # amir_verl.demo.quickstart.RUNS' names: GRPO (lambda 0) and AMIR-GRPO


def score_pair(workdir: Path, run_dirs: dict[str, Path], initial_model: Path, make_probe_set: Callable[[], ProbeSet],
               adapter: Path | None = None, batch_size: int = SCORING_BATCH,
               progress: Callable[[str], None] | None = None) -> dict[str, dict[int, ProbeScore]]:
    """The probe scores of a pair's runs: the probe set ``make_probe_set()`` saved once to ``workdir/probes.json``
    (read back, not rebuilt, when there), then each run's checkpoints ``<run dir>/checkpoints`` and the shared
    starting model ``initial_model`` (step 0), scored by :func:`score_run` (``adapter``: the runs' initial LoRA
    adapter) and written to ``<run dir>/probe_scores.json``; a run whose scores file exists for this probe set is
    read, not rescored. ``run_dirs``: {run name: its folder}."""
    path = Path(workdir) / PROBE_FILE
    probe_set = ProbeSet.load(path) if path.exists() else make_probe_set()
    if not path.exists():
        probe_set.save(path)
    scores = {}
    for run, run_dir in run_dirs.items():
        out = Path(run_dir) / SCORES_FILE
        if out.exists():
            scores[run] = read_scores(out, probe_set)
            continue
        scores[run] = score_run(Path(run_dir) / "checkpoints", initial_model, probe_set, batch_size=batch_size,
                                adapter=adapter,
                                progress=progress and (lambda line, run=run: progress(f"[{run}] {line}")))
        write_scores(out, probe_set, scores[run])
    return scores


def score_demo_pair(workdir: Path, runs: Sequence[str] = DEMO_RUNS, every_sum: bool = True,
                    batch_size: int = SCORING_BATCH, progress: Callable[[str], None] | None = None,
                    probe_rows: Sequence[dict] | None = None, initial_model: Path | None = None,
                    grade: Callable[..., dict] | None = None) -> dict[str, dict[int, ProbeScore]]:
    """:func:`score_pair` of a demo workdir's runs (:mod:`amir_verl.demo.quickstart` run with
    ``-- trainer.save_freq=K``, each in ``workdir/<run>``): the toy probe set (:func:`toy_probe_set`, graded by
    ``grade``) of ``probe_rows``, else of every sum (:func:`toy_probe_rows`; ``every_sum=False``: of the
    validation file ``workdir/data/test.parquet``), under the tokenizer of the starting model ``initial_model``
    (default ``workdir/model``, the demo's)."""
    from transformers import AutoTokenizer

    workdir = Path(workdir)
    initial_model = Path(initial_model) if initial_model is not None else workdir / "model"

    def make_probe_set() -> ProbeSet:
        if probe_rows is not None:
            source = list(probe_rows)
        else:
            source = toy_probe_rows() if every_sum else workdir / "data" / "test.parquet"
        return toy_probe_set(source, AutoTokenizer.from_pretrained(initial_model), grade)

    return score_pair(workdir, {run: workdir / run for run in runs}, initial_model, make_probe_set,
                      batch_size=batch_size, progress=progress)


def probe_curves(per_seed: dict[int, dict[str, dict[int, dict[str, float]]]], figure: str, base: str = DEMO_RUNS[0],
                 other: str = DEMO_RUNS[1]) -> tuple[list[int], list[list[float | None]], list[list[float | None]]]:
    """(steps, base curves, other curves) of one figure (a :class:`ProbeScore` field as :func:`dataclasses.asdict`
    names it, or any other figure a run has per step), seed by seed in ``per_seed``'s order ({seed: {run: {step:
    {figure: value}}}}), over the union of the steps where a run has the figure (None where a run lacks it), for
    :func:`amir_verl.study.statistics.compare_curves`."""
    if figure == "prompts":
        raise ValueError(f"{figure!r} is not a probe figure")

    def value(step_values: dict[int, dict[str, float]], step: int) -> float | None:
        found = step_values.get(step, {}).get(figure)
        return None if found is None or (isinstance(found, float) and math.isnan(found)) else found

    steps = sorted({step for runs in per_seed.values() for run in (base, other)
                    for step in runs[run] if value(runs[run], step) is not None})
    if not steps:
        raise ValueError(f"no run has the figure {figure!r}")
    curves = {run: [[value(runs[run], s) for s in steps] for runs in per_seed.values()] for run in (base, other)}
    return steps, curves[base], curves[other]
