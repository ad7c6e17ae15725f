"""Model prep (``python -m amir_verl.models smollm2``): the registry's SmolLM2-135M-Instruct GGUF -> an HF folder.

Checked against independent computations: every weight against the ``gguf`` package's own dequantisation
of its tensor (with llama.cpp's rotary permutation of q/k undone here), the chat template against the GGUF's
template rendered by plain jinja2, and the stop token by greedy generation.
"""

import json
import shutil

import jinja2
import numpy as np
import pytest
import torch
from gguf.quants import dequantize
from safetensors.numpy import load_file

from amir_verl.models import ModelPrepError, check_special_tokens, gguf_reader, gguf_special_tokens, smollm2_gguf

# GGUF tensor name (blk.N.<name>) -> HF parameter name (model.layers.N.<name>)
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    _, layer, name, suffix = gguf_name.split(".")
    return f"model.layers.{layer}.{LAYER_NAMES[name]}.{suffix}"


def undo_rope_permutation(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter stores q/k rows per head as interleaved (x0, y0, x1, y1, ...) pairs; HF keeps the
    two halves of each head apart (x0, x1, ..., y0, y1, ...)."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(weight.shape)


def test_every_weight_equals_the_gguf_packages_dequantisation(smollm2):
    reader = gguf_reader(smollm2_gguf())
    heads = int(reader.fields["llama.attention.head_count"].contents())
    kv_heads = int(reader.fields["llama.attention.head_count_kv"].contents())
    weights = load_file(str(smollm2 / "model.safetensors"))
    seen = set()
    for tensor in reader.tensors:
        expected = dequantize(tensor.data, tensor.tensor_type).reshape([int(d) for d in reversed(tensor.shape)])
        if ".attn_q." in tensor.name:
            expected = undo_rope_permutation(expected, heads)
        elif ".attn_k." in tensor.name:
            expected = undo_rope_permutation(expected, kv_heads)
        name = hf_name(tensor.name)
        assert name in weights, name
        np.testing.assert_array_equal(weights[name], expected.astype(np.float32), err_msg=name)
        seen.add(name)
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["tie_word_embeddings"] and "lm_head.weight" not in weights  # the GGUF has no output.weight
    assert seen == set(weights), set(weights) ^ seen
    assert sum(w.size for w in weights.values()) == 134_515_008


def test_special_tokens_come_from_the_gguf_metadata_and_agree_everywhere(smollm2):
    declared = gguf_special_tokens(smollm2_gguf())
    assert declared == {"bos": "<|im_start|>", "eos": "<|im_end|>", "pad": "<|im_end|>", "unk": "<|endoftext|>"}
    assert check_special_tokens(smollm2) == {"bos": 1, "eos": 2, "pad": 2}


def test_a_folder_whose_tokens_disagree_is_refused_naming_the_file(smollm2, tmp_path):
    for item in smollm2.iterdir():
        if item.suffix != ".safetensors":
            shutil.copy(item, tmp_path / item.name)
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    generation["eos_token_id"] = 1  # what a naive conversion's tokenizer says
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    with pytest.raises(ModelPrepError, match="eos token is 2, generation_config.json says 1"):
        check_special_tokens(tmp_path)


def test_the_chat_template_renders_as_the_ggufs_own(smollm2):
    from transformers import AutoTokenizer

    template = gguf_reader(smollm2_gguf()).fields["tokenizer.chat_template"].contents()
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    for messages in ([{"role": "user", "content": "What is 2 + 3?"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]):
        for add_generation_prompt in (True, False):
            expected = jinja2.Template(template).render(messages=messages, add_generation_prompt=add_generation_prompt)
            got = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
            assert got == expected
    assert expected.endswith("<|im_end|>\n") and "<|im_start|>assistant\nHello.<|im_end|>" in expected


def test_greedy_generation_stops_at_im_end(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Say hello in one word."}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=48, do_sample=False)
    response = out[0, prompt["input_ids"].shape[1]:].tolist()
    assert response[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    assert len(response) < 48 and 2 not in response[:-1]
    assert tokenizer.decode(response, skip_special_tokens=True).strip()


def test_a_local_hf_folder_is_copied_with_its_special_tokens_agreeing(tmp_path):
    """The same command on a local HF folder (as on a hub id): the folder it writes passes the token check."""
    from amir_verl.demo.toy_task import make_assets
    from amir_verl.models import main

    source = make_assets(tmp_path / "toy", n_train=2, n_test=2)["model"]
    assert main([source, "--out", str(tmp_path / "out")]) == 0
    ids = check_special_tokens(tmp_path / "out")
    assert ids["eos"] is not None and ids["pad"] is not None
    assert main([source, "--out", str(tmp_path / "out")]) == 1  # an existing folder is never overwritten


def test_transformers_gguf_loading_reuses_the_one_reader_of_the_file(monkeypatch):
    """transformers' ``load_gguf_checkpoint`` (which model prep's tokenizer, config, model and generation-config
    loads each call) builds a ``GGUFReader`` per call; under ``transformers_reads_gguf_once`` it takes the one
    :func:`gguf_reader` holds. Fails if transformers stops finding the class on the ``gguf`` package."""
    import gguf.gguf_reader
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from amir_verl.models import transformers_reads_gguf_once

    path = smollm2_gguf()
    shared = gguf_reader(path)
    built = []
    real_init = gguf.gguf_reader.GGUFReader.__init__
    monkeypatch.setattr(gguf.gguf_reader.GGUFReader, "__init__",
                        lambda self, *args, **kwargs: built.append(args) or real_init(self, *args, **kwargs))
    with transformers_reads_gguf_once():
        inside = load_gguf_checkpoint(str(path))["config"]
        assert gguf_reader(str(path)) is shared  # one per file, whichever way the path is spelled
    assert built == []
    outside = load_gguf_checkpoint(str(path))["config"]  # the control: a reader of its own
    assert len(built) == 1
    assert inside == outside
    import gguf as gguf_package

    assert gguf_package.GGUFReader is gguf.gguf_reader.GGUFReader  # put back
