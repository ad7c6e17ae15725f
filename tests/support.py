"""What several test modules share: composing verl's and the recipes' configs, brute-force gradients, verl's
own dump writer, a tiny tokenizer, verl's dataset loading, the README's commands, a call of the hf server,
probes in fresh interpreters, and a preexec for Ctrl-C tests. Test modules import from here, never from each
other."""

from __future__ import annotations

import os
import importlib.util
import re
import signal
import subprocess
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import verl
from verl.trainer.ppo.v1.trainer_base import PPOTrainer
from verl.workers.utils.losses import ppo_loss

from amir_verl.paper_pipeline.pipeline import chosen_rollout
from amir_verl.testing import (
    actor_tensordict,
    assign_engine_batch_info,
    brute_force_pref_objective,
    grads,
    nested,
    token_log_probs,
)

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
README = REPO / "README.md"
E2E_DIR = "tests/e2e/"  # the modules that launch main_ppo
PAPER_E2E = "tests/e2e/test_paper_pipeline_cpu.py"  # its tests read the one pipeline run the session starts


# The suite's pipeline run rolls out on the engine the pipeline's `--rollout auto` picks, verl's own vllm rollout
# where vLLM's CPU build is installed (CI's lock) and the hf server elsewhere, unless
# AMIR_VERL_TEST_PIPELINE_ROLLOUT names one.
PIPELINE_ROLLOUT = os.environ.get("AMIR_VERL_TEST_PIPELINE_ROLLOUT") or chosen_rollout("auto")


def start_local_ray(num_cpus: int) -> None:
    """``ray.init`` of a Ray of this process's own (``address="local"``: not one running beside), without the dashboard
    or the workers' output. Tried twice: Ray 2.60's raylet aborts when its dashboard agent has not written its port
    files within a fixed 15 s, and ``ray.init`` then fails 30 s later ("The current node timed out during startup";
    seen once in a whole-suite run, the raylet's log saying "Timed out waiting for file .../metrics_agent_port_...",
    while the paper pipeline beside the unit tests started its vLLM engine). What failed to start is reaped when
    this process exits (Ray's reaper)."""
    import ray

    try:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, address="local")
    except Exception as error:
        if "timed out during startup" not in str(error):
            raise
        ray.shutdown()
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, address="local")


def load_script(path: Path):
    """A script that is not a module of the package (``benchmarks/x.py``), imported from its file."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def readme_commands() -> list[str]:
    """The command lines of the README's first code block (its two commands: demo, tests)."""
    block = re.search(r"```bash\n(.*?)```", README.read_text(), re.S)[1]
    return [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


VERL_CONFIG = Path(verl.__file__).parent / "trainer" / "config"


GRPO = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.name=vllm"]


AMIR = ["actor_rollout_ref.actor.policy_loss.loss_mode=amir_grpo", "trainer.v1.trainer_mode=amir"]


def compose_verl(overrides, config_dir=VERL_CONFIG, name="ppo_trainer"):
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(config_name=name, overrides=overrides)


def whole_batch_base_loss(model, batch, config):
    """verl's base-mode ppo_loss over the whole step batch in one piece (dp 1, one micro-batch)."""
    order = list(range(len(batch)))
    td = actor_tensordict(batch, order)
    assign_engine_batch_info([td], global_batch_size=len(batch))
    log_probs = nested([token_log_probs(model, x) for x in td["input_ids"].unbind()])
    base_loss, _ = ppo_loss(config, {"log_probs": log_probs}, td)
    return base_loss


def brute_force_gradient(model, batch, amir, config, lambda_reg):
    model.zero_grad()
    base_loss = whole_batch_base_loss(model, batch, config)
    j_pref = brute_force_pref_objective(model, batch.ref_log_probs, batch, amir)
    (base_loss + lambda_reg * (-j_pref)).backward()
    return grads(model), j_pref.detach(), float(base_loss)


def verl_dump(folder, step, lines):
    """``<folder>/<step>.jsonl`` written by verl's own V1 ``_write_generations``; ``lines`` are dicts with
    input, output, score and the reward's extra fields (uid included), as verl's ``_validate`` passes them."""
    keys = list(dict.fromkeys(k for line in lines for k in line))
    extra = {k: [line.get(k) for line in lines] for k in keys if k not in ("input", "output", "gts", "score")}
    PPOTrainer._write_generations(
        inputs=[line["input"] for line in lines], outputs=[line["output"] for line in lines],
        gts=[line.get("gts", "1") for line in lines], scores=[line["score"] for line in lines],
        reward_extra_infos_dict=extra, dump_path=str(folder), global_steps=step)
    return folder / f"{step}.jsonl"


def word_tokenizer(folder: Path):
    """A tiny local tokenizer (one token per whitespace-separated word, all unknown but the specials), so
    that every fixture prompt stays far under the recipe's max_prompt_length and none is filtered."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "<pad>": 1, "<eos>": 2}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>",
                                        eos_token="<eos>")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    tokenizer.save_pretrained(folder)
    return tokenizer


def load_like_main_ppo(files, config, tokenizer, is_train):
    """verl 0.9.1's V1 trainer (trainer_base._init_dataloader): create_rl_dataset, then its collate_fn."""
    from verl.trainer.ppo.utils import create_rl_dataset

    key = "train_max_samples" if is_train else "val_max_samples"
    return create_rl_dataset(files, config.data, tokenizer, None, is_train=is_train,
                             max_samples=config.data.get(key, -1))


def sigint_as_from_a_terminal() -> None:
    """``preexec_fn`` for a process the test will Ctrl-C: SIGINT raises KeyboardInterrupt, as in a terminal.
    (A test run started in the background, ``pytest ... &``, hands its children SIGINT ignored, and Python
    keeps an ignored SIGINT ignored, so the signal would never arrive.)"""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def generate(srv, prompt, **params):
    import asyncio

    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True, **params}
    return asyncio.run(srv.generate(prompt_ids=prompt, sampling_params=params, request_id="x"))


def compose_recipe(variant, model, extra=()):
    with initialize_config_dir(config_dir=str(RECIPES / "config"), version_base=None):
        config = compose(config_name=f"paper_{variant}", overrides=[f"actor_rollout_ref.model.path={model}", *extra])
    OmegaConf.resolve(config)
    return config


class FreshPython:
    """``python -c code`` in a fresh interpreter (cwd ``/``, environment ``env``), started at once: the probes a
    module's tests read are started together by a module fixture, so that their imports of verl (seconds of
    CPU each) overlap instead of queueing."""

    def __init__(self, code: str, env: dict[str, str]):
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env, cwd="/")

    def stdout_lines(self, timeout: float = 600) -> list[str]:
        """Its stdout's lines, once it has exited 0 (an assertion with its stderr's tail otherwise). Past ``timeout``
        it is killed and TimeoutExpired raised."""
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            raise
        assert self.proc.returncode == 0, err[-3000:]
        return out.strip().splitlines()


# t(0.975, df) from a printed table of Student's t distribution, not from scipy: the study's intervals are
# checked against these
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 7: 2.365}


def paired_t_by_hand(differences: list[float]) -> tuple[float, float]:
    """The mean of ``differences`` and the half-width of its 95% paired t interval, from :data:`T_975`."""
    n = len(differences)
    mean = sum(differences) / n
    sd = (sum((d - mean) ** 2 for d in differences) / (n - 1)) ** 0.5
    return mean, T_975[n - 1] * sd / n ** 0.5


def plain_mean_log_probs(model, prompt: list[int], response: list[int]) -> float:
    """Mean over the response's tokens of log pi(token | everything before it), one unpadded sequence."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0]
    log_probs = torch.log_softmax(logits.double(), -1)
    total = 0.0
    for k, token in enumerate(response):
        total += float(log_probs[len(prompt) + k - 1, token])
    return total / len(response)


def plain_scores(model, probe_set) -> dict[str, float]:
    """The figures of ``probe_set`` (:class:`amir_verl.study.probes.ProbeSet`) under ``model`` by their definitions,
    in plain Python (the study's probe tests)."""
    margins, accuracies, rights, wrongs, tops = [], [], [], [], []
    for p in probe_set.prompts:
        scored = [(plain_mean_log_probs(model, list(p.prompt_ids), list(r.token_ids)), r.correct) for r in p.responses]
        right = [s for s, ok in scored if ok]
        wrong = [s for s, ok in scored if not ok]
        if not right or not wrong:
            continue
        rights.append(sum(right) / len(right))
        wrongs.append(sum(wrong) / len(wrong))
        margins.append(rights[-1] - wrongs[-1])
        accuracies.append(sum(1 for c in right for w in wrong if c > w) / (len(right) * len(wrong)))
        best = max(scored, key=lambda item: item[0])
        tops.append(1.0 if best[1] else 0.0)
    n = len(margins)
    return {"prompts": n, "margin": sum(margins) / n, "pair_accuracy": sum(accuracies) / n,
            "correct_log_prob": sum(rights) / n, "incorrect_log_prob": sum(wrongs) / n, "top_correct": sum(tops) / n}
