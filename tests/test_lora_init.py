"""amir_verl.lora_init: the initial adapter that runs to compare load through verl's lora_adapter_path, as
verl's FSDP engine loads it, and the driver's check that the run's lora_rank / lora_alpha agree with it."""

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from amir_verl.demo.toy_task import make_assets
from amir_verl.lora_init import main as lora_init
from amir_verl.run_config import check_any_run
from tests.support import GRPO, compose_verl

SDPA = "+actor_rollout_ref.model.override_config.attn_implementation=sdpa"


@pytest.fixture(scope="module")
def toy_model(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("toy"), n_train=2, n_test=2)["model"]


def test_the_seed_fixes_the_adapter_and_verls_engine_loads_it_trainable_as_written(toy_model, tmp_path):
    from transformers import AutoModelForCausalLM
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    def write(name, seed):
        out = tmp_path / name
        assert lora_init(["--model", str(toy_model), "--rank", "4", "--alpha", "8", "--seed", str(seed),
                          "--out", str(out)]) == 0
        return out, load_file(str(out / "adapter_model.safetensors"))

    (first, a), (_, again), (_, other) = write("a", 0), write("again", 0), write("other", 1)
    lora_a = [k for k in a if "lora_A" in k]
    assert lora_a and len(a) == 2 * len(lora_a)
    assert all(torch.equal(a[k], again[k]) for k in a)  # the same seed, the same adapter
    assert all(not torch.equal(a[k], other[k]) for k in lora_a)  # another seed, other A matrices
    assert all(float(v.abs().max()) == 0 for k, v in a.items() if "lora_B" in k)  # the policy starts as the base

    # verl's own loading of lora_adapter_path (FSDPEngine._build_lora_module), on the engine's model config
    config = SimpleNamespace(lora_adapter_path=str(first), use_shm=False)
    module = FSDPEngine._build_lora_module(SimpleNamespace(model_config=config),
                                           AutoModelForCausalLM.from_pretrained(toy_model, dtype=torch.float32))
    loaded = {k.replace(".default", ""): p for k, p in module.named_parameters() if "lora_" in k}
    assert sorted(loaded) == sorted(a)
    for key, value in a.items():
        assert loaded[key].requires_grad and torch.equal(loaded[key].detach(), value), key


def test_a_run_whose_lora_settings_disagree_with_its_adapter_stops_on_the_driver(toy_model, tmp_path):
    out = tmp_path / "adapter"
    assert lora_init(["--model", str(toy_model), "--rank", "4", "--alpha", "8", "--out", str(out)]) == 0
    start = [SDPA, f"+actor_rollout_ref.model.lora_adapter_path={out}"]
    check_any_run(compose_verl(GRPO + start + ["actor_rollout_ref.model.lora_rank=4",
                                               "actor_rollout_ref.model.lora_alpha=8"]))
    with pytest.raises(ValueError, match=r"lora_adapter_path=.* with lora_rank=0: verl's FSDP engine would ignore "
                                         r"the adapter and train full weights; set actor_rollout_ref\.model\.lora_rank=4"):
        check_any_run(compose_verl(GRPO + start))
    with pytest.raises(ValueError, match=r"has r=4, lora_alpha=8, but the run says lora_rank=16, lora_alpha=8"):
        check_any_run(compose_verl(GRPO + start + ["actor_rollout_ref.model.lora_rank=16",
                                                   "actor_rollout_ref.model.lora_alpha=8"]))


def test_a_model_that_is_not_there_is_a_clear_error(tmp_path, capsys):
    assert lora_init(["--model", str(tmp_path / "none"), "--rank", "4", "--alpha", "8", "--out", str(tmp_path / "o")]) == 2
    assert "amir_verl.lora_init: error:" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
