"""Every paper recipe composes against verl 0.9.1's own config and passes verl's validation (no launch); the
official-run recipes match the table "The official run, point by point" (docs/paper.md) row by row; the Gemma-3 LoRA
targets wrap the language model only."""

import copy
import importlib.machinery
import os
import re
import subprocess
import sys
import types
from functools import cache
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from amir_verl.config import RULE_KEYS, AmirConfig
from amir_verl.run_config import validate_amir_run
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import validate_config

from tests.support import RECIPES, compose_recipe

ROOT = Path(__file__).resolve().parents[1]
RUN_SH = RECIPES / "paper" / "run.sh"
MODELS = ["Qwen/Qwen2.5-3B-Instruct", "Qwen/Qwen2.5-7B-Instruct", "google/gemma-3-4b-it"]
RUN_MODELS = {"qwen2.5-3b": MODELS[0], "qwen2.5-7b": MODELS[1], "gemma-3-4b": MODELS[2]}  # run.sh's names
VARIANTS = ["grpo", "amir_grpo", "gspo", "amir_gspo"]
OFFICIAL_VARIANTS = ["official_grpo", "official_amir_grpo"]
SEVEN = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}  # AMIR Train/models.py


def model_overrides(model):
    """What run.sh adds for a model with its own settings (recipes/config/paper_model/MODEL.yaml)."""
    name = {v: k for k, v in RUN_MODELS.items()}.get(model, model)
    return [f"+paper_model={name}"] if (RECIPES / "config" / "paper_model" / f"{name}.yaml").exists() else []


@pytest.fixture
def vllm_lora_check(monkeypatch):
    """The GPU machine the recipes are for, as far as validation looks: verl's validate_config ends with vLLM's
    LoRA-rank check, which imports vllm (a GPU extra, not installed on CPU), so record the rank it is asked about
    instead; and the plugin's check that flash-attn (verl's default attention, a GPU extra) is installed finds it."""
    asked = []
    fake = types.ModuleType("verl.workers.rollout.vllm_rollout.utils")
    fake.get_vllm_max_lora_rank = asked.append
    monkeypatch.setitem(sys.modules, "verl.workers.rollout.vllm_rollout.utils", fake)
    flash_attn = types.ModuleType("flash_attn")
    flash_attn.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)  # importlib.util.find_spec finds it
    monkeypatch.setitem(sys.modules, "flash_attn", flash_attn)
    return asked


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_recipe_composes_and_validates(variant, model, vllm_lora_check):
    config = compose_recipe(variant, model, ["trainer.n_gpus_per_node=4", "trainer.nnodes=2", *model_overrides(model)])
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    assert vllm_lora_check == [16]
    assert config.actor_rollout_ref.model.lora_rank == 16 and config.actor_rollout_ref.model.lora_alpha == 16
    assert config.actor_rollout_ref.actor.optim.lr == 5e-6 and config.actor_rollout_ref.rollout.n == 8
    assert config.data.max_prompt_length + config.data.max_response_length == 2048
    val = config.actor_rollout_ref.rollout.val_kwargs
    assert (val.n, val.temperature, val.top_p) == (8, 0.6, 1.0) and len(config.data.val_files) == 7
    assert config.trainer.validation_data_dir  # generations are dumped for the evaluation CLI
    if variant.startswith("amir"):
        amir = validate_amir_run(config)
        assert amir.reference == "ref"
        # the official code's lambda rule and constants, so that the recipes reproduce the official runs
        rule = amir.lambda_settings()
        assert (rule.rule, rule.lambda_init, rule.lambda_min, rule.lambda_max, rule.target_low, rule.target_high) == (
            "loss_ratio", 0.01, 0.005, 0.05, 0.3, 0.7)


def differences(a, b, path=""):
    """The dotted keys where two plain containers differ (a key missing on one side counts)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in a.keys() | b.keys() for d in differences(a.get(k), b.get(k), f"{path}.{k}" if path else k)]
    return [] if a == b else [path]


@pytest.mark.parametrize(("base", "amir_keys"), [
    ("grpo", {"lambda_rule": "loss_ratio"}),
    ("gspo", {"lambda_rule": "loss_ratio"}),
    ("official_grpo", {"lambda_rule": "loss_ratio", "reference": "ref_free", "beta_dpo": 0.2}),
])
def test_amir_variant_differs_from_its_baseline_only_by_the_amir_overrides(base, amir_keys):
    amir_variant = base.replace("grpo", "amir_grpo") if base.startswith("official") else f"amir_{base}"
    baseline = OmegaConf.to_container(compose_recipe(base, MODELS[0]))
    amir = OmegaConf.to_container(compose_recipe(amir_variant, MODELS[0]))
    assert amir.pop("amir") == amir_keys and "amir" not in baseline
    assert sorted(differences(baseline, amir)) == [
        "actor_rollout_ref.actor.policy_loss.loss_mode", "trainer.v1.trainer_mode"
    ]


def test_launch_script_names_the_configs():
    script = RUN_SH.read_text()
    assert '--config-name="paper_${VARIANT}"' in script
    for variant in VARIANTS + OFFICIAL_VARIANTS:
        assert (RECIPES / "config" / f"paper_{variant}.yaml").exists()
        assert variant in script.split("set -euo pipefail")[0]  # the usage names it


# ---------------------------------------------------------------------------------------------------------------
# recipes/paper/run.sh, run for real with python3 replaced by a recorder: the arguments it would launch
# main_ppo with, composed here exactly as main_ppo's hydra would (no launch, no GPU)


def run_script(tmp_path, model, variant, *extra, env=None, bitsandbytes=True):
    """Run run.sh; return (exit code, stderr, main_ppo's argv or None when it was not launched, AMIR_EXPERIMENT)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    record = tmp_path / f"argv_{model}_{variant}_{len(list(tmp_path.iterdir()))}"
    shim = bin_dir / "python3"  # `python3 -c "import bitsandbytes"` answers as told; `python3 -m ...` records
    shim.write_text('#!/bin/sh\nif [ "$1" = "-c" ]; then exit "$FAKE_BNB_RC"; fi\n'
                    'printf \'%s\\n\' "$AMIR_EXPERIMENT" "$@" > "$RECORD"\n')
    shim.chmod(0o755)
    run_env = {k: v for k, v in os.environ.items() if k not in ("BETA", "NGPUS", "NNODES", "MODEL_PATH")}
    run_env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", RECORD=str(record), FAKE_BNB_RC="0" if bitsandbytes else "1")
    run_env.update(env or {})
    done = subprocess.run(["bash", str(RUN_SH), model, variant, *extra], env=run_env, capture_output=True, text=True,
                          timeout=60)
    if not record.exists():
        return done.returncode, done.stderr, None, None
    experiment, *argv = record.read_text().splitlines()
    return done.returncode, done.stderr, argv, experiment


def compose_argv(argv):
    """The config, unresolved, that main_ppo's hydra composes from run.sh's argv (--config-path, --config-name,
    the overrides)."""
    assert argv[:2] == ["-m", "verl.trainer.main_ppo"], argv
    options = dict(a[2:].split("=", 1) for a in argv[2:] if a.startswith("--"))
    overrides = [a for a in argv[2:] if not a.startswith("--")]
    with initialize_config_dir(config_dir=options["config-path"], version_base=None):
        return compose(config_name=options["config-name"], overrides=overrides)


@cache
def launched(model, variant, beta=None):
    """run.sh MODEL VARIANT (BETA=beta if given, bitsandbytes present): its config, unresolved, and the
    AMIR_EXPERIMENT it exports."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        rc, err, argv, experiment = run_script(Path(tmp), model, variant, env={"BETA": beta} if beta else None)
    assert rc == 0 and argv is not None, err
    assert experiment == f"{model}_{variant}"
    return compose_argv(argv), experiment


@cache
def launched_config(model, variant, beta=None, resolve=True):
    """run.sh's config, resolved as main_ppo resolves it (with the AMIR_EXPERIMENT run.sh exports, which the
    recipes read through oc.env), or unresolved (interpolations such as critic.loss_agg_mode, the actor's, then
    stay as written)."""
    config, experiment = launched(model, variant, beta)
    if not resolve:
        return config
    config = copy.deepcopy(config)
    saved = os.environ.get("AMIR_EXPERIMENT")
    os.environ["AMIR_EXPERIMENT"] = experiment
    try:
        OmegaConf.resolve(config)
    finally:
        if saved is None:
            os.environ.pop("AMIR_EXPERIMENT")
        else:
            os.environ["AMIR_EXPERIMENT"] = saved
    return config


def test_run_sh_beta(tmp_path):
    """amir_grpo: beta_dpo per model; official_amir_grpo: the official command's 0.2 on every model; BETA= both."""
    for model, beta in [("qwen2.5-3b", 0.1), ("qwen2.5-7b", 0.2), ("gemma-3-4b", 0.1)]:
        assert launched_config(model, "amir_grpo").amir.beta_dpo == beta
        assert launched_config(model, "official_amir_grpo").amir.beta_dpo == 0.2
    assert launched_config("qwen2.5-7b", "official_amir_grpo", "0.05").amir.beta_dpo == 0.05
    assert launched_config("qwen2.5-7b", "amir_grpo", "0.05").amir.beta_dpo == 0.05
    config = launched_config("gemma-3-4b", "official_amir_grpo")
    assert config.actor_rollout_ref.model.path == "google/gemma-3-4b-it"
    assert config.trainer.experiment_name == "gemma-3-4b_official_amir_grpo"
    assert config.trainer.validation_data_dir.endswith("gemma-3-4b_official_amir_grpo/validation")


@pytest.mark.parametrize("variant", OFFICIAL_VARIANTS)
def test_run_sh_refuses_the_official_run_without_bitsandbytes(tmp_path, variant):
    rc, err, argv, _ = run_script(tmp_path, "gemma-3-4b", variant, bitsandbytes=False)
    assert rc == 2 and argv is None  # main_ppo never started
    assert "bitsandbytes" in err and "pip install bitsandbytes" in err
    # choosing another optimizer on the command line is the way out (and a stated difference)
    rc, err, argv, _ = run_script(tmp_path, "gemma-3-4b", variant, "actor_rollout_ref.actor.optim.optimizer=AdamW",
                                  "actor_rollout_ref.actor.optim.optimizer_impl=torch.optim", bitsandbytes=False)
    assert rc == 0 and argv[-1] == "actor_rollout_ref.actor.optim.optimizer_impl=torch.optim", err
    # the paper recipes do not need it
    rc, err, argv, _ = run_script(tmp_path, "gemma-3-4b", "grpo", bitsandbytes=False)
    assert rc == 0 and argv is not None, err


def test_run_sh_refuses_an_unknown_variant(tmp_path):
    rc, err, argv, _ = run_script(tmp_path, "qwen2.5-3b", "official_gspo")
    assert rc == 2 and argv is None and "unknown variant official_gspo" in err


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("variant", OFFICIAL_VARIANTS)
@pytest.mark.parametrize("gpus", [(1, 1), (4, 2)])  # the official single GPU; two nodes
def test_official_recipe_composes_and_validates(variant, model, gpus, vllm_lora_check):
    config = compose_recipe(variant, model, [f"trainer.n_gpus_per_node={gpus[0]}", f"trainer.nnodes={gpus[1]}",
                                             *model_overrides(model)])
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    assert vllm_lora_check == [16]
    assert not need_reference_policy(config)  # as TRL with beta 0: no reference model at all
    if variant == "official_amir_grpo":
        amir = validate_amir_run(config)
        assert amir.reference_free and amir.lambda_settings().lambda_init == 0.01


# ---------------------------------------------------------------------------------------------------------------
# The table "The official run, point by point" of docs/paper.md: one definition, read here, checked against run.sh's configs

CELL_VALUE = re.compile(r"(?:([\w.\-]+) )?`([^`]*)`")


def official_run_table():
    """The table's rows (docs/paper.md): dicts with the six cells, by header."""
    text = (ROOT / "docs" / "paper.md").read_text()
    section = text.split("### The official run, point by point", 1)[1]
    lines = section[section.index("\n|"):].strip().splitlines()
    table = []
    for line in lines:
        if not line.startswith("|"):
            break
        table.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    header, rule, *rows = table
    assert header == ["official setting", "official run", "key", "official recipes", "paper recipes",
                      "why they differ"]
    assert set(rule) == {"---"} and all(len(row) == len(header) for row in rows), "a cell holds a stray |"
    return [dict(zip(header, row)) for row in rows]


def cell_values(cell):
    """A recipe cell: `value` (every model and variant), or `label` `value` pairs, a label being a run.sh model
    or a variant kind (grpo, amir). The values are YAML, read as hydra reads the recipes."""
    found = CELL_VALUE.findall(cell)
    assert found and CELL_VALUE.sub("", cell).replace(",", "").strip() == "", f"unreadable cell {cell!r}"
    values = {}
    for label, literal in found:
        assert label in ("", "grpo", "amir", *RUN_MODELS), f"unknown label {label!r} in {cell!r}"
        value = OmegaConf.create(f"v: {literal}").v
        values[label] = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
    return values


def expected_value(values, model, variant):
    kind = "amir" if "amir" in variant else "grpo"
    chosen = [values[label] for label in ("", kind, model) if label in values]
    assert len(chosen) <= 1, f"{values} gives {model} {variant} two values"
    return chosen[0] if chosen else KeyError


def effective_value(config, key):
    """The value a run gets: the config's, and for amir keys AmirConfig's (its defaults, a rule's null keys
    filled in), as the trainer reads them."""
    if key.startswith("amir."):
        amir = AmirConfig.from_mapping(config.get("amir"))
        field = key.removeprefix("amir.")
        if field in RULE_KEYS:
            renamed = {"target_ratio_low": "target_low", "target_ratio_high": "target_high"}
            return getattr(amir.lambda_settings(), renamed.get(field, field))
        return getattr(amir, field)
    value = OmegaConf.select(config, key, throw_on_missing=True)
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def table_keys():
    keys = [CELL_VALUE.fullmatch(row["key"]).group(2) for row in official_run_table()]
    assert len(keys) == len(set(keys)), "a key has two rows"
    return keys


def test_official_run_table_rows_are_complete():
    rows = official_run_table()
    assert len(rows) >= 40
    for row in rows:
        assert row["official setting"] and row["official run"], row
        assert CELL_VALUE.fullmatch(row["key"]), f"the key cell is one `key`: {row}"
        if row["official recipes"] != row["paper recipes"]:
            assert row["why they differ"], f"the recipes differ without a reason: {row}"


@pytest.mark.parametrize("model", RUN_MODELS)
@pytest.mark.parametrize("column,variants", [("official recipes", OFFICIAL_VARIANTS),
                                             ("paper recipes", ["grpo", "amir_grpo"])])
def test_official_run_table_matches_the_recipes(model, column, variants):
    for row in official_run_table():
        key = CELL_VALUE.fullmatch(row["key"]).group(2)
        values = cell_values(row[column])
        for variant in variants:
            if key.startswith("amir.") and "amir" not in variant:
                assert "grpo" not in values, f"a GRPO run has no amir keys: {row}"
                continue  # the row is the AMIR variant's
            expected = expected_value(values, model, variant)
            assert expected is not KeyError, f"{row} gives {model} {variant} no value"
            actual = effective_value(launched_config(model, variant), key)
            assert actual == expected and type(actual) is type(expected) or (
                isinstance(actual, (int, float)) and not isinstance(actual, bool) and actual == expected
            ), f"{column}, {model} {variant}: {key} is {actual!r}, docs/paper.md's table says {expected!r}"


@pytest.mark.parametrize("model", RUN_MODELS)
def test_official_run_table_lists_every_difference(model):
    """Every key where the official recipe differs from the paper recipe has a row (the experiment's name and the
    folders named after it aside), so a setting added to either recipe fails here until the table says why."""
    keys = set(table_keys())
    named_after_run = {"trainer.experiment_name", "trainer.validation_data_dir", "trainer.default_local_dir"}
    for paper, official in [("grpo", "official_grpo"), ("amir_grpo", "official_amir_grpo")]:
        changed = set(differences(OmegaConf.to_container(launched_config(model, paper, resolve=False)),
                                  OmegaConf.to_container(launched_config(model, official, resolve=False))))
        changed -= named_after_run
        assert changed - keys == set(), f"{paper} vs {official}: not in docs/paper.md's table"


# ---------------------------------------------------------------------------------------------------------------
# Gemma-3-4b-it: what verl 0.9.1 loads, and where the recipes' LoRA keys put adapters (docs/paper.md, "Gemma-3-4b-it")


def tiny_gemma3_config():
    from transformers import Gemma3Config

    return Gemma3Config(  # google/gemma-3-4b-it's layout (no SigLIP head), tiny
        text_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 300, "sliding_window": 8},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": 28, "patch_size": 14, "vision_use_head": False},
        mm_tokens_per_image=4, image_token_index=299, boi_token_index=297, eoi_token_index=298,
        architectures=["Gemma3ForConditionalGeneration"])


def tiny_model(family):
    """A tiny model of the class verl's FSDP engine would load for this family's checkpoint."""
    from transformers import Qwen2Config

    from verl.utils.model import get_hf_auto_model_class

    if family == "gemma3":
        config = tiny_gemma3_config()
    else:
        config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, vocab_size=300, architectures=["Qwen2ForCausalLM"])
    return get_hf_auto_model_class(config).from_config(config)


def lora_wrapped(family, model_keys):
    """The modules verl's own FSDPEngine._build_lora_module puts adapters on, given the recipe's model keys."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    model_config = types.SimpleNamespace(lora_adapter_path=None, target_parameters=None, **model_keys)
    module = FSDPEngine._build_lora_module(types.SimpleNamespace(model_config=model_config), tiny_model(family))
    return {name.removeprefix("base_model.model.") for name, sub in module.named_modules() if hasattr(sub, "lora_A")}


def recipe_lora_keys(variant, model):
    model_config = launched_config(model, variant).actor_rollout_ref.model  # as run.sh composes it
    return {"lora_rank": model_config.lora_rank, "lora_alpha": model_config.lora_alpha,
            "target_modules": model_config.target_modules, "exclude_modules": model_config.exclude_modules}


def test_verl_loads_gemma3_whole():
    """verl picks the class by the checkpoint's config: the multimodal one, vision tower included."""
    from transformers import AutoModelForImageTextToText

    from verl.utils.model import get_hf_auto_model_class

    assert get_hf_auto_model_class(tiny_gemma3_config()) is AutoModelForImageTextToText
    model = tiny_model("gemma3")
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    assert {"vision_tower", "multi_modal_projector", "language_model"} <= {n for n, _ in model.model.named_children()}


@pytest.mark.parametrize("family,model", [("gemma3", "gemma-3-4b"), ("qwen2", "qwen2.5-3b"), ("qwen2", "qwen2.5-7b")])
@pytest.mark.parametrize("variant", ["amir_grpo", "official_amir_grpo"])  # their GRPO twins: the same model keys
def test_recipe_lora_wraps_the_seven_projections_of_the_language_model(family, model, variant):
    wrapped = lora_wrapped(family, recipe_lora_keys(variant, model))
    layers = {name.rsplit(".", 2)[0] for name in wrapped}  # ...layers.N
    assert {name.rsplit(".", 1)[1] for name in wrapped} == SEVEN and len(wrapped) == 7 * 2 and len(layers) == 2
    assert all(".vision_tower." not in name for name in wrapped)
    if family == "gemma3":
        assert all(name.startswith("model.language_model.layers.") for name in wrapped)


@pytest.mark.parametrize("target_modules", ["all-linear", sorted(SEVEN)])
def test_without_the_exclusion_lora_would_wrap_gemma3s_vision_tower(target_modules):
    """Why the recipes set exclude_modules: all-linear, and even the official seven names, reach the SigLIP tower."""
    wrapped = lora_wrapped("gemma3", {"lora_rank": 16, "lora_alpha": 16, "target_modules": target_modules,
                                      "exclude_modules": None})
    tower = {name.rsplit(".", 1)[1] for name in wrapped if ".vision_tower." in name}
    assert tower == ({"q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"} if target_modules == "all-linear"
                     else {"q_proj", "k_proj", "v_proj"})
    assert not any(".multi_modal_projector." in name for name in wrapped)  # it has no nn.Linear


@pytest.mark.parametrize("variant", VARIANTS + OFFICIAL_VARIANTS)
def test_the_gemma_recipe_is_the_qwen_recipe_with_lora_off_the_vision_tower(variant):
    gemma = OmegaConf.to_container(launched_config("gemma-3-4b", variant, beta="0.1", resolve=False))
    qwen = OmegaConf.to_container(launched_config("qwen2.5-3b", variant, beta="0.1", resolve=False))
    assert set(differences(gemma, qwen)) == {"actor_rollout_ref.model.path", "actor_rollout_ref.model.exclude_modules"}
    assert gemma["actor_rollout_ref"]["model"]["exclude_modules"] == ".*vision_tower.*"
