"""Device and dtype placement of the AMIR math (issue 24, item 5).

Every tensor the plugin makes (padding, permutations, index tensors, zeros/ones, masks, scalars) takes its
device from its inputs, and reduced-precision inputs (bf16 log-probs, rewards) never give reduced-precision
AMIR values. A CPU-only machine cannot put the inputs on a GPU, so three checks stand in for it:

- the data-independent math (everything the actor's share of the term computes) runs on the ``meta`` device:
  a tensor made on the CPU that meets the meta inputs raises, or leaves a CPU result;
- the data-dependent driver code (pair mining, the partner table, the step fields, the gradient signal,
  the actor's loss; ``bool(x.any())`` and ``nonzero`` cannot run on meta) runs on CPU inputs while every
  tensor that the plugin's modules make without naming a device is made on ``meta`` instead: it then cannot
  meet the CPU inputs, exactly as a CPU tensor cannot meet CUDA inputs;
- a scan of the modules' source for factory calls without ``device=`` (it also covers branches that the
  runs do not take).
"""

from __future__ import annotations

import ast
import sys
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

import amir_verl
from amir_verl.config import AmirConfig
from amir_verl.metrics import ACTOR_PREF_TERM
from amir_verl.preference import (
    PreferencePairs,
    dpo_logits,
    length_normalised_log_probs,
    mine_preference_pairs,
    pair_log_likelihood_per_sequence,
    partner_table,
    preference_loss_share,
    preference_objective,
)
from amir_verl.step_batch import compute_step_fields, gradient_signal, session_final_mask

PACKAGE = Path(amir_verl.__file__).resolve().parent
# the modules that the driver and the workers run (lambda_control.py is pure python: no tensor at all)
CHECKED_MODULES = ("preference.py", "step_batch.py", "lambda_control.py", "actor_loss.py")
CHECKED_FILES = {str(PACKAGE / name) for name in CHECKED_MODULES}
# torch functions that make a tensor from no tensor (so on the default device unless told otherwise)
FACTORIES = {
    "tensor", "as_tensor", "asarray", "zeros", "ones", "empty", "full", "arange", "range", "linspace", "logspace",
    "eye", "rand", "randn", "randint", "randperm", "scalar_tensor", "empty_strided", "tril_indices", "triu_indices",
    "normal", "bartlett_window", "hann_window", "hamming_window", "blackman_window", "kaiser_window",
}


class _DefaultDeviceToMeta(TorchFunctionMode):
    """Factory calls from the checked modules that name no device (or ``device=None``) make meta tensors."""

    def __init__(self):
        super().__init__()
        self.redirected: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        caller = sys._getframe(1)
        if (getattr(func, "__name__", None) in FACTORIES and caller.f_code.co_filename in CHECKED_FILES
                and kwargs.get("device") is None):
            self.redirected.append(f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno} torch.{func.__name__}")
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


@contextmanager
def default_device_is_meta(monkeypatch):
    """While active, a tensor the checked modules make without naming a device lands on ``meta``
    (``torch.from_numpy``, which takes no device, too)."""
    from_numpy = torch.from_numpy

    def meta_from_numpy(array):
        caller = sys._getframe(1)
        if caller.f_code.co_filename in CHECKED_FILES:
            mode.redirected.append(f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno} torch.from_numpy")
            return torch.empty(array.shape, dtype=from_numpy(array[:0]).dtype, device="meta")
        return from_numpy(array)

    mode = _DefaultDeviceToMeta()
    monkeypatch.setattr(torch, "from_numpy", meta_from_numpy)
    with mode:
        yield mode
    monkeypatch.setattr(torch, "from_numpy", from_numpy)


def test_the_meta_redirection_catches_a_tensor_made_without_a_device(monkeypatch):
    """The check itself: the pre-fix form of the zero-width fallback (no device=) is caught."""
    namespace: dict = {"torch": torch}
    code = compile("def make(n):\n    return torch.zeros(n, 1, dtype=torch.float64)\n",
                   str(PACKAGE / "step_batch.py"), "exec")
    exec(code, namespace)
    with default_device_is_meta(monkeypatch) as mode:
        made = namespace["make"](3)
        named = torch.zeros(3, 1)  # this test file is not a checked module: untouched
    assert made.device.type == "meta" and named.device.type == "cpu"
    assert mode.redirected == ["step_batch.py:2 torch.zeros"]
    with pytest.raises(RuntimeError, match="meta"):
        torch.ones(3, 1) + made


def _factory_calls_without_device(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    bad = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
            continue
        name = node.func.attr
        if name == "from_numpy" or (name in FACTORIES and "device" not in {k.arg for k in node.keywords}):
            bad.append(f"{path.name}:{node.lineno} torch.{name}")
    return bad


def test_no_factory_call_in_the_plugin_math_omits_the_device():
    bad = [call for name in CHECKED_MODULES for call in _factory_calls_without_device(PACKAGE / name)]
    assert bad == []


# ---------------------------------------------------------------------------------------------- meta


def test_the_actor_side_math_runs_on_meta_and_is_float32_for_bf16_log_probs():
    """What the actor's loss computes per micro-batch, on meta inputs of bf16 log-probs."""
    n, t, w = 6, 9, 3
    meta = torch.device("meta")
    log_prob = torch.empty(n, t, dtype=torch.bfloat16, device=meta, requires_grad=True)
    mask = torch.empty(n, t, dtype=torch.bool, device=meta)
    seq = length_normalised_log_probs(log_prob, mask)
    assert (seq.device, seq.dtype, seq.shape) == (meta, torch.float32, (n,))
    ref = torch.empty(n, dtype=torch.float32, device=meta)
    score = torch.empty(n, w, dtype=torch.float32, device=meta)
    sign = torch.empty(n, w, dtype=torch.float32, device=meta)
    f = pair_log_likelihood_per_sequence(seq, ref, score, sign, beta=0.5)
    assert (f.device, f.dtype, f.shape) == (meta, torch.float32, (n,))
    share = preference_loss_share(f, 0.25)
    assert (share.device, share.dtype, share.shape) == (meta, torch.float32, ())
    share.backward()  # the graph runs back to the bf16 leaf on meta
    assert (log_prob.grad.device, log_prob.grad.dtype) == (meta, torch.bfloat16)


def test_the_pair_logits_and_objective_run_on_meta():
    meta = torch.device("meta")
    policy = torch.empty(5, dtype=torch.bfloat16, device=meta)
    ref = torch.empty(5, dtype=torch.bfloat16, device=meta)
    index = torch.empty(4, dtype=torch.long, device=meta)
    pairs = PreferencePairs(index, index, index)
    z = dpo_logits(policy, ref, pairs, beta=0.2)
    assert (z.device, z.dtype) == (meta, torch.float32)
    j = preference_objective(z)
    assert (j.device, j.dtype, j.shape) == (meta, torch.float32, ())
    none = preference_objective(torch.empty(0, dtype=torch.bfloat16, device=meta))
    assert (none.device, none.dtype) == (meta, torch.float32)


# ------------------------------------------------------------------------ CPU inputs, default device = meta


def _step_inputs(dtype, n_groups=4, group=4, width=7, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = n_groups * group
    lengths = torch.randint(1, width + 1, (n,), generator=gen)
    mask = (torch.arange(width)[None] < lengths[:, None]).to(torch.float32)
    mask[3] = 0  # an empty response
    old = (-3 * torch.rand(n, width, generator=gen)).to(dtype) * mask.to(dtype)
    ref = (old.float() + 0.1 * torch.randn(n, width, generator=gen)).to(dtype)
    rewards = torch.tensor([0.0, 0.25, 1.0, 1.35])[torch.randint(0, 4, (n,), generator=gen)].to(dtype)
    uids = [f"g{i // group}" for i in range(n)]
    return dict(sequence_rewards=rewards, uids=uids, response_mask=mask, old_log_probs=old, ref_log_probs=ref)


CASES = [
    pytest.param({}, id="plain"),
    pytest.param({"is_padding": "last", "sample_keys": "single_turn"}, id="padding-and-keys"),
    pytest.param({"sample_keys": "multi_turn"}, id="multi-turn-sessions"),
    pytest.param({"config": {"pair_mode": "best_vs_rest", "max_pairs_per_group": 2}}, id="best-vs-rest-capped"),
    pytest.param({"config": {"reference": "ref_free"}}, id="ref-free"),
    pytest.param({"constant_rewards": True}, id="no-pairs"),
]


def _build(case, dtype):
    inputs = _step_inputs(dtype)
    n = len(inputs["uids"])
    if case.get("is_padding") == "last":
        inputs["is_padding"] = [False] * (n - 2) + [True, True]
    if case.get("sample_keys") == "single_turn":
        inputs["sample_keys"] = [f"{u}_{i}_0" for i, u in enumerate(inputs["uids"])]
    elif case.get("sample_keys") == "multi_turn":  # sessions of two outputs: only the second pairs
        inputs["sample_keys"] = [f"{u}_{i // 2}_{i % 2}" for i, u in enumerate(inputs["uids"])]
    if case.get("constant_rewards"):
        inputs["sequence_rewards"] = torch.ones(n, dtype=dtype)
    return AmirConfig(delta_r=0.5, beta_dpo=0.5, **case.get("config", {})), inputs


def _vanilla_token_mean(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights=None):
    """A base loss with verl's signature (clipped surrogate, token mean): the driver only differentiates it."""
    ratio = torch.exp(log_prob - old_log_prob)
    loss = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(0.8, 1.28))
    if rollout_is_weights is not None:
        loss = loss * rollout_is_weights
    mask = response_mask.to(loss.dtype)
    return (loss * mask).sum() / mask.sum().clamp(min=1), {}


@pytest.mark.parametrize("case", CASES)
def test_the_driver_step_makes_every_tensor_on_its_inputs_device(monkeypatch, case):
    config, inputs = _build(case, torch.float32)
    expected = compute_step_fields(config, **inputs)
    with default_device_is_meta(monkeypatch) as mode:
        fields = compute_step_fields(config, **inputs)
        advantages = torch.randn(inputs["old_log_probs"].shape, generator=torch.Generator().manual_seed(1))
        signal = gradient_signal(_vanilla_token_mean, fields, inputs["old_log_probs"], advantages,
                                 inputs["response_mask"], config.beta_dpo, chunked=True,
                                 rollout_is_weights=torch.ones_like(advantages))
    assert mode.redirected == []
    for name in ("old_seq_logp", "ref_seq_logp", "partner_score", "partner_sign"):
        value = getattr(fields, name)
        assert value.device.type == "cpu" and value.dtype == torch.float64
        assert torch.equal(value, getattr(expected, name))
    assert fields.stats == expected.stats
    assert (signal.num_pairs == 0) == case.get("constant_rewards", False)


def test_pair_mining_and_partner_table_make_every_tensor_on_its_inputs_device(monkeypatch):
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 2.0, 2.0], dtype=torch.bfloat16)
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    eligible = torch.tensor([True] * 6 + [False])
    with default_device_is_meta(monkeypatch) as mode:
        for kwargs in ({}, {"mode": "best_vs_rest"}, {"max_pairs_per_group": 1}, {"eligible": eligible}):
            pairs = mine_preference_pairs(rewards, groups, delta_r=0.25, **kwargs)
            assert pairs.preferred.device.type == "cpu" and len(pairs) > 0
            score, sign = partner_table(pairs, 7, torch.randn(7, dtype=torch.bfloat16))
            assert score.device.type == "cpu" and (score.dtype, sign.dtype) == (torch.float32, torch.float32)
        empty = mine_preference_pairs(rewards, groups, delta_r=5.0)
        assert len(empty) == 0 and partner_table(empty, 7, torch.randn(7))[0].shape == (7, 0)
        assert session_final_mask(["a_0_0", "a_0_1"], device="cpu").tolist() == [False, True]
        assert session_final_mask(["a_0_0", "b_0_0"], device="cpu").tolist() == [True, True]
    assert mode.redirected == []


def test_the_actor_loss_makes_every_tensor_on_its_inputs_device_and_is_float32_for_bf16(monkeypatch):
    """verl's ppo_loss (data-dependent: .item()) with the AMIR share, on a real micro-batch whose
    model log-probs are bf16; the AMIR share is float32 and equals the one of the same values in float32."""
    from amir_verl import actor_loss
    from amir_verl.testing import (
        actor_config,
        actor_tensordict,
        amir_step_fields,
        assign_engine_batch_info,
        extra_info_for,
        make_step_batch,
        nested,
        tiny_model,
        token_log_probs,
    )

    model, ref = tiny_model(0, dtype=torch.float32), tiny_model(1, dtype=torch.float32)
    batch = make_step_batch(model, ref, [6, 5, 4], seed=0)
    amir = AmirConfig(delta_r=0.5, beta_dpo=0.5)
    fields = amir_step_fields(batch, amir)
    assert fields.num_pairs > 0
    td = actor_tensordict(batch, list(range(len(batch))), fields, extra_info_for(fields, 0.7))
    assign_engine_batch_info([td], global_batch_size=len(batch))
    with torch.no_grad():
        rows = [token_log_probs(model, x) for x in td["input_ids"].unbind()]
    shares = []

    def recorded_share(f, weight):
        shares.append(preference_loss_share(f, weight))
        return shares[-1]

    monkeypatch.setattr(actor_loss, "preference_loss_share", recorded_share)
    loss_fn = partial(actor_loss.amir_ppo_loss, config=actor_config("vanilla"), beta_dpo=amir.beta_dpo)
    for dtype in (torch.bfloat16, torch.float32):
        log_probs = nested([r.to(torch.bfloat16).to(dtype) for r in rows])  # the same bf16 values
        with default_device_is_meta(monkeypatch) as mode:
            loss, metrics = loss_fn(model_output={"log_probs": log_probs}, data=td)
        assert mode.redirected == []
        assert loss.device.type == "cpu" and shares[-1].device.type == "cpu"
        assert metrics[ACTOR_PREF_TERM].values[0] == float(shares[-1])
    bf16_share, fp32_share = shares
    assert bf16_share.dtype == torch.float32
    assert torch.equal(bf16_share, fp32_share) and float(bf16_share) != 0.0


# ------------------------------------------------------------------------------------------------ dtype


def test_bf16_log_probs_and_rewards_give_full_precision_fields():
    """bf16 inputs: the driver's fields are float64 (as for any input: the driver computes in double and the
    trainer ships float32 to the actor), the statistics finite, and all equal to those of the same values
    given in float32."""
    config, inputs = _build({}, torch.bfloat16)
    fields = compute_step_fields(config, **inputs)
    wide = {k: (v.float() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    expected = compute_step_fields(config, **wide)
    assert fields.num_pairs > 0
    for name in ("old_seq_logp", "ref_seq_logp", "partner_score", "partner_sign"):
        assert getattr(fields, name).dtype == torch.float64
        assert torch.equal(getattr(fields, name), getattr(expected, name))
    assert fields.stats == expected.stats


def test_bf16_preference_outputs_are_float32_and_equal_the_float32_computation():
    gen = torch.Generator().manual_seed(3)
    lp = (-3 * torch.rand(6, 40, generator=gen)).to(torch.bfloat16)
    mask = torch.rand(6, 40, generator=gen) > 0.3
    seq = length_normalised_log_probs(lp, mask)
    assert seq.dtype == torch.float32
    assert torch.equal(seq, length_normalised_log_probs(lp.float(), mask))
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.25], dtype=torch.bfloat16)
    pairs = mine_preference_pairs(rewards, torch.tensor([0, 0, 0, 1, 1, 1]), delta_r=0.5)
    ref = seq.to(torch.bfloat16)
    z = dpo_logits(seq.to(torch.bfloat16), ref * 0, pairs, 0.5)
    assert z.dtype == torch.float32 and preference_objective(z).dtype == torch.float32
    score, sign = partner_table(pairs, 6, seq.to(torch.bfloat16))
    assert score.dtype == sign.dtype == torch.float32
    f = pair_log_likelihood_per_sequence(seq.to(torch.bfloat16), ref * 0, score.to(torch.bfloat16),
                                         sign.to(torch.bfloat16), 0.5)
    assert f.dtype == torch.float32
    assert preference_loss_share(f, 0.1).dtype == torch.float32


def test_float32_and_float64_inputs_keep_their_dtype():
    """The widening touches reduced precision only: float64 stays float64 (the exactness tests' models)."""
    for dtype in (torch.float32, torch.float64):
        lp = -torch.rand(3, 5, dtype=dtype)
        seq = length_normalised_log_probs(lp, torch.ones(3, 5))
        assert seq.dtype == dtype
        sign = torch.tensor([[1.0], [-1.0], [0.0]], dtype=dtype)
        assert pair_log_likelihood_per_sequence(seq, seq * 0, seq[:, None], sign, 0.3).dtype == dtype
