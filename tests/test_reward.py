"""The calibrated reward: template parsing, answer equivalence per source, fuzzing, verl registration."""

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from amir_verl.reward import build_prompt, compute_score, parse_response
from amir_verl.reward.answers import choice_letter, is_correct, read_number
from amir_verl.reward.template import INSTRUCTION, MAX_RESPONSE_CHARS


def respond(answer, confidence="0.7", think="some reasoning"):
    return f"<think> {think} </think>\n<answer> {answer} </answer>\n<confidence> {confidence} </confidence>"


# ----------------------------------------------------------------------------- the template


def test_prompt_carries_question_options_and_instruction():
    (message,) = build_prompt("What is 2+2?", ["A) 3", "B) 4"])
    assert message["role"] == "user"
    assert message["content"].startswith("What is 2+2?\nOptions:\nA) 3\nB) 4")
    assert message["content"].endswith(INSTRUCTION)


def test_instruction_example_parses_as_a_well_formed_response():
    example = INSTRUCTION.split("Example: ", 1)[1]
    parsed = parse_response(example)
    assert parsed.format_ok and parsed.answer == "5" and parsed.confidence == 0.9


@pytest.mark.parametrize(
    "text,answer,confidence,problem",
    [
        (respond("42"), "42", 0.7, ""),
        ("  " + respond("42", "1") + "\n", "42", 1.0, ""),
        (respond("42", "1.5"), "42", None, "confidence is not a number"),
        (respond("42", "high"), "42", None, "confidence is not a number"),
        (respond("42", "80%"), "42", None, "confidence is not a number"),
        (respond(""), None, 0.7, "empty answer"),
        (respond("42") + " thanks!", "42", 0.7, "text outside"),
        ("<answer>1</answer><think>x</think><confidence>0.5</confidence>", "1", 0.5, "out of order"),
        (respond("42") + respond("43"), "43", 0.7, "exactly once"),
        ("<think><think>x</think></think><answer>1</answer><confidence>0.5</confidence>", "1", 0.5, "exactly once"),
        ("The answer is 42.", None, None, "exactly once"),
        ("", None, None, "exactly once"),
    ],
)
def test_parse_response(text, answer, confidence, problem):
    parsed = parse_response(text)
    assert parsed.answer == answer and parsed.confidence == confidence
    assert parsed.format_ok == (problem == "")
    assert problem in parsed.problem


# ----------------------------------------------------------------------------- answers (the case table: test_grader_cases.py)


def test_missing_answer_is_not_correct():
    assert not is_correct("openai/gsm8k", None, "3")
    assert not is_correct("math-ai/aime25", "   ", "3")
    assert read_number("no digits").kind == "none" and choice_letter("nothing here") is None


# ----------------------------------------------------------------------------- the score


def test_score_components():
    correct = compute_score("openai/gsm8k", respond("18", "0.8"), "18")
    assert correct["acc"] == 1.0 and correct["format"] == 1.0
    assert correct["brier"] == pytest.approx(0.04) and correct["score"] == pytest.approx(1.0 + 0.1 + 0.25 * 0.96)
    wrong = compute_score("openai/gsm8k", respond("17", "0.8"), "18")
    assert wrong["acc"] == 0.0 and wrong["score"] == pytest.approx(0.1 + 0.25 * (1 - 0.64))
    no_confidence = compute_score("openai/gsm8k", "<think>x</think><answer>18</answer>", "18")
    assert no_confidence["acc"] == 1.0 and no_confidence["format"] == 0.0
    assert no_confidence["score"] == 1.0 and no_confidence["brier"] == 1.0 and no_confidence["confidence"] == -1.0
    weighted = compute_score("openai/gsm8k", respond("18", "1"), "18", w_corr=2.0, w_fmt=0.5, w_calib=1.0)
    assert weighted["score"] == pytest.approx(3.5)
    assert compute_score("deepmind/aqua_rat", respond("(b)", "0.5"), "B")["pred"] == "B"


def test_default_margin_needs_a_correctness_difference():
    """With the default weights, amir.delta_r=0.5 pairs correct over incorrect and nothing else."""
    from amir_verl.config import AmirConfig

    best_wrong = compute_score("openai/gsm8k", respond("1", "0"), "2")["score"]
    worst_right = compute_score("openai/gsm8k", "<answer>2</answer>", "2")["score"]
    delta = AmirConfig().delta_r
    assert best_wrong < delta and worst_right - best_wrong > delta


@pytest.mark.parametrize("bad", [{"w_corr": -1}, {"w_fmt": float("nan")}, {"w_calib": "x"}])
def test_bad_weights_raise(bad):
    with pytest.raises(ValueError, match="reward weight"):
        compute_score("openai/gsm8k", respond("1"), "1", **bad)


hostile = st.one_of(
    st.text(max_size=300),
    st.lists(st.sampled_from(["<think>", "</think>", "<answer>", "</answer>", "<confidence>", "</confidence>",
                              "\\boxed{", "}", "{", "1/0", "0.5", "$", "\\frac{1}{0}", "x", " ", "\n", "9" * 50]),
             max_size=60).map("".join),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile, st.sampled_from(["openai/gsm8k", "math-ai/aime25", "deepmind/aqua_rat", "unknown/source"]))
def test_fuzz_never_raises_and_stays_in_time(text, source):
    start = time.monotonic()
    result = compute_score(source, text, "3", math_timeout_s=2)
    # the limit, plus a helper restart (about 1 s) when the previous call hit the limit, plus CI slack
    assert time.monotonic() - start < 10
    assert set(result) >= {"score", "acc", "pred", "format", "confidence", "brier"}
    assert 0 <= result["score"] <= 1.35 + 1e-9


def test_huge_and_deeply_nested_inputs_stay_in_time():
    for text in (
        "<answer>" * 100_000,
        respond("(" * 5000 + "1" + ")" * 5000),
        respond("\\frac{" * 300 + "1" + "}" * 300),
        respond("9" * 5000 + "^" + "9" * 5000),
    ):
        start = time.monotonic()
        result = compute_score("math-ai/minervamath", text, "3", math_timeout_s=2)
        assert time.monotonic() - start < 10, text[:50]
        assert result["score"] >= 0


def test_long_responses_are_parsed_whole_up_to_the_bound():
    """The README's rule: the last <answer> block counts, for any length up to MAX_RESPONSE_CHARS (1,024x the
    recipes' 1,024-token responses); parsing is linear in the length."""
    assert MAX_RESPONSE_CHARS >= 16 * 1024
    long_think = respond("42", think="step " * 5_200)  # a well-formed 26k-character response
    assert len(long_think) > 26_000
    graded = compute_score("openai/gsm8k", long_think, ["42"])
    assert graded["format"] == 1.0 and graded["acc"] == 1.0
    rambling = respond("42") + " and so on" * 3_000  # a right answer, then 30k characters of repetition
    graded = compute_score("openai/gsm8k", rambling, ["42"])
    assert graded["acc"] == 1.0 and graded["format"] == 0.0 and "outside" in graded["format_problem"]

    def parse_seconds(size: int) -> float:
        text = respond("42", think="x" * (size - len(respond("42", think=""))))
        assert len(text) == size
        start = time.perf_counter()
        parsed = parse_response(text)
        assert parsed.format_ok and parsed.answer == "42"
        return time.perf_counter() - start

    at_bound, tenth = parse_seconds(MAX_RESPONSE_CHARS), parse_seconds(MAX_RESPONSE_CHARS // 10)
    assert at_bound < 0.5 and at_bound < 40 * max(tenth, 1e-4)  # linear (generous for a noisy machine)


def test_beyond_the_bound_a_response_is_not_graded():
    text = "x" * MAX_RESPONSE_CHARS + respond("3")
    start = time.monotonic()
    graded = compute_score("openai/gsm8k", text, ["3"])
    assert time.monotonic() - start < 1.0
    assert graded["acc"] == 0.0 and graded["format"] == 0.0
    assert graded["format_problem"] == f"response longer than {MAX_RESPONSE_CHARS} characters"


def test_registered_in_verls_reward_loop_registry():
    from omegaconf import OmegaConf

    from verl.experimental.reward_loop.reward_manager.registry import get_reward_manager_cls

    from amir_verl.reward.manager import AmirCalibratedRewardManager, weights_from_config

    assert get_reward_manager_cls("amir_calibrated") is AmirCalibratedRewardManager
    config = OmegaConf.create({"reward": {"reward_kwargs": {"w_corr": 2.0, "overlong_buffer_cfg": None}}})
    assert weights_from_config(config).w_corr == 2.0 and weights_from_config(config).w_fmt == 0.1


def test_bounded_calls_from_threads_do_not_disturb_each_other():
    """A call that runs out of time kills only its own work: concurrent calls still get their results."""
    import operator
    import threading

    from amir_verl.reward.bounded import run_bounded

    results = {}

    def call(name, fn, args):
        start = time.monotonic()
        results[name] = (run_bounded(fn, args, 1.0, "timed out"), time.monotonic() - start)

    threads = [threading.Thread(target=call, args=("slow", time.sleep, (5,)))]
    threads += [threading.Thread(target=call, args=(f"add{i}", operator.add, (i, 1))) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["slow"][0] == "timed out"
    assert all(results[f"add{i}"][0] == i + 1 for i in range(6))
    assert run_bounded(operator.add, (2, 2), 1.0, None) == 4  # the helper was replaced
