"""AMIR-GRPO through a multi-turn tool-calling agent loop: verl 0.9.1's real ``main_ppo`` on the CPU backend, verl's
own ``ToolAgentLoop`` (tests/e2e/multi_turn_agent.py: a parser that reads every turn as a tool call and a cap of
:data:`TURN_TOKENS` tokens per turn, the rest verl's) with a verl function tool (tests/e2e/multi_turn_tool.py).

Each response is: the model's first turn, the tool's answer and the next generation prompt (verl's Continuous Token
merge; ``response_mask`` 0), the model's second turn. The run (:data:`STEPS` steps, :data:`PROMPTS` prompts x
:data:`GROUP` samples, a checkpoint every step, ``trainer.rollout_data_dir``, the probe of tests/e2e/probe.py)
is then recomputed from its own files, without the plugin's code: for step k, with the model of checkpoint
``global_step_{k-1}`` (step 1: the initial model, also verl's reference):

1. every response has a hole: the mask is 1s, 0s, 1s, and rebuilt from the token ids alone (the first turn ends at
   ``<eos>`` or after TURN_TOKENS tokens; the hole is exactly the tool's answer to the first turn's text, then
   the template's newline and ``A: ``) it equals verl's; the rollout's log-probs are 0.0 on the hole and, on the
   model's tokens, the checkpoint's (the second turn was generated after the tool's tokens); GRPO's advantages
   are 0 on the hole; the dump's text is the tokens' (tool answer included);
2. verl's ``old_log_probs`` / ``ref_log_prob`` are the checkpoint's / initial model's token log-probs;
3. the dumped ``amir_old_seq_logp`` / ``amir_ref_seq_logp`` are the masked means over the model's own tokens
   (l_old, l_ref), and the unmasked means (tool tokens counted) are not: the check would fail if AMIR ignored
   the mask;
4. the pairs mined by definition from the dumped scores (r_i - r_j > delta inside a group) are
   ``amir/num_pairs``; -J_pref from l_old and l_ref is ``amir/pref_loss`` (and the unmasked l gives another
   value); each sequence's dumped partners (``amir_partner_score`` / ``amir_partner_sign``) are its pairs'
   other sides' frozen scores l_old - l_ref with +1 (preferred) / -1 (rejected);
5. the actor masks too: ``actor/amir_pref_term`` is lambda * ``amir/pref_loss``, and ``actor/grad_norm`` is the
   autograd gradient's norm of verl's token-mean PPO loss plus lambda * (-J_pref), both over the model's tokens.

Each test prints the largest differences it measured. Run alone with
``python -m pytest -m e2e tests/e2e/test_multi_turn_cpu.py``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from amir_verl.cpu.launch import read_verl_metrics, run_main_ppo_together, verl_metrics_path
from amir_verl.metrics import LAMBDA, NUM_PAIRS, PREF_LOSS, PREF_TERM
from amir_verl.run_config import amir_overrides
from tests.e2e.multi_turn_agent import PARSER
from tests.e2e.multi_turn_tool import tool_output
from tests.e2e.probe import probed
from tests.e2e.support import BETA, DELTA, load_policy, pref_objective, response_log_probs, train_command
from tests.support import REPO

pytestmark = pytest.mark.e2e

STEPS, PROMPTS, GROUP = 2, 4, 4  # step 2: the first whose policy differs from the reference
TURN_TOKENS = 3  # new tokens per assistant turn at most
# turn 1, the hole (the longest tool answer, "saw 123.", its newline, "A: ", and a newline verl may insert, see
# expected_mask), turn 2
RESPONSE_LENGTH = TURN_TOKENS + len(tool_output("1" * TURN_TOKENS)) + 1 + 3 + 1 + TURN_TOKENS
AGENT = "amir_toy_tool_agent"
# tolerances; each test prints what it measured (2026-12-07: 9.5e-7, 4.8e-7, 7.5e-8 relative)
LOG_PROB_TOL = 1e-5  # token log-probs (verl's actor against transformers, the same float32 weights), partner scores
ROLLOUT_TOL = 1e-4  # the hf rollout's log-probs (batched decoding with a KV cache) against transformers
SEQ_TOL = 1e-5  # l_old, l_ref and amir/pref_loss, relative
GRAD_TOL = 1e-4  # actor/grad_norm, relative


def multi_turn_command(assets, workdir: Path):
    loops = workdir / "agent_loops.yaml"
    workdir.mkdir(parents=True, exist_ok=True)
    loops.write_text(json.dumps([{"name": AGENT, "_target_": "tests.e2e.multi_turn_agent.TurnCappedToolAgentLoop",
                                  "turn_tokens": TURN_TOKENS}]))  # JSON is YAML
    command = train_command(assets, workdir, STEPS, amir_overrides("amir_grpo", beta_dpo=BETA, delta_r=DELTA) + [
        f"data.max_response_length={RESPONSE_LENGTH}",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}",
        f"actor_rollout_ref.rollout.agent.default_agent_loop={AGENT}",
        f"actor_rollout_ref.rollout.multi_turn.format={PARSER}",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
        f"actor_rollout_ref.rollout.multi_turn.function_tool_path={REPO / 'tests' / 'e2e' / 'multi_turn_tool.py'}",
        f"trainer.rollout_data_dir={workdir / 'rollouts'}",
    ], save_freq=1, prompts_per_step=PROMPTS, group_size=GROUP)
    # the probe, and the repository on PYTHONPATH: the agent-loop workers import tests.e2e.multi_turn_agent
    return probed(command, workdir, REPO)


@pytest.fixture(scope="module")
def multi_turn_run(assets, tmp_path_factory):
    """(workdir, verl's metrics by step, {step: the probe's record}, {step: {sample key: dump row}}, wall s)."""
    workdir = tmp_path_factory.mktemp("multi_turn") / "amir_grpo"
    command = multi_turn_command(assets, workdir)
    start = time.monotonic()
    run_main_ppo_together({"multi_turn": command}, timeout=900)
    wall = time.monotonic() - start
    print(f"multi-turn run: {wall:.1f} s")
    metrics = read_verl_metrics(verl_metrics_path(command.log_path))
    records = {step: torch.load(workdir / "probe" / f"step_{step}.pt") for step in range(1, STEPS + 1)}
    dumps = {step: {row["uid"]: row for row in map(json.loads, (workdir / "rollouts" / f"{step}.jsonl").read_text().splitlines())}
             for step in range(1, STEPS + 1)}
    return workdir, metrics, records, dumps, wall


def expected_mask(response: list[int], tokenizer) -> list[int]:
    """The mask the two turns and the tool should give ``response``, from its token ids alone."""
    eos = tokenizer.eos_token_id
    first = next((t + 1 for t, token in enumerate(response[:TURN_TOKENS]) if token == eos), TURN_TOKENS)
    hole = tokenizer.encode(tool_output(tokenizer.decode(response[:first], skip_special_tokens=True)) + "\nA: ",
                            add_special_tokens=False)
    # verl's Qwen Continuous Token builder puts a newline (mask 0) after a turn that ends in <|im_end|>; the toy
    # tokenizer has none, and its unknown-token id stands in for it (the model may sample it)
    if response[first - 1] == tokenizer.convert_tokens_to_ids("<|im_end|>"):
        hole = tokenizer.encode("\n", add_special_tokens=False) + hole
    assert response[first:first + len(hole)] == hole, (response, first, hole)
    second = len(response) - first - len(hole)
    assert 1 <= second <= TURN_TOKENS, response
    return [1] * first + [0] * len(hole) + [1] * second


def masked_means(token_values: list[torch.Tensor], masks: list[list[int]]) -> torch.Tensor:
    """(N,) each sequence's mean of ``token_values`` over its mask: AMIR's l(o)."""
    return torch.stack([(v.double() * torch.tensor(m, dtype=torch.float64)).sum() / sum(m)
                        for v, m in zip(token_values, masks)])


def unmasked_means(token_values: list[torch.Tensor]) -> torch.Tensor:
    """(N,) the mean over every response token, the tool's counted: what ignoring the mask would give."""
    return torch.stack([v.double().mean() for v in token_values])


def dumped_pairs(record: dict, dump: dict) -> list[tuple[int, int]]:
    """Every ordered (preferred, rejected) pair of a group (same prompt uid) with r_i - r_j > delta, from the
    dump's scores; indices into the record's samples."""
    keys = record["keys"]
    groups = [key.rsplit("_", 2)[0] for key in keys]
    scores = [dump[key]["score"] for key in keys]
    return [(i, j) for i in range(len(keys)) for j in range(len(keys))
            if groups[i] == groups[j] and scores[i] - scores[j] > DELTA]


def test_every_response_has_the_tool_output_as_a_hole_in_its_mask(assets, multi_turn_run):
    """Check 1 of the module docstring, and the rollout's log-probs and GRPO's advantages around the holes."""
    from transformers import AutoTokenizer

    workdir, _, records, dumps, _ = multi_turn_run
    tokenizer = AutoTokenizer.from_pretrained(assets["model"])
    worst = 0.0
    for step, record in records.items():
        keys, responses, masks = record["keys"], record["responses"], record["response_mask"]
        assert len(keys) == PROMPTS * GROUP and all(key.endswith("_0") for key in keys)  # one output per session
        assert sorted(dumps[step]) == sorted(keys)
        for key, response, mask in zip(keys, responses, masks):
            assert mask == expected_mask(response, tokenizer), key
            edges = [t for t in range(1, len(mask)) if mask[t] != mask[t - 1]]
            assert mask[0] == 1 and len(edges) == 2, mask  # 1s, 0s, 1s: the hole is inside the response
            text = tokenizer.decode(response, skip_special_tokens=True)
            assert dumps[step][key]["output"] == text and "saw " in text
        policy = response_log_probs(load_policy(assets, workdir, step - 1), record)
        for lp, rollout, advantages, mask in zip(policy, record["rollout_log_probs"], record["advantages"], masks):
            model = torch.tensor(mask, dtype=torch.bool)
            rollout = torch.tensor(rollout)
            assert bool((rollout[~model] == 0).all()) and bool((torch.tensor(advantages)[~model] == 0).all())
            worst = max(worst, float((rollout[model] - lp[model]).abs().max()))
        lengths = [len(m) for m in masks]
        print(f"step {step}: {len(keys)} responses of {min(lengths)}-{max(lengths)} tokens, "
              f"{sum(m.count(0) for m in masks)} of their {sum(lengths)} tokens the tool's (mask 0)")
    print(f"rollout log-probs on the model's tokens against the checkpoint's: largest difference {worst:.3g}")
    assert worst < ROLLOUT_TOL


def test_dumped_amir_fields_pairs_and_loss_match_a_brute_force_that_excludes_the_tool_tokens(assets, multi_turn_run):
    """Checks 2-4 of the module docstring."""
    workdir, metrics, records, dumps, _ = multi_turn_run
    reference = load_policy(assets, workdir, 0)
    worst = dict.fromkeys(["old_log_probs", "ref_log_prob", "l_old", "l_ref", "partner"], 0.0)
    closest_unmasked, pairs_seen = float("inf"), 0
    for step, record in records.items():
        dump, keys, masks = dumps[step], record["keys"], record["response_mask"]
        policy = response_log_probs(load_policy(assets, workdir, step - 1), record)
        ref = response_log_probs(reference, record)
        for mine, name in ((policy, "old_log_probs"), (ref, "ref_log_prob")):
            for lp, verls in zip(mine, record[name]):
                worst[name] = max(worst[name], float((lp - torch.tensor(verls)).abs().max()))

        l_old, l_ref = masked_means(policy, masks), masked_means(ref, masks)
        dumped_old = torch.tensor([dump[key]["amir_old_seq_logp"] for key in keys], dtype=torch.float64)
        dumped_ref = torch.tensor([dump[key]["amir_ref_seq_logp"] for key in keys], dtype=torch.float64)
        worst["l_old"] = max(worst["l_old"], float(((dumped_old - l_old) / l_old).abs().max()))
        worst["l_ref"] = max(worst["l_ref"], float(((dumped_ref - l_ref) / l_ref).abs().max()))
        unmasked_off = ((dumped_old - unmasked_means(policy)) / dumped_old).abs()
        closest_unmasked = min(closest_unmasked, float(unmasked_off.min()))
        assert bool((unmasked_off > SEQ_TOL).all()), unmasked_off  # ignoring the mask fails for every sample
        if step > 1:  # the policy has moved off the reference
            assert float((l_old - l_ref).abs().max()) > 1e-4

        rewards = [sum(scores) for scores in record["rm_scores"]]
        assert [dump[key]["score"] for key in keys] == pytest.approx(rewards, abs=1e-6)
        pairs = dumped_pairs(record, dump)
        assert metrics[step][NUM_PAIRS] == len(pairs)
        pairs_seen += len(pairs)
        if pairs:
            expected = -float(pref_objective(l_old, l_ref, pairs))
            ignoring = -float(pref_objective(unmasked_means(policy), unmasked_means(ref), pairs))
            print(f"step {step}: {len(pairs)} pairs, amir/pref_loss {metrics[step][PREF_LOSS]:.8g}, brute force "
                  f"{expected:.8g}, with the tool's tokens counted {ignoring:.8g}")
            assert metrics[step][PREF_LOSS] == pytest.approx(expected, rel=SEQ_TOL)
            if step > 1:  # at step 1 the policy is the reference: every score is 0 and both losses are log 2
                assert metrics[step][PREF_LOSS] != pytest.approx(ignoring, rel=SEQ_TOL)
        score = l_old - l_ref  # the frozen partner score
        for k, key in enumerate(keys):
            mine = sorted([(float(score[j]), 1.0) for i, j in pairs if i == k]
                          + [(float(score[i]), -1.0) for i, j in pairs if j == k])
            dumped = sorted((s, sign) for s, sign in zip(dump[key]["amir_partner_score"], dump[key]["amir_partner_sign"])
                            if sign != 0)
            assert [sign for _, sign in dumped] == [sign for _, sign in mine], (step, key)
            for (s_mine, _), (s_dumped, _) in zip(mine, dumped):
                worst["partner"] = max(worst["partner"], abs(s_mine - s_dumped))
    print(f"largest differences (token log-probs and partner scores absolute, l relative): {worst}; the unmasked "
          f"mean's closest relative distance to a dumped l_old: {closest_unmasked:.3g}")
    assert pairs_seen > 0
    assert worst["old_log_probs"] < LOG_PROB_TOL and worst["ref_log_prob"] < LOG_PROB_TOL
    assert worst["l_old"] < SEQ_TOL and worst["l_ref"] < SEQ_TOL and worst["partner"] < LOG_PROB_TOL


def test_the_actors_update_is_the_brute_force_gradient_over_the_models_tokens(assets, multi_turn_run):
    """The actor side uses the mask too: with one mini-batch per step, ``actor/amir_pref_term`` is
    lambda * amir/pref_loss, and ``actor/grad_norm`` is the norm of the autograd gradient, at the checkpoint over the
    recorded batch, of verl's token-mean PPO loss over the model's tokens (the recorded advantages) plus
    lambda * (-J_pref) with l the masked means (KL coefficient 0, no entropy term)."""
    workdir, metrics, records, dumps, _ = multi_turn_run
    reference = load_policy(assets, workdir, 0)
    for step, record in records.items():
        m, masks = metrics[step], [torch.tensor(mask, dtype=torch.float64) for mask in record["response_mask"]]
        pairs = dumped_pairs(record, dumps[step])
        assert m[PREF_TERM] == pytest.approx(m[LAMBDA] * m[PREF_LOSS], rel=SEQ_TOL)
        model = load_policy(assets, workdir, step - 1)
        model.zero_grad()
        live = response_log_probs(model, record, grad=True)
        l_ref = masked_means(response_log_probs(reference, record), record["response_mask"])
        tokens = sum(float(mask.sum()) for mask in masks)
        pg = 0.0
        for logp, old, advantages, mask in zip(live, record["old_log_probs"], record["advantages"], masks):
            ratio = torch.exp(logp.double() - torch.tensor(old, dtype=torch.float64))
            assert float((ratio - 1).abs().max()) < 1e-4  # at the starting weights: no clipping applies
            pg = pg + (-torch.tensor(advantages, dtype=torch.float64) * ratio * mask).sum() / tokens
        pref = pref_objective(masked_means(live, record["response_mask"]), l_ref, pairs) if pairs else 0.0
        (pg - m[LAMBDA] * pref).backward()
        grad_norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None)))
        print(f"step {step}: lambda {m[LAMBDA]:.4g}, grad_norm {grad_norm:.8g} (verl {m['actor/grad_norm']:.8g})")
        assert m["actor/grad_norm"] == pytest.approx(grad_norm, rel=GRAD_TOL)
