"""Is a predicted answer the gold one? One rule per kind of data source; never raises on model output.

- ``numeric`` (GSM8K): numbers with commas, currency signs, units, trailing ``.0``, simple fractions.
- ``math`` (AIME, OlympiadBench, AMC23, Minerva, LiveMathBench): math-verify (LaTeX, ``\\boxed{}``,
  fractions, intervals, expressions), each call bounded in time (:mod:`amir_verl.reward.bounded`).
- ``choice`` (AQUA-RAT): the option letter.
"""

from __future__ import annotations

import re
from fractions import Fraction

from amir_verl.reward.bounded import run_bounded

# data_source (as data_prep writes it) -> rule
SOURCE_RULES = {
    "openai/gsm8k": "numeric",
    "math-ai/aime25": "math",
    "Hothan/OlympiadBench": "math",
    "math-ai/amc23": "math",
    "math-ai/minervamath": "math",
    "opencompass/LiveMathBench": "math",
    "deepmind/aqua_rat": "choice",
}
DEFAULT_MATH_TIMEOUT_S = 5.0

_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d+)?|\.\d+)(?:\s*/\s*\d+)?")
_LETTER_PATTERNS = (
    re.compile(r"(?i)(?:option|choice|answer(?:\s+is)?)\s*[:\-]?\s*\(?([a-e])\)?(?![a-z])"),  # "Option c"
    re.compile(r"\(([A-Ea-e])\)"),  # "(b)"
    re.compile(r"(?<![A-Za-z])([A-E])(?![A-Za-z])"),  # "C) 42", "C."
)


def rule_for(data_source: str) -> str:
    """The rule of a data source; unknown sources fall back to math-verify."""
    return SOURCE_RULES.get(data_source, "math")


def _to_fraction(text: str) -> Fraction | None:
    try:
        if "/" in text:
            top, bottom = (part.strip() for part in text.split("/", 1))
            return Fraction(Fraction(top), Fraction(bottom)) if Fraction(bottom) != 0 else None
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def extract_number(text: str) -> Fraction | None:
    """The last number in ``text`` (after removing commas, currency and percent signs), exactly."""
    cleaned = text.replace(",", "").replace("$", "").replace("\\$", "").replace("%", "").replace("\\%", "")
    cleaned = re.sub(r"\\(?:d?frac)\{(\d+)\}\{(\d+)\}", r"\1/\2", cleaned)  # \frac{3}{4} -> 3/4
    cleaned = cleaned.replace("\\boxed", "").replace("{", " ").replace("}", " ")
    matches = _NUMBER.findall(cleaned[-2000:])
    return _to_fraction(matches[-1].replace(" ", "")) if matches else None


def numeric_equal(prediction: str, gold: str) -> bool:
    pred, ref = extract_number(prediction), extract_number(gold)
    return pred is not None and ref is not None and pred == ref


def choice_letter(text: str) -> str | None:
    """The option letter a response names: "C", "(C)", "C) 42", "Option C", "the answer is C."."""
    stripped = text.strip()[:200]
    if len(stripped) == 1 and stripped.upper() in "ABCDE":
        return stripped.upper()
    for pattern in _LETTER_PATTERNS:
        match = pattern.search(stripped)
        if match:
            return match.group(1).upper()
    return None


def _math_verify_equal(prediction: str, gold: str) -> bool:
    import logging

    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns that run_bounded does the timing

    # run_bounded enforces the time limit (math-verify's own alarms only work in a main thread)
    gold_parsed = parse(f"${gold}$" if "\\boxed" not in gold and "$" not in gold else gold, parsing_timeout=None)
    if not gold_parsed:
        gold_parsed = parse(gold, parsing_timeout=None)
    pred_parsed = parse(prediction if ("\\boxed" in prediction or "$" in prediction) else f"${prediction}$",
                        parsing_timeout=None)
    if not pred_parsed:
        pred_parsed = parse(prediction, parsing_timeout=None)
    return bool(gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed, timeout_seconds=None))


def math_equal(prediction: str, gold: str | list[str], timeout_s: float = DEFAULT_MATH_TIMEOUT_S) -> bool:
    """math-verify equivalence; a list of golds (OlympiadBench) matches if any matches. False on timeout."""
    golds = gold if isinstance(gold, (list, tuple)) else [gold]
    for one in golds:
        if numeric_equal(prediction, str(one)) and _is_plain_number(str(one)):
            return True
        if run_bounded(_math_verify_equal, (prediction, str(one)), timeout_s, default=False):
            return True
    return False


def _is_plain_number(text: str) -> bool:
    return re.fullmatch(r"\s*[-+]?\d+(?:\.\d+)?\s*", text) is not None


def is_correct(data_source: str, prediction: str | None, gold, math_timeout_s: float = DEFAULT_MATH_TIMEOUT_S) -> bool:
    """The correctness rule of ``data_source`` applied to an extracted answer (None -> False)."""
    if prediction is None or not prediction.strip() or gold is None:
        return False
    rule = rule_for(data_source)
    if rule == "numeric":
        return numeric_equal(prediction, str(gold))
    if rule == "choice":
        return choice_letter(prediction) == str(gold).strip().upper()
    return math_equal(prediction, gold, math_timeout_s)
