"""Rollout backend ``hf``: transformers ``generate`` behind verl 0.9.1's async rollout-server interface.

verl's V1 trainer generates through rollout *servers* (vllm, sglang, trtllm). This backend plugs
into the same two registries those use:

- ``verl.workers.rollout.replica.RolloutReplicaRegistry`` (``"hf"`` -> :class:`HFReplica`): the
  TaskRunner's ``LLMServerManager`` builds one replica per rollout world and calls
  ``init_hybrid``, whose ``launch_servers`` starts one :class:`HFRolloutServer` Ray actor.
- ``verl.workers.rollout.base._ROLLOUT_REGISTRY`` (``("hf", "async")`` -> :class:`HFServerAdapter`):
  each actor worker builds the adapter in ``init_model``; after every update verl's
  ``ActorRolloutRefWorker.update_weights`` hands it the actor's weights, which the replica's
  leader rank sends to its server: full weights (``HFRolloutServer.update_weights``), or with LoRA
  and ``model.lora.merge=False`` (verl's default) the adapter's tensors and PEFT config, which the
  server applies with ``peft`` as vLLM serves a LoRA request (``HFRolloutServer.update_lora``).

The server answers ``generate(prompt_ids, sampling_params, request_id, ...) -> TokenOutput`` in
batches of the requests that are waiting, at most ``rollout.max_num_seqs`` (one padded decode per batch,
:meth:`HFRolloutServer.decode`),
with verl's sampling keys (temperature 0 = greedy, top_k -1 = off, logprobs), the
response length limit vLLM applies, and the sampled tokens' log-probabilities (after temperature, as
verl's actor computes them). For debugging on CPU only: it is slow and it does not shard.

verl's asynchronous trainers (``colocate_async``, ``separate_async``) drive the server as they drive vLLM's:
``abort_all_requests`` cuts every running decode between two tokens and answers each request with its
tokens so far and ``stop_reason="aborted"`` (verl's ``FullyAsyncLLMServerClient`` then resends prompt + partial
response under the new weights: a partial rollout); it closes a gate at which new requests park until
``resume_generation`` (or, with ``reject_request=True``, are answered "aborted" at once, so the client
re-routes). Each answer carries the weights version that produced its tokens (``global_steps``).

For tests, :data:`~amir_verl.cpu.holds.HOLD_ENV` makes a weight sync cut responses by construction rather than
by timing: under the initial weights (version 0) the server holds the first requests it receives at a fixed
token count, and only the next abort answers them (with those tokens, "aborted"), so their responses resume under
the next weights.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import ray
import torch

from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput
from verl.workers.rollout.utils import ensure_async_iterator

from amir_verl.cpu import ROLLOUT_NAME
from amir_verl.cpu.holds import HOLD_ENV, parse_hold

logger = logging.getLogger(__name__)

BATCH_WINDOW_S = 0.01  # how long the server waits for a batch to fill before its first forward pass
Responses = list[tuple[list[int], list[float]]]


def server_actor_name(replica_rank: int) -> str:
    return f"{ROLLOUT_NAME}_server_{replica_rank}"


class HFRolloutServer:
    """One rollout replica's model, in its own Ray actor (CPU, float32)."""

    def __init__(self, config, model_config, replica_rank: int):
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)  # the actor workers use the cores; generation batches are tiny
        self.config = config
        self.replica_rank = replica_rank
        path = getattr(model_config, "local_path", None) or model_config.path
        self.model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="sdpa",
            trust_remote_code=bool(getattr(model_config, "trust_remote_code", False)),
        ).eval()
        generation = self.model.generation_config
        self.eos_token_ids = generation.eos_token_id if isinstance(generation.eos_token_id, list) else (
            [generation.eos_token_id] if generation.eos_token_id is not None else []
        )
        self.pad_token_id = generation.pad_token_id if generation.pad_token_id is not None else (
            self.eos_token_ids[0] if self.eos_token_ids else 0
        )
        self.peft_config: dict | None = None  # the served LoRA adapter's config, once verl sent one
        self.global_steps = None
        self.seed = int(getattr(config, "seed", 0) or 0)
        self._occurrences: dict[tuple, int] = {}
        self._pending: list[tuple[tuple[list[int], dict, torch.Generator], asyncio.Future]] = []
        self._server_task: asyncio.Task | None = None
        # HOLD_ENV: requests still to be held under version 0, the token they stop at, and the held ones
        # (future, response tokens, their log-probs, version), answered by the next abort
        self.holds_left, self.hold_at_token = parse_hold(os.environ.get(HOLD_ENV))
        self._to_hold: set[asyncio.Future] = set()
        self._held: list[tuple[asyncio.Future, list[int], list[float], Any]] = []
        self.max_batch = int(config.max_num_seqs)  # requests per batched decode, as vLLM schedules at most these
        # The gate of verl's async trainers (vLLMHttpServer's submission gate): closed by abort_all_requests,
        # opened by resume_generation; _aborting cuts the running decode at its next token.
        self._gate_closed = False
        self._rejecting = False
        self._gate_open = asyncio.Event()
        self._gate_open.set()
        self._aborting = False
        self._cut = 0  # requests the running decode answered "aborted", counted for abort_all_requests

    def ready(self) -> bool:
        return True

    def get_server_address(self) -> tuple[str, int]:
        return "127.0.0.1", 0

    def _max_new_tokens(self, prompt_len: int, sampling_params: dict) -> int:
        # the limit vLLMHttpServer.generate applies when the caller sends no max_tokens
        limit = sampling_params.get("max_tokens", sampling_params.get("max_new_tokens"))
        if limit is None:
            limit = min(self.config.response_length, self.config.prompt_length + self.config.response_length - prompt_len)
        max_len = self.config.max_model_len or self.model.config.max_position_embeddings
        return max(1, min(int(limit), max_len - prompt_len))

    def _generator(self, prompt_ids: list[int]) -> torch.Generator:
        """Seeded by (rollout seed, step, prompt, how many times this prompt was sampled this step).

        verl's request ids are random, and the n requests of a group arrive in any order; this seeding
        makes the *set* of a group's samples the same in every run with the same weights, which is
        what reproducible debugging and the end-to-end comparisons need.
        """
        key = (self.global_steps, tuple(prompt_ids))
        occurrence = self._occurrences.get(key, 0)
        self._occurrences[key] = occurrence + 1
        digest = hashlib.sha256(f"{self.seed}|{self.global_steps}|{prompt_ids}|{occurrence}".encode()).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))

    @staticmethod
    def _pick(logits: torch.Tensor, allowed: torch.Tensor, sampling_params: dict,
              generator: torch.Generator) -> tuple[int, float]:
        """The next token of one sequence from its logits ``[vocab]`` and its log-probability (after
        temperature, as verl's actor computes it; the full vocabulary, pad included)."""
        temperature = float(sampling_params.get("temperature", 1.0))
        if temperature <= 0:
            token = int(torch.argmax(torch.where(allowed, logits, -torch.inf)))
            return token, float(torch.log_softmax(logits, -1)[token])
        top_p = float(sampling_params.get("top_p", 1.0))
        top_k = int(sampling_params.get("top_k", -1))
        scaled = logits / temperature
        filtered = torch.where(allowed, scaled, -torch.inf)
        if top_k > 0:
            kth = torch.topk(filtered, min(top_k, filtered.numel())).values[-1]
            filtered[filtered < kth] = -torch.inf
        if top_p < 1.0:
            sorted_logits, order = torch.sort(filtered, descending=True)
            probs = torch.softmax(sorted_logits, -1)
            drop = probs.cumsum(-1) - probs > top_p
            filtered[order[drop]] = -torch.inf
        token = int(torch.multinomial(torch.softmax(filtered, -1), 1, generator=generator))
        return token, float(torch.log_softmax(scaled, -1)[token])

    def sample_batch(self, requests: list[tuple[list[int], dict, torch.Generator]]) -> Responses:
        """Sample every request of ``requests`` (prompt ids, sampling params, its own generator) to its end
        in one batched decode (:meth:`decode`). Returns, per request, (response token ids, their log-probabilities)."""
        for responses, _ in self.decode(requests):
            pass
        return responses

    @torch.no_grad()
    def decode(self, requests: list[tuple[list[int], dict, torch.Generator]]) -> Iterator[tuple[Responses, list[bool]]]:
        """The batched decode of ``requests`` (prompt ids, sampling params, its own generator), one token at a
        time: the distinct prompts are prefilled once each (a group's n samples share one prompt),
        left-padded to ``[prompts, longest]`` with an attention mask and position ids counted from each
        prompt's first token; each request then decodes from a copy of its prompt's KV cache, one forward
        pass per new token. Each row draws from its own generator and finishes at <eos> or its own length
        limit, so its tokens are those it would get alone (log-probs equal up to float32 summation order).

        Yields, after each new token of the rows still decoding, (per request (response token ids, their
        log-probabilities) so far, per request whether it decodes on); the last yield has no row decoding.
        Whoever stops iterating earlier holds each row's partial response."""
        n = len(requests)
        distinct: dict[tuple[int, ...], int] = {}
        rows = torch.tensor([distinct.setdefault(tuple(prompt), len(distinct)) for prompt, _, _ in requests])
        width = max(len(prompt) for prompt in distinct)
        input_ids = torch.full((len(distinct), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(distinct), width), dtype=torch.long)
        for row, prompt in enumerate(distinct):
            input_ids[row, width - len(prompt):] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt):] = 1
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        limits = [self._max_new_tokens(len(prompt), params) for prompt, params, _ in requests]
        # The padding token is not text: never sample it (log-probs still use the full vocabulary).
        allowed = torch.ones(self.model.config.vocab_size, dtype=torch.bool)
        if self.pad_token_id not in self.eos_token_ids:
            allowed[self.pad_token_id] = False
        # logits of the last position only: over a prefill the full logits of a 49k-token vocabulary are GBs
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, logits_to_keep=1)
        past = out.past_key_values
        if len(distinct) < n:
            past.batch_select_indices(rows)  # each request's own copy of its prompt's cache
        logits = out.logits[rows, -1].float()
        attention_mask, position_ids = attention_mask[rows], position_ids[rows, -1:]
        responses: list[tuple[list[int], list[float]]] = [([], []) for _ in requests]
        active = [True] * n
        while True:
            next_tokens = [self.pad_token_id] * n  # finished rows are fed padding; no other row attends to them
            for row, (_, params, generator) in enumerate(requests):
                if not active[row]:
                    continue
                token, log_prob = self._pick(logits[row], allowed, params, generator)
                responses[row][0].append(token)
                responses[row][1].append(log_prob)
                next_tokens[row] = token
                active[row] = token not in self.eos_token_ids and len(responses[row][0]) < limits[row]
            yield responses, active
            if not any(active):
                return
            attention_mask = torch.cat([attention_mask, torch.ones((n, 1), dtype=torch.long)], dim=1)
            position_ids = position_ids + 1
            out = self.model(input_ids=torch.tensor(next_tokens)[:, None], attention_mask=attention_mask,
                             position_ids=position_ids, past_key_values=past, use_cache=True, logits_to_keep=1)
            past = out.past_key_values
            logits = out.logits[:, -1].float()

    async def _serve_pending(self) -> None:
        """Answer the queued requests in batches; requests that arrive while a batch runs form the next.

        The decode yields to the actor's event loop after every token, so control calls run between two
        tokens; an abort (:meth:`abort_all_requests`) stops it there and the batch's unfinished requests are
        answered with their partial responses and "aborted"."""
        await asyncio.sleep(BATCH_WINDOW_S)  # the requests verl sends together arrive within milliseconds
        while self._pending and not self._aborting:
            batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
            version = self.global_steps  # weights change only after an abort has drained this loop
            held = set()
            try:
                for responses, active in self.decode([request for request, _ in batch]):
                    self._hold_at_their_token(batch, responses, active, version, held)
                    await asyncio.sleep(0)  # the actor's other calls (an abort) run between two tokens
                    if self._aborting:
                        break
            except Exception as error:  # every waiting request gets the error, not a hang
                for _, future in batch:
                    if not future.done():  # a request its caller cancelled meanwhile takes nothing
                        future.set_exception(error)
            else:
                for (_, future), (tokens, log_probs), running in zip(batch, responses, active):
                    if future in self._to_hold:  # it ended before its hold token: another request may be held
                        self._to_hold.discard(future)
                        self.holds_left += 1
                    if not future.done() and future not in held:
                        future.set_result((tokens, log_probs, "aborted" if running else "completed", version))
                        self._cut += running
            await asyncio.sleep(0)  # let the answered requests return and new ones queue

    def _hold_at_their_token(self, batch, responses: Responses, active: list[bool], version, held: set) -> None:
        """:data:`HOLD_ENV`: each request marked to be held that is still decoding at its hold token keeps its
        response so far for the next abort (the rest of its decode is discarded)."""
        for (_, future), (tokens, log_probs), running in zip(batch, responses, active):
            if running and future in self._to_hold and len(tokens) == self.hold_at_token:
                self._to_hold.discard(future)
                held.add(future)
                self._held.append((future, list(tokens), list(log_probs), version))
                logger.warning("hf rollout (%s): a response held at token %d until the next abort", HOLD_ENV,
                               len(tokens))

    async def _admit(self) -> bool:
        """Wait while the gate is closed (vLLMHttpServer._park_until_admitted); False: rejected at once."""
        while self._gate_closed:
            if self._rejecting:
                return False
            await self._gate_open.wait()
        return True

    async def generate(self, prompt_ids, sampling_params: dict, request_id: str, image_data=None, video_data=None,
                       **kwargs) -> TokenOutput:
        if image_data or video_data or kwargs.get("audio_data"):
            raise NotImplementedError("the hf rollout backend is text-only")
        want_log_probs = bool(sampling_params.get("logprobs"))
        if not await self._admit():
            return TokenOutput(token_ids=[], log_probs=[] if want_log_probs else None, stop_reason="aborted",
                               num_preempted=0, extra_fields={"global_steps": self.global_steps})
        prompt_ids = list(prompt_ids)
        future = asyncio.get_running_loop().create_future()
        if self.holds_left > 0 and self.global_steps == 0:
            self.holds_left -= 1
            self._to_hold.add(future)
        # the generator is drawn at arrival, so a request's seed does not depend on the batch it joins
        self._pending.append(((prompt_ids, dict(sampling_params), self._generator(prompt_ids)), future))
        if self._server_task is None or self._server_task.done():
            self._server_task = asyncio.ensure_future(self._serve_pending())
        tokens, log_probs, stop_reason, version = await future
        return TokenOutput(
            token_ids=tokens,
            log_probs=log_probs if want_log_probs else None,
            stop_reason=stop_reason,
            num_preempted=0,
            extra_fields={"global_steps": version},
        )

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict[str, Any]:
        """Close the gate, answer the queued requests "aborted" with no tokens, cut the running decode at its
        next token (its unfinished requests answer their partial responses, "aborted"; so do the held ones of
        :data:`HOLD_ENV`), and return once it has stopped, so that weights may change. With ``reject_request``
        requests arriving behind the closed gate are answered "aborted" at once instead of parking
        (vLLMHttpServer.abort_all_requests)."""
        if not self._gate_closed:  # a new event on this loop (an Event binds to the loop it is awaited on)
            self._gate_open = asyncio.Event()
        self._gate_closed, self._rejecting = True, reject_request
        self._aborting, self._cut = True, 0
        queued, self._pending = self._pending, []
        for _, future in queued:
            if not future.done():
                future.set_result(([], [], "aborted", self.global_steps))
        if self._server_task is not None and not self._server_task.done():
            await asyncio.wait({self._server_task})
        held, self._held = self._held, []
        for future, tokens, log_probs, version in held:
            if not future.done():
                future.set_result((tokens, log_probs, "aborted", version))
        self._aborting = False
        return {"aborted_count": len(queued) + self._cut + len(held), "request_ids": []}

    async def resume_generation(self) -> None:
        """Open the gate: parked requests are admitted (vLLMHttpServer.resume_generation)."""
        self._gate_closed = self._rejecting = False
        self._gate_open.set()

    def update_weights(self, state_dict: dict[str, torch.Tensor], peft_config: dict | None = None) -> None:
        """Load the actor's full weights, HF names. With ``peft_config`` (verl's LoRA base sync) the model
        is first wrapped with that adapter config and the names are those of the base model under the
        adapter (``...q_proj.base_layer.weight``)."""
        if peft_config is not None:
            self._wrap_lora(peft_config)
        model = self.model.get_base_model() if self.peft_config is not None else self.model
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        tied = {"lm_head.weight"} if self.model.config.tie_word_embeddings else set()
        missing = {name for name in missing if "lora_" not in name} - tied
        if missing or unexpected:
            raise RuntimeError(f"hf rollout weight sync: missing {sorted(missing)}, unexpected {unexpected}")

    def update_lora(self, peft_config: dict, adapter: dict[str, torch.Tensor]) -> None:
        """Serve the actor's LoRA adapter, as vLLM serves verl's LoRA request: ``peft_config`` is the
        actor's ``LoraConfig.to_dict()``, ``adapter`` its tensors named as ``peft.get_peft_model_state_dict``
        names them (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``). Every call
        replaces all adapter tensors; one missing is an error."""
        from peft import set_peft_model_state_dict

        self._wrap_lora(peft_config)
        result = set_peft_model_state_dict(self.model, adapter)
        expected = {name for name, _ in self.model.named_parameters() if "lora_" in name}
        missing = sorted(name for name in result.missing_keys if name in expected)
        if missing or result.unexpected_keys:
            raise RuntimeError(f"hf rollout LoRA sync: missing {missing}, unexpected {result.unexpected_keys}")

    def _wrap_lora(self, peft_config: dict) -> None:
        """Wrap the model with the adapter config on the first LoRA sync (a later, different config is an error)."""
        from peft import get_peft_config, get_peft_model

        if self.peft_config is None:
            self.model = get_peft_model(self.model, get_peft_config(dict(peft_config))).eval()
            self.peft_config = peft_config
        elif peft_config != self.peft_config:
            raise RuntimeError("hf rollout LoRA sync: the adapter's config changed during the run")

    def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps
        self._occurrences.clear()

    # Memory management and profiling have nothing to do on the CPU.
    def wake_up(self, tags: list[str] | None = None) -> None:
        return None

    def release_kv_cache(self) -> None:
        return None

    def resume_kv_cache(self) -> None:
        return None

    def sleep(self) -> None:
        return None

    def clear_kv_cache(self) -> None:
        return None

    def wait_for_requests_to_drain(self) -> None:
        return None

    def start_profile(self, **kwargs) -> None:
        return None

    def stop_profile(self) -> None:
        return None


class HFReplica(RolloutReplica):
    """verl rollout replica ``hf``: one :class:`HFRolloutServer` actor per replica."""

    async def launch_servers(self):
        server = (
            ray.remote(HFRolloutServer)
            .options(name=server_actor_name(self.replica_rank), max_concurrency=self.max_concurrency, num_cpus=0)
            .remote(config=self.config, model_config=self.model_config, replica_rank=self.replica_rank)
        )
        await server.ready.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"{ROLLOUT_NAME}-replica-{self.replica_rank}"  # a unique load-balancer key


class HFServerAdapter(BaseRollout):
    """The actor-worker side of rollout ``hf``: forwards the trained weights to the replica's server."""

    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1, **kwargs):
        super().__init__(config, model_config, device_mesh)
        world = self.config.tensor_model_parallel_size * self.config.data_parallel_size * (
            self.config.pipeline_model_parallel_size
        )
        rank = int(os.environ.get("RANK", 0))
        # A hybrid actor worker derives its replica from its rank; verl's CheckpointEngineWorker of a
        # standalone replica passes it (as vLLMServerAdapter takes it)
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.is_leader_rank = rank % world == 0
        self._server = None

    def _server_handle(self):
        if self._server is None:
            self._server = ray.get_actor(server_actor_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]):
        return None

    async def release(self):
        return None

    async def update_weights(self, weights, wire_format: str = "named_tensors", peft_config: dict | None = None,
                             base_sync_done: bool = True, global_steps: int | None = None, **kwargs: Any):
        """verl's weight sync (``ActorRolloutRefWorker.update_weights``): full weights with
        ``peft_config=None`` (no LoRA, or ``lora.merge=True``); with LoRA unmerged, the adapter's tensors
        and ``peft_config``, preceded once, where ``rollout.load_format`` is ``dummy``, by the base
        weights (``base_sync_done=False``), which the server loaded from the model path already and
        takes again."""
        if wire_format != "named_tensors":
            raise NotImplementedError(f"the hf rollout backend takes named tensors, not {wire_format!r}")
        # Every rank drains its generator (gathering a sharded tensor is collective); the leader ships. A
        # checkpoint engine's receive_weights may be an async generator (verl's engines are).
        state = {name: tensor.detach().to("cpu", torch.float32).clone()
                 async for name, tensor in ensure_async_iterator(weights)}
        if not self.is_leader_rank:
            return
        server = self._server_handle()
        if peft_config is not None and base_sync_done:
            await server.update_lora.remote(peft_config, state)
        else:
            await server.update_weights.remote(state, peft_config)
        if global_steps is not None:
            await server.set_global_steps.remote(global_steps)
