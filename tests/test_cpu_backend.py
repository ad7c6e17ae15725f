"""The CPU backend: the `cpu` platform, its three patches, and the `hf` rollout server (no Ray needed)."""

import asyncio
import inspect
import os

import pytest
import torch

from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineManager, CheckpointEngineWorker
from verl.experimental.separation.engine_workers import DetachActorWorker
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
from verl.trainer.ppo.v1.trainer_base import PPOTrainer
from verl.utils import distributed, fsdp_utils
from verl.workers import engine_workers
from verl.workers.config.model import HFModelConfig
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngine
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.llm_server import LLMServerClient, LLMServerManager
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

from amir_verl.cpu.hf_rollout import HFRolloutServer
from amir_verl.cpu.platform import PATCHES, REPLAY_BUFFER_POLL_INTERVAL_S
from amir_verl.cpu.vllm_lora import WRAPPERS, one_adapter_product
from amir_verl.demo.toy_task import compute_score, make_assets, make_rows
from tests.seams import fingerprint
from tests.support import FreshPython, generate

# upstream function -> (sha256 prefix of its verl 0.9.1 source, what the CPU backend relies on)
CPU_SEAMS = {
    "initialize_global_process_group_ray": (distributed.initialize_global_process_group_ray, "761a94d1a2e058d3",
                                            "patched: backend string cpu:gloo,<device>:<backend>"),
    "FSDPEngine._build_fsdp_module": (FSDPEngine._build_fsdp_module, "35b7b539858443e4",
                                      "patched: CPUOffloadPolicy(pin_memory=True) for forward-only engines"),
    "ReplayBuffer.__init__": (ReplayBuffer.__init__, "0c37a48629991988", "patched: poll_interval=2.0 by default"),
    "ReplayBuffer._wait_for_next_poll": (ReplayBuffer._wait_for_next_poll, "10088bf03da69383",
                                         "sleeps poll_interval between TransferQueue polls"),
    "PPOTrainer._build_replay_buffer": (PPOTrainer._build_replay_buffer, "c6c5bd0783311ea3",
                                        "builds the replay buffer without a poll_interval"),
    "EngineRegistry.get_engine_cls": (EngineRegistry.get_engine_cls, "b1290dce7fd3c855", "VERL_ENGINE_DEVICE selects FSDP engines"),
    "RolloutReplica.__init__": (RolloutReplica.__init__, "2fabbc138e468d1f", "HFReplica's base"),
    "BaseRollout": (BaseRollout, "05c01b83ca41ee6f", "HFServerAdapter's base"),
    "LLMServerClient.generate": (LLMServerClient.generate, "45f4cf4029f0be37", "the server's generate() keyword arguments"),
    "LLMServerManager._initialize_llm_servers": (LLMServerManager._initialize_llm_servers, "c862f5411a8828a8",
                                        "replica construction and init_hybrid"),
    "ActorRolloutRefWorker.update_weights": (engine_workers.ActorRolloutRefWorker.update_weights, "ea8f2ec1eb8a4481",
                                             "calls the adapter's resume / update_weights(weights, peft_config, ...)"),
    "CheckpointEngineManager.update_weights": (CheckpointEngineManager.update_weights, "7dc90230efef777a",
                                               "naive backend -> worker update_weights; other backends: abort, "
                                               "build_process_group, send/receive, finalize, resume"),
    "CheckpointEngineManager.build_process_group": (CheckpointEngineManager.build_process_group, "a6dd18d2640ae8e0",
                                                    "prepare on every worker, build_topology on actor rank 0's "
                                                    "metadata first, init_process_group (cpu_object_store)"),
    "CheckpointEngine": (CheckpointEngine, "b29fe9957c72579a", "the protocol cpu_object_store implements"),
    "CheckpointEngineWorker.update_weights": (CheckpointEngineWorker.update_weights, "290edf10e58b9153",
                                              "hands receive_weights() (an async generator) to HFServerAdapter"),
    "fsdp2_sharded_save_to_cpu": (inspect.unwrap(fsdp_utils.fsdp2_sharded_save_to_cpu), "ecdb335bb1d3948f",
                                  "patched: .detach().cpu() aliases the live shard on the CPU"),
    "fsdp2_sharded_load_from_cpu": (fsdp_utils.fsdp2_sharded_load_from_cpu, "fee0f1bd3e0db181",
                                    "copies the saved shards back in place (the restore of pi_old)"),
    "DetachActorWorker.save_model_to_cpu": (DetachActorWorker.save_model_to_cpu, "ee3493289bb90b59",
                                            "separate_async's pi_old save: the strategy's sharded save"),
    "DetachActorWorker.restore_model_from_cpu": (DetachActorWorker.restore_model_from_cpu, "c612cc1e734e9240",
                                                 "separate_async's pi_old restore: the strategy's sharded load"),
    "HFModelConfig.__post_init__": (inspect.unwrap(HFModelConfig.__post_init__), "a18620cfff22adeb",
                                    "patched: builds hf_config with override_config's attn_implementation"),
}


@pytest.mark.parametrize("name", list(CPU_SEAMS))
def test_upstream_source_unchanged(name):
    obj, expected, why = CPU_SEAMS[name]
    assert fingerprint(obj) == expected, f"verl changed {name} ({why}); re-check amir_verl/cpu"


def probe_env(cpu: bool) -> dict[str, str]:
    """A fresh interpreter's environment with the CPU switch on or off (and no platform set by hand)."""
    env = {k: v for k, v in os.environ.items() if k not in ("AMIR_VERL_CPU", "VERL_PLATFORM", "VERL_ENGINE_DEVICE")}
    return {**env, "AMIR_VERL_CPU": "1"} if cpu else env


PROBE = (
    "import verl\n"
    "from verl.utils.device import get_device_name, get_nccl_backend\n"
    "from verl.workers.rollout.base import _ROLLOUT_REGISTRY\n"
    "from verl.workers.rollout.replica import RolloutReplicaRegistry\n"
    "import verl.utils.distributed as d, verl.workers.engine_workers as w\n"
    "import verl.workers.engine.fsdp.transformer_impl as f\n"
    "import verl.utils.fsdp_utils as fu\n"
    "from verl.checkpoint_engine.base import CheckpointEngineRegistry\n"
    "from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer\n"
    "buffer = ReplayBuffer(trainer_mode='sync', trainer_config={}, max_off_policy_threshold=1,\n"
    "                      max_off_policy_strategy='wait', sampler_kwargs={})\n"
    "print(get_device_name(), get_nccl_backend(), ('hf', 'async') in _ROLLOUT_REGISTRY,\n"
    "      'hf' in RolloutReplicaRegistry._registry, getattr(d.initialize_global_process_group_ray, '_amir_cpu', False),\n"
    "      getattr(w.initialize_global_process_group_ray, '_amir_cpu', False), getattr(f.CPUOffloadPolicy, '_amir_cpu', False),\n"
    "      buffer.poll_interval, getattr(fu.fsdp2_sharded_save_to_cpu, '_amir_cpu', False),\n"
    "      'cpu_object_store' in CheckpointEngineRegistry._registry)\n"
)


# every heavy module the switch must leave to verl to import: the patched ones and the backend's registrations
LAZY_MODULES = sorted(PATCHES) + ["verl.workers.rollout.base", "verl.workers.rollout.replica", "amir_verl.cpu.hf_rollout",
                                  "verl.checkpoint_engine.base", "amir_verl.cpu.checkpoint_engine"]


@pytest.fixture(scope="module")
def switch_probes() -> dict[str, FreshPython]:
    """The switch's probes, each in a fresh interpreter, started together."""
    lazy = f"import sys, verl; print([m for m in {LAZY_MODULES!r} if m in sys.modules])"
    return {"on": FreshPython(PROBE, probe_env(cpu=True)), "off": FreshPython(PROBE, probe_env(cpu=False)),
            "lazy": FreshPython(lazy, probe_env(cpu=True))}


def test_switch_on_gives_a_cpu_platform_and_the_hf_rollout(switch_probes):
    assert switch_probes["on"].stdout_lines()[-1] == (
        f"cpu gloo True True True True True {REPLAY_BUFFER_POLL_INTERVAL_S} True True")


def test_switch_off_touches_nothing(switch_probes):
    """Without AMIR_VERL_CPU, verl keeps its own platform detection, patches and registries."""
    assert switch_probes["off"].stdout_lines()[-1] == "cuda nccl False False False False False 2.0 False False"


def test_switch_on_leaves_the_patched_modules_to_verl_to_import(switch_probes):
    """Each Ray process of a run imports verl; the patches wait for their modules, so a process that never
    uses them (load balancer, reward loop, TransferQueue) does not pay their import (about 3 s of CPU)."""
    assert switch_probes["lazy"].stdout_lines()[-1] == "[]"


ATTENTION_PROBE = ("import verl\n"
                   "from verl.workers.config.model import HFModelConfig\n"
                   "config = HFModelConfig(path={model!r}, override_config={{'attn_implementation': 'flash_attention_2'}})\n"
                   "print(config.hf_config._attn_implementation, config.override_config['attn_implementation'])\n")


@pytest.mark.parametrize("package_installed", [True, False])
def test_a_flash_attention_model_loads_with_sdpa_where_its_package_is_installed(tmp_path, package_installed):
    """Patch 10: flash_attention_2 runs as sdpa in a CPU process whose environment has flash_attn (a stand-in
    package here, as a worker node's image adds it); without it verl's config is left as it was (transformers then
    refuses the model, and an AMIR run's worker check stops it first)."""
    assets = make_assets(tmp_path / "toy", n_train=2, n_test=1)
    (tmp_path / "site" / "flash_attn").mkdir(parents=True)
    (tmp_path / "site" / "flash_attn" / "__init__.py").write_text("")
    env = probe_env(cpu=True)
    if package_installed:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path / "site"), env.get("PYTHONPATH")]))
    lines = FreshPython(ATTENTION_PROBE.format(model=assets["model"]), env).stdout_lines()
    if package_installed:
        assert lines[-2:] == ["amir_verl CPU backend: attn_implementation=flash_attention_2 loads as sdpa", "sdpa sdpa"]
    else:
        assert lines[-1] == "flash_attention_2 flash_attention_2" and not any("loads as sdpa" in x for x in lines)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    assets = make_assets(tmp_path_factory.mktemp("toy"), n_train=4, n_test=2)
    from omegaconf import OmegaConf

    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import HFModelConfig, RolloutConfig

    config = RolloutConfig(name="hf", prompt_length=32, response_length=5, seed=3)
    model_config = omega_conf_to_dataclass(OmegaConf.create({"_target_": "verl.workers.config.HFModelConfig",
                                                             "path": assets["model"]}), HFModelConfig)
    srv = HFRolloutServer(config, model_config, replica_rank=0)
    srv.set_global_steps(0)
    return srv, assets


def test_server_returns_verl_token_output_with_the_actor_log_probs(server):
    srv, _ = server
    prompt = [5, 12, 6, 13, 14]
    out = generate(srv, prompt, temperature=0.7)
    assert isinstance(out, TokenOutput) and 1 <= len(out.token_ids) <= 5
    assert len(out.log_probs) == len(out.token_ids) and out.extra_fields["global_steps"] == 0
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        logits = srv.model(input_ids=ids).logits[0, len(prompt) - 1 : -1] / 0.7
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out.token_ids)[:, None]).squeeze(-1)
    torch.testing.assert_close(torch.tensor(out.log_probs), expected, rtol=1e-4, atol=1e-5)
    assert srv.pad_token_id not in out.token_ids
    assert generate(srv, prompt, logprobs=False).log_probs is None


def test_server_sampling_is_reproducible_per_step_and_varies_within_a_group(server):
    srv, _ = server
    prompt = [7, 12, 8, 13, 14]
    srv.set_global_steps(5)
    first = [tuple(generate(srv, prompt).token_ids) for _ in range(8)]
    srv.set_global_steps(5)
    again = [tuple(generate(srv, prompt).token_ids) for _ in range(8)]
    assert first == again and len(set(first)) > 1
    greedy = {tuple(generate(srv, prompt, temperature=0).token_ids) for _ in range(3)}
    assert len(greedy) == 1


SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
REQUESTS = [  # prompts of different lengths, a repeated prompt, and every kind of sampling in one batch
    ([5, 12, 6, 13, 14], {"temperature": 1.0}),
    ([7, 8, 9], {"temperature": 0.7, "top_k": 5}),
    ([5, 12, 6, 13, 14], {"temperature": 1.0}),
    ([5, 12, 6, 13, 14, 20, 21, 22, 23, 24, 25], {"temperature": 1.0, "top_p": 0.8}),
    ([3], {"temperature": 0}),
    ([9, 9, 9, 9], {"temperature": 1.0, "max_tokens": 2}),
] * 3


def test_batched_sampling_gives_each_request_what_it_gets_alone(server):
    """One padded decode of all requests = each request decoded alone with its own generator: same tokens,
    log-probs equal up to float32 summation order."""
    srv, _ = server
    srv.set_global_steps(7)
    alone = [srv.sample_batch([(p, s, srv._generator(p))])[0] for p, s in REQUESTS]
    srv.set_global_steps(7)
    shapes = []
    hook = srv.model.register_forward_pre_hook(lambda _, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
                                               with_kwargs=True)
    try:
        together = srv.sample_batch([(p, s, srv._generator(p)) for p, s in REQUESTS])
    finally:
        hook.remove()
    distinct = {tuple(p) for p, _ in REQUESTS}
    assert shapes[0] == (len(distinct), max(map(len, distinct)))  # each distinct prompt prefilled once
    assert set(shapes[1:]) == {(len(REQUESTS), 1)}  # then every request decodes from its own cache copy
    assert [t for t, _ in together] == [t for t, _ in alone]
    assert len({tuple(t) for t, _ in alone[:3:2]}) == 2  # the repeated prompt's samples differ
    assert [len(t) for t, _ in alone][5] <= 2  # its own length limit
    for (_, lp_alone), (_, lp_together) in zip(alone, together):
        torch.testing.assert_close(torch.tensor(lp_together), torch.tensor(lp_alone), rtol=1e-5, atol=1e-5)


def test_concurrent_requests_are_batched_and_answer_as_one_at_a_time(server, monkeypatch):
    srv, _ = server
    params = {"top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
    srv.set_global_steps(8)
    one_at_a_time = [generate(srv, p, **s) for p, s in REQUESTS]
    batch_sizes = []
    decode = srv.decode
    monkeypatch.setattr(srv, "decode", lambda requests: batch_sizes.append(len(requests)) or decode(requests))

    async def concurrently():
        return await asyncio.gather(*[srv.generate(p, {**params, **s}, f"r{i}") for i, (p, s) in enumerate(REQUESTS)])

    srv.set_global_steps(8)
    outputs = asyncio.run(concurrently())
    assert batch_sizes == [len(REQUESTS)]  # requests sent together: one decode
    assert [o.token_ids for o in outputs] == [o.token_ids for o in one_at_a_time]
    torch.testing.assert_close(torch.tensor([x for o in outputs for x in o.log_probs]),
                               torch.tensor([x for o in one_at_a_time for x in o.log_probs]), rtol=1e-5, atol=1e-5)


def test_a_decode_takes_at_most_max_num_seqs_requests(server, monkeypatch):
    """rollout.max_num_seqs bounds a batched decode, as it bounds vLLM's scheduled sequences."""
    srv, _ = server
    batch_sizes = []
    decode = srv.decode
    monkeypatch.setattr(srv, "decode", lambda requests: batch_sizes.append(len(requests)) or decode(requests))
    monkeypatch.setattr(srv, "max_batch", 5)

    async def concurrently():
        return await asyncio.gather(*[srv.generate(p, {**SAMPLING, **s}, f"r{i}") for i, (p, s) in enumerate(REQUESTS)])

    assert all(o.stop_reason == "completed" for o in asyncio.run(concurrently()))
    assert batch_sizes == [5, 5, 5, 3]


def test_a_failing_batch_fails_its_requests_instead_of_hanging(server, monkeypatch):
    srv, _ = server
    monkeypatch.setattr(srv, "decode", lambda requests: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        generate(srv, [5, 6])


def test_a_cancelled_request_does_not_block_its_batch(server):
    srv, _ = server
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": False}

    async def scenario():
        cancelled = asyncio.ensure_future(srv.generate([5, 6], params, "a"))
        kept = asyncio.ensure_future(srv.generate([7, 8], params, "b"))
        await asyncio.sleep(0)  # both queued for the same batch
        cancelled.cancel()
        return await asyncio.wait_for(kept, timeout=30)

    assert 1 <= len(asyncio.run(scenario()).token_ids) <= 5


def test_server_weight_sync(server):
    srv, _ = server
    state = {k: torch.zeros_like(v) for k, v in srv.model.state_dict().items()}
    before = {k: v.clone() for k, v in srv.model.state_dict().items()}
    srv.update_weights(state)
    assert all(float(v.abs().sum()) == 0 for v in srv.model.state_dict().values())
    srv.update_weights(before)
    with pytest.raises(RuntimeError, match="unexpected"):
        srv.update_weights({"not.a.weight": torch.zeros(1)})


# ---------------------------------------------------------------- the async trainers' calls (abort, gate, resume)

def log_probs_under(srv, state, prompt, tokens):
    """(len(tokens),) brute force: a fresh copy of the served model with ``state`` loaded."""
    import copy

    model = copy.deepcopy(srv.model)
    model.load_state_dict(state)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


@pytest.fixture
def at_version_0(server, monkeypatch):
    """The server serving version 0 (the weights a run starts from, where HOLD_ENV's holds apply); its weights
    and hold settings are restored afterwards."""
    srv, _ = server
    srv.set_global_steps(0)
    weights = {k: v.clone() for k, v in srv.model.state_dict().items()}
    monkeypatch.setattr(srv, "holds_left", 0)
    monkeypatch.setattr(srv, "hold_at_token", 0)
    yield srv
    srv.update_weights(weights)
    srv.set_global_steps(0)


def abort_at_token(srv, monkeypatch, tokens: int) -> list:
    """Starts ``srv.abort_all_requests()`` as soon as the running decode's longest response has ``tokens``
    tokens: the decode yields to the server's event loop after every token, so the abort cuts it right there,
    whatever the machine's pace. Returns the list that receives the abort's task."""
    hook, aborts = srv._hold_at_their_token, []

    def at_each_token(batch, responses, active, version, held):
        hook(batch, responses, active, version, held)
        if not aborts and max(len(t) for t, _ in responses) == tokens:
            aborts.append(asyncio.ensure_future(srv.abort_all_requests()))

    monkeypatch.setattr(srv, "_hold_at_their_token", at_each_token)
    return aborts


async def wait_until(condition, timeout=30.0):
    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise TimeoutError


def test_an_abort_cuts_decoding_between_tokens_and_the_gate_parks_new_requests(at_version_0, monkeypatch):
    srv = at_version_0
    prompt = [5, 12, 6, 13, 14]
    aborts = abort_at_token(srv, monkeypatch, 4)

    async def scenario():
        running = [asyncio.ensure_future(srv.generate(prompt, {**SAMPLING, "max_tokens": 60}, f"r{i}"))
                   for i in range(3)]
        outputs = await asyncio.wait_for(asyncio.gather(*running), 30)
        result = await aborts[0]  # the abort returns once the decode has stopped
        parked = asyncio.ensure_future(srv.generate(prompt, SAMPLING, "late"))
        await asyncio.sleep(0.2)
        assert not parked.done()  # behind the closed gate
        await srv.resume_generation()
        return outputs, await asyncio.wait_for(parked, 30), result

    outputs, late, result = asyncio.run(scenario())
    for out in outputs:
        assert (out.stop_reason, len(out.token_ids)) == ("aborted", 4)  # cut at the token the abort came after
        assert len(out.log_probs) == len(out.token_ids) and out.extra_fields["global_steps"] == 0
        torch.testing.assert_close(torch.tensor(out.log_probs, dtype=torch.float64),
                                   log_probs_under(srv, srv.model.state_dict(), prompt, out.token_ids),
                                   rtol=1e-4, atol=1e-5)
    assert late.stop_reason == "completed" and late.token_ids
    assert result["aborted_count"] == 3  # all three, cut mid-response


def test_held_requests_wait_at_their_token_for_the_next_abort_under_version_0_only(at_version_0, monkeypatch):
    """HOLD_ENV: the first requests under version 0 stop at a fixed token and only an abort answers them."""
    from amir_verl.cpu.holds import HOLD_ENV, parse_hold

    srv = at_version_0
    monkeypatch.setattr(srv, "holds_left", 2)
    monkeypatch.setattr(srv, "hold_at_token", 3)
    prompt = [5, 12, 6, 13, 14]

    async def scenario():
        first = [asyncio.ensure_future(srv.generate(prompt, {**SAMPLING, "max_tokens": 40}, f"h{i}")) for i in range(3)]
        await wait_until(lambda: first[2].done())  # the third was not held: it finished
        assert not any(task.done() for task in first[:2]) and len(srv._held) == 2  # the first two wait
        srv.set_global_steps(1)
        monkeypatch.setattr(srv, "holds_left", 1)
        later = await asyncio.wait_for(srv.generate(prompt, {**SAMPLING, "max_tokens": 40}, "later"), 30)
        result = await srv.abort_all_requests()
        await srv.resume_generation()
        return [await task for task in first], later, result

    (held_a, held_b, free), later, result = asyncio.run(scenario())
    for out in (held_a, held_b):
        assert (out.stop_reason, len(out.token_ids), out.extra_fields["global_steps"]) == ("aborted", 3, 0)
        torch.testing.assert_close(torch.tensor(out.log_probs, dtype=torch.float64),
                                   log_probs_under(srv, srv.model.state_dict(), prompt, out.token_ids),
                                   rtol=1e-4, atol=1e-5)
    assert free.stop_reason == "completed" and len(free.token_ids) > 3
    assert later.stop_reason == "completed"  # version 1: nothing is held
    assert result["aborted_count"] == 2
    assert parse_hold("4@2") == (4, 2) and parse_hold("") == (0, 0)
    for bad in ("4", "a@2", "4@0"):
        with pytest.raises(ValueError, match=HOLD_ENV):
            parse_hold(bad)


def test_queued_requests_abort_empty_and_a_rejecting_gate_answers_at_once(at_version_0):
    srv = at_version_0

    async def scenario():
        queued = asyncio.ensure_future(srv.generate([5, 6], SAMPLING, "queued"))
        await asyncio.sleep(0)  # queued, its batch window not yet over
        first = await srv.abort_all_requests(reject_request=True)
        rejected = await asyncio.wait_for(srv.generate([5, 6], SAMPLING, "rejected"), 1)
        await srv.abort_all_requests()  # a plain abort restores parking (as vLLM's gate)
        parked = asyncio.ensure_future(srv.generate([5, 6], SAMPLING, "parked"))
        await asyncio.sleep(0.1)
        assert not parked.done()
        await srv.resume_generation()
        return await queued, first, rejected, await asyncio.wait_for(parked, 30)

    queued, first, rejected, parked = asyncio.run(scenario())
    assert (queued.stop_reason, queued.token_ids, first["aborted_count"]) == ("aborted", [], 1)
    assert (rejected.stop_reason, rejected.token_ids) == ("aborted", [])
    assert parked.stop_reason == "completed"


class _Remote:
    """A method called the way a Ray actor handle's is (``handle.method.remote(...)``), in process."""

    def __init__(self, fn):
        self.remote = fn


class _InProcessHandle:
    def __init__(self, target, record=None):
        self._target, self._record = target, record

    def __getattr__(self, name):
        method = getattr(self._target, name)

        async def call(*args, **kwargs):
            result = method(*args, **kwargs)
            result = await result if asyncio.iscoroutine(result) else result
            if self._record is not None:
                self._record.append(result)
            return result

        return _Remote(call)


class _OneServerBalancer:
    """verl's GlobalRequestLoadBalancer interface with one server."""

    def __init__(self, handle):
        self.require_acquire_fields = _Remote(self._none)
        self.require_release_fields = _Remote(self._none)
        self.acquire_server = _Remote(self._acquire)
        self.release_server = _Remote(lambda **kwargs: None)
        self._handle = handle

    async def _none(self):
        return []

    async def _acquire(self, request_id, **kwargs):
        return "hf-0", self._handle


def test_verls_fully_async_client_resumes_an_aborted_response_under_the_new_weights(at_version_0, monkeypatch):
    """colocate_async's cycle against verl's real FullyAsyncLLMServerClient: abort mid-response (on_sample_end),
    new weights and version (on_step_end's update_weights), resume_generation. The client resends prompt +
    partial response; its answer spans both versions, and each segment's log-probs are those of the weights
    that drew it."""
    from omegaconf import OmegaConf

    from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient

    srv = at_version_0
    aborts = abort_at_token(srv, monkeypatch, 6)
    old_state = {k: v.clone() for k, v in srv.model.state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    new_state = {k: v + 0.2 * torch.randn(v.shape, generator=generator) for k, v in old_state.items()}
    served = []
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "hf", "response_length": 40,
                                                                 "full_determinism": False}}})
    client = FullyAsyncLLMServerClient(config, load_balancer_handle=_OneServerBalancer(_InProcessHandle(srv, served)))
    prompt = [5, 12, 6, 13, 14]

    async def scenario():
        answer = asyncio.ensure_future(client.generate("q", prompt_ids=prompt, sampling_params=dict(SAMPLING)))
        await wait_until(lambda: aborts)
        await aborts[0]  # on_sample_end's abort, at the 6th token
        srv.update_weights(new_state)
        srv.set_global_steps(1)
        await srv.resume_generation()
        return await asyncio.wait_for(answer, 60)

    out = asyncio.run(scenario())
    first, second = served
    assert (first.stop_reason, first.extra_fields["global_steps"], len(first.token_ids)) == ("aborted", 0, 6)
    assert second.extra_fields["global_steps"] == 1
    assert out.token_ids == first.token_ids + second.token_ids and len(out.log_probs) == len(out.token_ids)
    assert (out.extra_fields["min_global_steps"], out.extra_fields["max_global_steps"]) == (0, 1)
    cut = len(first.token_ids)
    for state, part, tokens, context in ((old_state, out.log_probs[:cut], first.token_ids, prompt),
                                         (new_state, out.log_probs[cut:], second.token_ids, prompt + first.token_ids)):
        torch.testing.assert_close(torch.tensor(part, dtype=torch.float64),
                                   log_probs_under(srv, state, context, tokens), rtol=1e-4, atol=1e-5)
    # the old weights would not have given the resumed segment's log-probs
    assert not torch.allclose(torch.tensor(out.log_probs[cut:], dtype=torch.float64),
                              log_probs_under(srv, old_state, prompt + first.token_ids, second.token_ids), atol=1e-3)


def test_toy_reward():
    row = make_rows(1, "train", seed=0)[0]
    (answer,) = row["reward_model"]["ground_truth"]  # the list of accepted golds, as verl passes it
    assert compute_score(row["data_source"], f"{answer}x", [answer]) == {"score": 1.0, "acc": 1.0, "pred": answer}
    wrong = str((int(answer) + 1) % 10)
    assert compute_score(row["data_source"], wrong, answer)["score"] == 0.1
    assert compute_score(row["data_source"], "abc", answer) == {"score": 0.0, "acc": 0.0, "pred": ""}
    assert compute_score(row["data_source"], None, answer)["score"] == 0.0


def per_token_products(inputs, weights, indices):
    """[tokens, out]: each token's own ``weights[i] @ x`` (the brute force of vLLM's gathered einsum)."""
    weights = weights.squeeze(1) if weights.ndim == 4 else weights
    return torch.stack([weights[i] @ inputs[t] for t, i in enumerate(indices.tolist())])


@pytest.mark.parametrize("four_d", [False, True])
def test_one_adapter_product_is_that_adapters_matmul_and_declines_mixed_adapters(four_d):
    torch.manual_seed(0)
    weights = torch.randn(3, 1, 6, 5) if four_d else torch.randn(3, 6, 5)
    inputs = torch.randn(4, 5, dtype=torch.float64)
    for index in (0, 2, -1):
        indices = torch.full((4,), index)
        product = one_adapter_product(inputs, weights, indices, torch.float32)
        assert product.dtype == torch.float32
        torch.testing.assert_close(product, per_token_products(inputs.float(), weights, indices))
    # mixed adapters; more tokens than indices; no tokens; not one row per token
    none, three, four = (torch.zeros(n, dtype=torch.long) for n in (0, 3, 4))
    for rows, indices in ((inputs, torch.tensor([0, 1, 0, 0])), (inputs, three), (inputs[:0], none),
                          (inputs[None], four)):
        assert one_adapter_product(rows, weights, indices, torch.float32) is None


def test_the_lora_wrappers_compute_one_adapter_themselves_and_hand_anything_else_to_upstream():
    """Each wrapper against the same brute force: one adapter for every token is computed by the wrapper (upstream
    never called), mixed adapters and a one-row expand broadcast go to upstream with the arguments as given."""
    torch.manual_seed(1)
    a, b = torch.randn(3, 4, 8), torch.randn(3, 10, 4)
    x, h = torch.randn(5, 8), torch.randn(5, 4)
    calls = []

    def upstream(name):
        def reference(inputs, weights, output, indices, *rest):
            calls.append(name)
            output.copy_(torch.full_like(output, 7.0))  # a marker: upstream ran, with this output tensor
        return reference

    shrink, expand, expand_slice = (WRAPPERS[name](upstream(name)) for name in
                                    ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice"))
    one = torch.full((5,), 1)
    out = torch.zeros(5, 6)
    shrink(x, a, out, one, 0.5)
    torch.testing.assert_close(out[:, :4], 0.5 * per_token_products(x, a, one))
    assert out[:, 4:].abs().max() == 0
    for add in (True, False):
        base = torch.randn(5, 12)
        out = base.clone()
        expand(h, b, out, one, add)
        torch.testing.assert_close(out[:, :10], base[:, :10] * add + per_token_products(h, b, one))
        torch.testing.assert_close(out[:, 10:], base[:, 10:])
        out = base.clone()
        expand_slice(h, b, out, one, 1, 10, add)
        want = base.clone()
        want[:, 1:11] = base[:, 1:11] * add + per_token_products(h, b, one)
        torch.testing.assert_close(out, want)
    assert calls == []
    mixed = torch.tensor([0, 1, 2, 1, 0])
    for call in (lambda out: shrink(x, a, out, mixed, 0.5), lambda out: expand(h, b, out, mixed, True),
                 lambda out: expand_slice(h, b, out, mixed, 1, 10, True),
                 lambda out: expand(h[:1], b, out, one[:1], True)):
        out = torch.zeros(5, 12)
        call(out)
        assert bool((out == 7.0).all())
    assert calls == ["bgmv_shrink", "bgmv_expand", "bgmv_expand_slice", "bgmv_expand"]
