"""The paper's pipeline as one piece, as a user runs it: ``python -m amir_verl.paper_pipeline.pipeline --size test`` (data_prep
-> SmolLM2-135M-Instruct -> cold start -> recipes/paper/run.sh grpo and amir_grpo side by side through verl's
main_ppo -> verl's model merger -> amir-eval), each artifact checked against a rule decided before running:

- every parquet file has amir-verl's row schema;
- each run's composed config (hydra's record) holds every key of its recipe files as written, except the
  keys the pipeline overrides, and those are exactly run.sh's and the pipeline's own;
- AMIR acts: pairs are mined and the preference term enters the actor's loss; amir/num_pairs and
  amir/pref_loss of each step equal their definition recomputed from verl's rollout dump (rewards and uids,
  and the per-sequence l_old / l_ref the AMIR trainer adds to it); at step 1 l_old = l_ref (the LoRA adapter
  starts at B = 0), so every frozen score is 0 and the term is log 2;
- the merged model (verl's merger, adapter applied by amir-eval's loader) gives the log-probs of the policy
  rebuilt by hand from the checkpoint (W + alpha / r * B A) on a dumped response, with every tensor rounded
  to bfloat16 as verl's merger stores them, and its adapter is the trained one (B != 0);
- every amir-eval output exists, and pass@k equals the unbiased estimator counted from the validation dump;
- like with like: both runs load one initial adapter (B = 0) through verl's lora_adapter_path, one validation
  before training (the GRPO run's), and the same step-1 samples of every group;
- the summary's "what AMIR-GRPO did" figures (same adapter, identical step-1 responses, identical responses of
  every later step and of the last validation, pairs per step, pref_loss minus log 2, the merged models'
  largest weight difference) and its verdict equal their recomputation from the dumps, metrics and merged weights.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import yaml
from omegaconf import OmegaConf

from amir_verl.paper_pipeline import MODEL_NAME
from amir_verl.paper_pipeline.pipeline import CPU_OVERRIDES, SIZES, comparison_overrides, rollout_settings
from amir_verl.paper_pipeline.report import ROLLOUT_ENGINES
from amir_verl.datasets import ROW_SCHEMA
from amir_verl.evaluation.passk import DISPLAY_NAMES
from amir_verl.metrics import NUM_PAIRS, PREF_LOSS, PREF_TERM, REWARD
from tests.support import PIPELINE_ROLLOUT, REPO

pytestmark = pytest.mark.e2e
SIZE = SIZES["test"]
RUNS = {"grpo": "GRPO", "amir_grpo": "AMIR-GRPO"}
ENGINE = PIPELINE_ROLLOUT  # the engine the suite's pipeline run asks for (tests/support.py says why)
BETA, DELTA = 0.2, 0.5  # run.sh's beta for a model it does not name; amir.delta_r's default


@pytest.fixture(scope="module")
def pipeline(paper_pipeline_run):
    """The pipeline run started as the session started (tests/conftest.py), once it has finished:
    (workdir, its stdout)."""
    work, proc = paper_pipeline_run
    returncode = proc.wait(timeout=2400)
    stdout, stderr = ((work / name).read_text() for name in ("pipeline.out", "pipeline.err"))
    assert returncode == 0, stdout[-5000:] + stderr[-5000:]
    return work, stdout


def run_dir(work: Path, variant: str) -> Path:
    return work / "outputs" / f"{MODEL_NAME}_{variant}"


def metrics(work: Path, variant: str) -> dict[int, dict[str, float]]:
    steps: dict[int, dict[str, float]] = {}
    for line in (run_dir(work, variant) / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        steps.setdefault(row.pop("step"), {}).update(row)
    return steps


def dump(folder: Path, step: int) -> list[dict]:
    return [json.loads(line) for line in (folder / f"{step}.jsonl").read_text().splitlines()]


def test_every_parquet_file_has_the_row_schema(pipeline):
    work, _ = pipeline
    files = sorted((work / "data" / "amir").rglob("*.parquet"))
    assert len(files) == 8  # gsm8k train + test, six more benchmarks
    for path in files:
        assert pq.read_schema(path).remove_metadata().equals(ROW_SCHEMA), path


def leaves(tree, path=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from leaves(value, f"{path}.{key}" if path else key)
    else:
        yield path, tree


def test_each_run_composed_its_recipe_as_written_but_for_the_named_overrides(pipeline):
    work, _ = pipeline
    pipeline_keys = {o.split("=", 1)[0].lstrip("+") for o in (*CPU_OVERRIDES, *rollout_settings(ENGINE)[0], *SIZE.overrides())
                     if not o.startswith("hydra.")}  # hydra's own keys are not in the job's overrides.yaml
    run_sh_keys = {"actor_rollout_ref.model.path", "trainer.n_gpus_per_node", "trainer.nnodes", "amir.beta_dpo"}
    for variant in RUNS:
        hydra = run_dir(work, variant) / "hydra" / ".hydra"
        composed = OmegaConf.to_container(OmegaConf.load(hydra / "config.yaml"))  # as hydra parses yaml
        overridden = {o.split("=", 1)[0].lstrip("+") for o in yaml.safe_load((hydra / "overrides.yaml").read_text())}
        comparison = {o.split("=", 1)[0] for o in comparison_overrides(variant, tuple(RUNS), work / "adapter")}
        assert comparison == {"actor_rollout_ref.model.lora_adapter_path"} | (
            {"trainer.val_before_train"} if variant == "amir_grpo" else set())
        assert overridden == (pipeline_keys | run_sh_keys | comparison) - ({"amir.beta_dpo"} if variant == "grpo" else set())
        recipe = {}
        for name in ("paper_common", f"paper_{variant}"):
            recipe.update({k: v for k, v in leaves(OmegaConf.to_container(OmegaConf.load(REPO / "recipes" / "config" / f"{name}.yaml")))
                           if not k.startswith(("defaults", "hydra"))})
        checked = 0
        for key, value in recipe.items():
            if key in overridden:
                continue
            node = composed
            for part in key.split("."):
                node = node[part]
            assert node == value, (variant, key, node, value)
            checked += 1
        assert checked >= 30  # of the recipe's 46 keys (paper_common.yaml), the rest overridden for the CPU


def test_the_runs_rolled_out_on_the_engine_asked_for_and_the_summary_says_which(pipeline):
    work, stdout = pipeline
    for variant in RUNS:
        config = OmegaConf.load(run_dir(work, variant) / "hydra" / ".hydra" / "config.yaml")
        assert config.actor_rollout_ref.rollout.name == ENGINE, variant
    line = f"Rollout engine (every run): {ROLLOUT_ENGINES[ENGINE]}."
    assert line in (work / "summary.md").read_text().splitlines()
    assert f"[paper] rollout engine: {ROLLOUT_ENGINES[ENGINE]} (--rollout {ENGINE})" in stdout


def test_both_runs_start_from_the_same_adapter_and_roll_out_the_same_first_step(pipeline):
    """Like with like: one initial adapter (B = 0, the recipe's rank and alpha), loaded by both runs through
    verl's lora_adapter_path (each run's log says so), the AMIR run's validation before training left to the
    GRPO run's, the same step-1 prompts, and on the hf server identical step-1 rollouts. verl's vllm rollout
    seeds the engine, not each request (a per-request seed only under ``rollout.full_determinism``, and then
    one seed for all n samples of a prompt), so its samples depend on how requests meet in the engine's
    batches: on vLLM the two runs' step-1 responses differ (measured at --size test: rewards 0.585 and 0.357),
    as they do between two GPU runs."""
    from safetensors.torch import load_file

    work, _ = pipeline
    adapter = work / "models" / "lora_init"
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    assert len(tensors) == 2 * 210 and all(float(v.abs().max()) == 0 for k, v in tensors.items() if "lora_B" in k)
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 16
    for variant in RUNS:
        config = OmegaConf.load(run_dir(work, variant) / "hydra" / ".hydra" / "config.yaml")
        assert config.actor_rollout_ref.model.lora_adapter_path == str(adapter)
        assert f"Loading pre-trained LoRA adapter to from: {adapter}" in (run_dir(work, variant) / "main_ppo.log").read_text()
    assert 0 in metrics(work, "grpo") and 0 not in metrics(work, "amir_grpo")
    first = [dump(run_dir(work, variant) / "rollout", 1) for variant in RUNS]
    assert len(first[0]) == SIZE.prompts_per_step * 8
    assert sorted(r["input"] for r in first[0]) == sorted(r["input"] for r in first[1])  # same data order
    if ENGINE == "hf":  # the same samples of each group (the hf server's seeding: per prompt and occurrence)
        assert sorted((r["input"], r["output"], r["score"]) for r in first[0]) == sorted(
            (r["input"], r["output"], r["score"]) for r in first[1])


def mined_pairs(rows: list[dict]) -> list[tuple[dict, dict]]:
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["uid"].rsplit("_", 2)[0], []).append(row)
    return [(i, j) for members in groups.values() for i in members for j in members if i["score"] - j["score"] > DELTA]


def test_amir_acts_and_its_logged_pairs_and_loss_match_the_rollout_dump(pipeline):
    work, _ = pipeline
    steps = metrics(work, "amir_grpo")
    trained = [s for s in sorted(steps) if s > 0]
    assert trained == list(range(1, SIZE.steps + 1))
    assert sum(steps[s][NUM_PAIRS] > 0 for s in trained) >= 1
    assert any(steps[s][PREF_TERM] > 0 for s in trained)
    for step in trained:
        rows = dump(run_dir(work, "amir_grpo") / "rollout", step)
        assert len(rows) == SIZE.prompts_per_step * 8
        pairs = mined_pairs(rows)
        assert steps[step][NUM_PAIRS] == len(pairs), step
        score = {row["uid"]: row["amir_old_seq_logp"] - row["amir_ref_seq_logp"] for row in rows}
        if step == 1:  # the adapter starts at B = 0: the policy is its reference
            assert max(abs(s) for s in score.values()) < 1e-5
        if pairs:
            z = torch.tensor([BETA * (score[i["uid"]] - score[j["uid"]]) for i, j in pairs], dtype=torch.float64)
            expected = -float(torch.nn.functional.logsigmoid(z).mean())
            assert steps[step][PREF_LOSS] == pytest.approx(expected, rel=1e-4, abs=1e-6), step
            if step == 1:
                assert expected == pytest.approx(math.log(2), abs=1e-5)


def checkpoint_tensors(actor: Path) -> dict[str, torch.Tensor]:
    """verl's FSDP checkpoint of one rank (world size 1: each DTensor's local shard is the whole tensor)."""
    raw = torch.load(actor / "model_world_size_1_rank_0.pt", map_location="cpu", weights_only=False)
    return {k: (v.to_local() if hasattr(v, "to_local") else v).float() for k, v in raw.items()}


def checkpoint_policy_state(actor: Path) -> dict[str, torch.Tensor]:
    """HF state dict of the trained policy, rebuilt by hand from verl's FSDP checkpoint: W + alpha / r * B A,
    every tensor first rounded to bfloat16, the dtype verl's merger writes (save_hf_model_and_tokenizer)."""
    raw = {k: v.to(torch.bfloat16).float() for k, v in checkpoint_tensors(actor).items()}
    meta = json.loads((actor / "lora_train_meta.json").read_text())
    scale = meta["lora_alpha"] / meta["r"]
    state = {}
    for key, value in raw.items():
        if "lora_" in key:
            continue
        name = key.removeprefix("base_model.model.").replace(".base_layer.", ".")
        if ".base_layer." in key:
            module = key.split(".base_layer.")[0]
            value = value + scale * raw[f"{module}.lora_B.default.weight"] @ raw[f"{module}.lora_A.default.weight"]
        state[name] = value
    return state


def response_log_probs(model, ids: list[int], prompt_len: int) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, prompt_len - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[prompt_len:])[:, None]).squeeze(-1)


def test_merged_models_reproduce_the_checkpoints_policy_on_a_dumped_response(pipeline):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from amir_verl.evaluation.analyses import load_model

    work, _ = pipeline
    base = work / "models" / "smollm2_cold_start"
    tokenizer = AutoTokenizer.from_pretrained(base)
    for variant in RUNS:
        actor = run_dir(work, variant) / "checkpoints" / f"global_step_{SIZE.steps}" / "actor"
        by_hand = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        missing, unexpected = by_hand.load_state_dict(checkpoint_policy_state(actor), strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # tied to the embedding
        by_hand.tie_weights()
        merged, _ = load_model(str(work / "merged" / variant))
        row = dump(run_dir(work, variant) / "rollout", SIZE.steps)[0]
        prompt = tokenizer(row["input"], add_special_tokens=False)["input_ids"]
        ids = prompt + tokenizer(row["output"], add_special_tokens=False)["input_ids"]
        expected, got = response_log_probs(by_hand, ids, len(prompt)), response_log_probs(merged, ids, len(prompt))
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        from safetensors.torch import load_file

        adapter = load_file(str(work / "merged" / variant / "lora_adapter" / "adapter_model.safetensors"))
        trained = {k: v for k, v in checkpoint_tensors(actor).items() if "lora_B" in k}
        assert len(trained) == 210 and all(float(v.abs().max()) > 0 for v in trained.values())  # it trained
        for key, value in trained.items():
            torch.testing.assert_close(adapter[key.replace(".default.", ".")].float(), value.to(torch.bfloat16).float())


def unbiased_pass_at_k(n: int, c: int, k: int) -> float:
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def test_every_amir_eval_output_exists_and_pass_at_k_is_the_count_from_the_dump(pipeline):
    work, _ = pipeline
    results = work / "results"
    stem = "GRPO_vs_AMIR-GRPO"
    for name in (f"passk_{stem}.csv", f"passk_{stem}.md", f"calibration_{stem}.csv", f"calibration_{stem}.png",
                 f"lengths_{stem}.csv", f"lengths_{stem}.png", f"coverage_base_vs_{stem}.csv",
                 f"coverage_base_vs_{stem}_patterns.csv", f"coverage_base_vs_{stem}.png", f"margin_{stem}.csv",
                 f"margin_{stem}.png", f"perplexity_{stem}.csv", f"perplexity_{stem}.png"):
        assert (results / name).stat().st_size > 0, name
    table = list(csv.DictReader((results / f"passk_{stem}.csv").open()))
    for variant, label in RUNS.items():
        rows = dump(run_dir(work, variant) / "validation", SIZE.steps)
        outcomes: dict[tuple[str, str], list[bool]] = {}
        for row in rows:
            outcomes.setdefault((row["data_source"], str(row["problem_id"])), []).append(row["acc"] == 1.0)
        sources = sorted({source for source, _ in outcomes})
        assert len(sources) == 7
        for source in sources:
            problems = [v for (s, _), v in outcomes.items() if s == source]
            assert all(len(v) == 8 for v in problems)
            for k in (1, 2, 4):
                expected = 100 * sum(unbiased_pass_at_k(8, sum(v), k) for v in problems) / len(problems)
                line = next(r for r in table if r["benchmark"] == DISPLAY_NAMES.get(source, source) and r["k"] == str(k))
                assert float(line[f"{label}_pass_at_k_pct"]) == pytest.approx(expected, abs=1e-3), (source, k)


def test_the_summary_states_what_the_runs_did_computed_from_their_files(pipeline):
    """Each figure of the summary's "what AMIR-GRPO did" lines, recomputed here from the dumps, the metrics and
    the merged models' weights."""
    from amir_verl.evaluation.analyses import load_model

    work, stdout = pipeline
    summary = (work / "summary.md").read_text()
    assert summary.strip() in stdout
    amir, last = metrics(work, "amir_grpo"), SIZE.steps
    first = [dump(run_dir(work, variant) / "rollout", 1) for variant in RUNS]
    # everything the two policies generated after the first update: training from step 2 on, the last validation
    later = {f"step {step}": [dump(run_dir(work, variant) / "rollout", step) for variant in RUNS]
             for step in range(2, last + 1)}
    later[f"the step-{last} validation"] = [dump(run_dir(work, variant) / "validation", last) for variant in RUNS]
    def same(a: list[dict], b: list[dict]) -> int:  # responses of a with an identical one (same prompt) in b, each used once
        rest = [(r["input"], r["output"]) for r in b]
        found = 0
        for row in a:
            if (row["input"], row["output"]) in rest:
                rest.remove((row["input"], row["output"]))
                found += 1
        return found

    assert (f"- Start: GRPO and AMIR-GRPO loaded the same initial adapter ({work / 'models' / 'lora_init'}); their "
            f"step-1 rollouts are identical in {same(*first)} of {len(first[1])} responses.") in summary
    pairs = [int(amir[s][NUM_PAIRS]) for s in range(1, last + 1)]
    shifts = [f"{amir[s][PREF_LOSS] - math.log(2):+.2e}" if amir[s][NUM_PAIRS] else "-" for s in range(1, last + 1)]
    assert (f"- AMIR-GRPO mined {', '.join(map(str, pairs))} pairs at steps 1-{last}; amir/pref_loss minus log 2 per "
            f"step: {', '.join(shifts)}.") in summary
    grpo_weights, amir_weights = (load_model(str(work / "merged" / variant))[0].state_dict() for variant in RUNS)
    difference = max(float((grpo_weights[k] - amir_weights[k]).abs().max()) for k in grpo_weights)
    assert (f"- Merged models: the largest effective weight difference, AMIR-GRPO against GRPO, is {difference:.2e} "
            f"(over {len(grpo_weights)} tensors).") in summary
    counts = {where: (same(*dumps), len(dumps[1])) for where, dumps in later.items()}
    assert ("- Identical responses, AMIR-GRPO against GRPO: "
            + "; ".join(f"{where}: {n} of {total}" for where, (n, total) in counts.items()) + ".") in summary
    verdicts = ["mined no pair", "did not change what the policy generates", "policy departed from GRPO's:",
                "The responses cannot tell whether"]
    assert sum(v in summary for v in verdicts) == 1
    expected = (0 if not any(pairs) else 3 if same(*first) < len(first[1]) else
                1 if all(n == total for n, total in counts.values()) else 2)
    assert verdicts[expected] in summary
    for label in RUNS.values():
        assert f"| {label} |" in summary and f"- {label}: preference margin" in summary
    assert "one correct response more or less moves a benchmark's accuracy by 6.2 to 12.5 points" in summary


def test_summary_json_holds_each_runs_figures_from_the_files(pipeline):
    """What the study reads: the last step's reward, the benchmarks' mean validation accuracy, and the mean
    margin and pair accuracy of amir-eval margin's CSV (or null where it had nothing to measure)."""
    from amir_verl import run_figures

    work, _ = pipeline
    figures = run_figures.read_summary(work)["runs"]
    margins = list(csv.DictReader((work / "results" / "margin_GRPO_vs_AMIR-GRPO.csv").open()))
    for variant, label in RUNS.items():
        steps = metrics(work, variant)
        accuracies = [v for k, v in steps[SIZE.steps].items() if k.startswith("val-core/") and "/acc/mean@" in k]
        assert figures[label][run_figures.REWARD] == steps[SIZE.steps][REWARD]
        assert figures[label][run_figures.VALIDATION_ACCURACY] == pytest.approx(sum(accuracies) / len(accuracies))
        rows = [r for r in margins if r["run"] == label]
        for figure in (run_figures.MARGIN, run_figures.PAIR_ACCURACY):
            expected = sum(float(r[figure]) for r in rows) / len(rows) if rows else None
            assert figures[label][figure] == (pytest.approx(expected) if rows else None), (label, figure)
