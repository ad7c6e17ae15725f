"""The CPU backend's patch 9 (:mod:`amir_verl.cpu.platform`): verl's Ulysses sequence parallelism with sdpa attention.

Two gloo processes form one SP group and run the toy model's packed forward (4 sequences in one row, as verl's
remove-padding path packs them) the way verl's FSDP engine does with ``ulysses_sequence_parallel_size=2``: the packed
row padded and sliced with ``ulysses_pad_and_slice_inputs``, the model called on the slice with
``attention_mask=None``, the logits gathered with ``gather_outputs_and_unpad`` (whose backward scales by the SP size),
each rank's gradient averaged over the two ranks as FSDP averages it. Compared with the same model's forward of the
whole packed row without SP. Without the patch (verl applies its all-to-all only to flash-attention) the logits are
far off; with it they and the gradient are the whole row's. The end-to-end run: tests/e2e/test_sequence_parallel_cpu.py.
"""

from __future__ import annotations

import socket

import torch
import torch.multiprocessing as mp

from amir_verl.cpu.platform import PATCHES, _patch_ulysses_sdpa
from tests.seams import fingerprint

LENGTHS = [5, 7, 6, 3]  # 21 tokens: the SP slice pads it to 22


def _forward(model, ids, pos, sp: bool):
    """(logits of the whole packed row, the gradient of their sum of logsumexp, averaged over the ranks)."""
    import torch.distributed as dist
    from verl.utils import ulysses

    model.zero_grad()
    if sp:
        ulysses.set_ulysses_sequence_parallel_group(dist.group.WORLD)
        local_ids, local_pos, pad = ulysses.ulysses_pad_and_slice_inputs(ids, pos, sp_size=dist.get_world_size())
        local = model(input_ids=local_ids, position_ids=local_pos, attention_mask=None, use_cache=False).logits
        logits = ulysses.gather_outputs_and_unpad(local[0], gather_dim=0, unpad_dim=0, padding_size=pad)
        ulysses.set_ulysses_sequence_parallel_group(None)
    else:
        logits = model(input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False).logits[0]
    logits.logsumexp(-1).sum().backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters()])
    if sp:
        dist.all_reduce(grad)
        grad /= dist.get_world_size()
    return logits.detach(), grad


def _rank(rank: int, port: int, model_dir: str, results):
    import sys

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    from verl.models.transformers.monkey_patch import apply_monkey_patch

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    apply_monkey_patch(model, ulysses_sp_size=2, use_remove_padding=True)
    ids = torch.randint(0, model.config.vocab_size, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    out = {"unpatched": _forward(model, ids, pos, sp=True)}
    _patch_ulysses_sdpa(sys.modules["verl.models.transformers.monkey_patch"])
    out["whole"] = _forward(model, ids, pos, sp=False)
    out["sp"] = _forward(model, ids, pos, sp=True)
    with torch.no_grad():  # each sequence on its own: what the packed row must give
        out["alone"] = torch.cat([model(input_ids=x, use_cache=False).logits[0] for x in ids.split(LENGTHS, 1)])
    results[rank] = out
    dist.destroy_process_group()


def test_ulysses_with_sdpa_gives_the_whole_rows_logits_and_gradient(tmp_path):
    from amir_verl.demo.toy_task import make_model, make_tokenizer

    make_model(tmp_path, make_tokenizer(tmp_path))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(port, str(tmp_path), results), nprocs=2)
        results = dict(results)
    for rank in (0, 1):
        out = results[rank]
        whole_logits, whole_grad = out["whole"]
        torch.testing.assert_close(whole_logits, out["alone"], rtol=0, atol=1e-5)  # transformers' packed mask
        # verl's Ulysses path alone: each rank's sdpa sees only its slice of the row
        assert float((out["unpatched"][0] - whole_logits).abs().max()) > 0.1
        sp_logits, sp_grad = out["sp"]
        torch.testing.assert_close(sp_logits, whole_logits, rtol=0, atol=1e-5)
        torch.testing.assert_close(sp_grad, whole_grad, rtol=0, atol=1e-5 * float(whole_grad.abs().max()))


# what patch 9 relies on: upstream object -> (sha256 prefix of its source in verl 0.9.1 / transformers 5.10.4, why)
ULYSSES_SEAMS = {
    "verl.models.transformers.monkey_patch.apply_monkey_patch": (
        "26dc9abe507b2eaf", "puts the Ulysses all-to-all around flash-attention only"),
    "verl.models.transformers.monkey_patch._ulysses_flash_attention_forward": (
        "5e68365bd576584d", "the all-to-alls and the condition patch 9 mirrors"),
    "transformers.integrations.sdpa_attention.sdpa_attention_forward": (
        "9123c5d5d025ecb2", "the function patch 9 wraps"),
    "transformers.masking_utils.find_packed_sequence_indices": (
        "ebd2ac7ca795dbb0", "the packed-sequence rule of patch 9's mask"),
}


def test_patch_9_is_registered_and_its_upstream_unchanged():
    import importlib

    assert PATCHES["verl.models.transformers.monkey_patch"] is _patch_ulysses_sdpa
    for name, (expected, why) in ULYSSES_SEAMS.items():
        module, attribute = name.rsplit(".", 1)
        assert fingerprint(getattr(importlib.import_module(module), attribute)) == expected, (
            f"{name} changed ({why}); re-check amir_verl/cpu/platform.py's patch 9")
