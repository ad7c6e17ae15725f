"""Is an extracted answer the gold one? One rule per kind of data source; never raises on model output.

Every rule decides on the WHOLE answer block: the block must denote one value. An answer that offers
two different values (a hedge "5 or 6", two boxes with different contents, "A or B", a list where the
gold is one value) is wrong, whatever one of its values is. A single value written in any common form
is right.

- ``numeric`` (GSM8K): one number, read exactly (:func:`read_number`): thousands separators in every
  LaTeX spelling, Unicode minus, ``\\frac``/``\\dfrac``/``\\tfrac``, mixed numbers, currency, percent,
  units and ``\\text{}`` around it. An arithmetic expression instead of a number (``2^{10}``) goes to
  math-verify, which compares its value.
- ``math`` (AIME, OlympiadBench, AMC23, Minerva, LiveMathBench): math-verify (LaTeX, ``\\boxed{}``,
  fractions, intervals, expressions), after the one-value checks; no plain-number shortcut.
- ``choice`` (AQUA-RAT): exactly one option letter (:func:`choice_letter`).

math-verify runs in a pool of helper processes (:mod:`amir_verl.reward.bounded`) with ONE time budget
per response, however many golds it has; a response that runs out of it is wrong.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
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
# An answer block longer than this is not one value in any common form; it is wrong without being read
# (this keeps every check linear and short; the response itself may be much longer, see template.py).
MAX_ANSWER_CHARS = 2_000


def rule_for(data_source: str) -> str:
    """The rule of a data source; unknown sources fall back to math-verify."""
    return SOURCE_RULES.get(data_source, "math")


def golds_of(ground_truth) -> list[str]:
    """The accepted golds: data_prep writes a list of strings; a plain string (verl's own GSM8K parquet)
    or a numpy array (a list column read back through pandas) is accepted too. Empty entries are dropped."""
    if ground_truth is None:
        return []
    items = [ground_truth] if isinstance(ground_truth, (str, int, float)) else list(ground_truth)
    return [str(item).strip() for item in items if item is not None and str(item).strip()]


# ----------------------------------------------------------------------------- unwrapping, shared by all rules

_WRAPPER_COMMANDS = ("boxed", "fbox", "text", "textbf", "textit", "mathrm", "mathbf", "mbox", "textrm", "emph")
_LEAD_IN = re.compile(
    r"^(?:(?:so|thus|therefore|hence),?\s+)?(?:the\s+)?(?:final\s+|correct\s+)?(?:answer|result|solution)"
    r"(?:\s+is|\s*[:=])\s*|^(?:answer|ans)\s*[:.]\s*",
    re.IGNORECASE,
)
_MARKDOWN = re.compile(r"^(?:\*\*|__|`)(.*)(?:\*\*|__|`)$", re.DOTALL)
_HEDGE = re.compile(r"(?<![A-Za-z\\])(?:or|either)(?![A-Za-z])|\\lor(?![A-Za-z])|\\vee(?![A-Za-z])", re.IGNORECASE)


def _braced(text: str, open_at: int) -> int:
    """Index just past the ``}`` that closes the ``{`` at ``open_at``; -1 if unbalanced (linear scan)."""
    depth = 0
    for index in range(open_at, len(text)):
        char = text[index]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return index + 1
    return -1


def boxed_contents(text: str) -> list[str]:
    """The contents of every ``\\boxed{...}`` / ``\\fbox{...}`` in ``text``, left to right."""
    found, at = [], 0
    pattern = re.compile(r"\\(?:boxed|fbox)\s*\{")
    while (match := pattern.search(text, at)) is not None:
        end = _braced(text, match.end() - 1)
        if end < 0:
            break
        found.append(text[match.end() : end - 1])
        at = end
    return found


def _unwrap_math_mode(text: str) -> str:
    for left, right in (("$$", "$$"), ("\\[", "\\]"), ("\\(", "\\)"), ("$", "$")):
        if text.startswith(left) and text.endswith(right) and len(text) >= len(left) + len(right):
            text = text[len(left) : len(text) - len(right)].strip()
    return text


def strip_delimiters(text: str) -> str:
    """Remove math-mode delimiters, a lead-in phrase ("The answer is"), markdown emphasis, and trailing
    punctuation (delimiters may stand on either side of the lead-in: "$The answer is 5$", "Answer: $5$").
    A "!" right after a value is a factorial ("3!" is 6), not punctuation."""
    text = _LEAD_IN.sub("", _unwrap_math_mode(text.strip()), count=1).strip()
    text = _MARKDOWN.sub(r"\1", text).strip()  # **42**, `42`
    return _strip_trailing_punctuation(_unwrap_math_mode(text)).strip()


def _strip_trailing_punctuation(text: str) -> str:
    """Drop trailing whitespace, "." and ";", and a "!" that follows no value: "5." and "Yes !" end in
    punctuation; "5!", "(n+1)!" and "5!!" end in a factorial."""
    end = len(text)
    while end and (text[end - 1] in " \t\r\n.;" or (text[end - 1] == "!" and not _ends_a_value(text[:end - 1]))):
        end -= 1
    return text[:end]


def _ends_a_value(text: str) -> bool:
    return bool(text) and (text[-1].isalnum() or text[-1] in "_)]}!")


def answer_values(answer: str) -> list[str] | None:
    """The value texts an answer block offers: the contents of its boxes if it has any, else the block.
    None when the block offers several different values (hedged, or boxes that differ)."""
    boxes = boxed_contents(answer)
    candidates = [strip_delimiters(box) for box in boxes] if boxes else [strip_delimiters(answer)]
    if len({re.sub(r"\s+", "", candidate) for candidate in candidates}) > 1:
        return None
    value = candidates[0]
    if not value or _HEDGE.search(_plain_text(value)):
        return None
    return [value]


def _plain_text(text: str) -> str:
    """``\\text{ or }`` -> `` or `` so that hedges written in LaTeX text are seen."""
    return _TEXT_COMMANDS.sub(r" \1 ", text)


# ----------------------------------------------------------------------------- numeric (GSM8K)

_MINUS = str.maketrans({"\u2212": "-", "\u2013": "-", "\u2012": "-", "\ufe63": "-", "\uff0d": "-"})
# thousands separators: , {,} ,\! \, \  thin / narrow no-break / no-break space, apostrophe
_SEP = r"(?:\{,\}|,\\!|,|\\,|\\ |\\;|\\:|\u2009|\u202f|\u00a0|')"
_GROUPED = re.compile(r"(?<![\d.])\d{1,3}(?:" + _SEP + r"\d{3})+(?![\d])")
_FRAC = re.compile(r"\\[dtc]?frac\s*\{\s*(-?\d+(?:\.\d+)?)\s*\}\s*\{\s*(-?\d+(?:\.\d+)?)\s*\}")
_FRAC_SHORT = re.compile(r"\\[dtc]?frac\s*(\d)\s*(\d)")
_UNIT_POWER = re.compile(r"(?<=[A-Za-z}])\s*\^\s*\{?\s*[23]\s*\}?")
_DEGREE = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\\circ|°|\\degree")
_TEXT_COMMANDS = re.compile(r"\\(?:" + "|".join(_WRAPPER_COMMANDS) + r"|operatorname)\s*\{([^{}]*)\}")
_CURRENCY = re.compile(r"\\\$|\$|€|£|¥|\\euro|\\pounds|\\%|%")
_SPACING = re.compile(r"\\[,;:! ]|~|\\quad|\\qquad|\\left|\\right")
_NUMBER = re.compile(r"(?<![\w.])(?:-\s*)?(?:\d+\s+\d+\s*/\s*\d+|\d+(?:\.\d+)?\s*/\s*\d+(?:\.\d+)?|\d+(?:\.\d*)?|\.\d+)")
_OPERATOR = re.compile(r"[\^*+×÷·]|[\d)\]}]!|\\(?:times|cdot|div|sqrt|pi|frac|dfrac|tfrac|log|ln|exp|sin|cos|binom|pm)|\d\s*-\s*\d|\d\(")
_SCALES = {"thousand": 10**3, "million": 10**6, "billion": 10**9}
_SCALE_WORD = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)\s*(thousand|million|billion)\b", re.IGNORECASE)
_EQUALS = re.compile(r"=|\\approx|≈|\\equiv")


@dataclass(frozen=True)
class NumberReading:
    """What a numeric answer says. kind: "one" (value set), "none" (no number), "several" (two different
    numbers), "expression" (arithmetic to evaluate; ``text`` holds it)."""

    kind: str
    value: Fraction | None = None
    text: str = ""


def _exact(token: str) -> Fraction | None:
    token = re.sub(r"\s+", " ", token.strip())
    negative = token.startswith("-")
    token = token.lstrip("-").strip()
    try:
        if " " in token and "/" in token:  # mixed number: 1 3/4
            whole, fraction = token.split(" ", 1)
            top, bottom = fraction.replace(" ", "").split("/")
            value = Fraction(whole) + Fraction(Fraction(top), Fraction(bottom))
        elif "/" in token:
            top, bottom = token.replace(" ", "").split("/")
            value = Fraction(Fraction(top), Fraction(bottom))
        else:
            value = Fraction(token.rstrip("."))
    except (ValueError, ZeroDivisionError):
        return None
    return -value if negative else value


def read_number(answer: str) -> NumberReading:
    """Read a GSM8K-style answer as one exact number (see the module docstring for the spellings)."""
    text = answer.translate(_MINUS)
    text = _GROUPED.sub(lambda match: re.sub(_SEP, "", match.group(0)), text)  # 1{,}234 -> 1234
    text = _FRAC.sub(lambda match: f" {match.group(1)}/{match.group(2)} ", text)
    text = _FRAC_SHORT.sub(r" \1/\2 ", text)
    text = _DEGREE.sub(" ", text)
    for _ in range(3):  # \text{\textbf{...}}: a few levels are plenty for a number
        text = _TEXT_COMMANDS.sub(r" \1 ", text)
    text = _UNIT_POWER.sub(" ", text)  # m^2, \text{cm}^3: a unit's power is not a second number
    text = _CURRENCY.sub(" ", text)
    text = _SPACING.sub(" ", text)
    sides = _EQUALS.split(text)
    text = sides[-1] if len(sides) > 1 else text  # "3 + 5 = 8": the value is after the last "="
    text = re.sub(r"(\d)(?:st|nd|rd|th)\b", r"\1", text)
    text = _SCALE_WORD.sub(lambda match: str(Fraction(match.group(1)) * _SCALES[match.group(2).lower()]), text)
    if _OPERATOR.search(text):
        return NumberReading("expression", text=text.strip())
    values = {value for value in (_exact(token) for token in _NUMBER.findall(text)) if value is not None}
    if not values:
        return NumberReading("none")
    if len(values) > 1:
        return NumberReading("several")
    return NumberReading("one", values.pop())


def numeric_equal(answer: str, golds: list[str], timeout_s: float = DEFAULT_MATH_TIMEOUT_S,
                  workers: int | None = None) -> bool:
    """GSM8K: the answer's one number equals a gold's exactly (an expression: math-verify decides)."""
    values = answer_values(answer)
    references = [reading.value for reading in map(read_number, golds) if reading.kind == "one"]
    if values is None or not references:
        return False
    reading = read_number(values[0])
    if reading.kind == "one":
        return reading.value in references
    if reading.kind == "expression":
        return math_equal(reading.text, golds, timeout_s, workers)
    return False


# ----------------------------------------------------------------------------- choice (AQUA-RAT)

_MARKED_LETTER = re.compile(
    r"(?i:option|choice)\s*[:\-]?\s*\(?([A-Ea-e])\)?(?![A-Za-z])"  # Option C, choice (c)
    r"|\(([A-Ea-e])\)"  # (C), (c)
    r"|(?<![A-Za-z\\])([A-E])\s*[).:](?!\d)"  # C) 42, C. 42, C: 42
)
_BARE_LETTER = re.compile(r"(?<![A-Za-z\\])([A-E])(?![A-Za-z])")
_ARTICLE = re.compile(r"(?<![A-Za-z])A(?=\s+[a-z])")  # "A total of ..." is an article, not option A


def choice_letter(answer: str) -> str | None:
    """The one option letter an answer names ("C", "(C)", "C) 42", "Option c", "\\boxed{C}",
    "\\text{(C)}", "The answer is C."); None when it names none, or two different letters ("A or B")."""
    values = answer_values(answer)
    if values is None:
        return None
    text = _plain_text(values[0]).strip()
    if len(text) == 1 and text.upper() in "ABCDE":
        return text.upper()
    marked = {next(group for group in match.groups() if group).upper() for match in _MARKED_LETTER.finditer(text)}
    letters = marked or set(_BARE_LETTER.findall(_ARTICLE.sub(" ", text)))
    return letters.pop() if len(letters) == 1 else None


# ----------------------------------------------------------------------------- math-verify sources

_TOP_LEVEL_SEPARATOR = re.compile(r",|;|\\text\s*\{\s*and\s*\}|(?<![A-Za-z\\])and(?![A-Za-z])")


def top_level_parts(text: str) -> int:
    """How many values a comma / semicolon / "and" list has at bracket depth 0 (``1, 2`` -> 2,
    ``(1, 2)`` -> 1, ``1,234`` -> 1 (thousands), ``\\{1, 2\\}`` -> 1)."""
    text = _GROUPED.sub(lambda match: re.sub(_SEP, "", match.group(0)), text)
    depth, parts, index = 0, 1, 0
    while index < len(text):
        char = text[index]
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth = max(0, depth - 1)
        elif depth == 0:
            match = _TOP_LEVEL_SEPARATOR.match(text, index)
            if match:
                parts += 1
                index = match.end()
                continue
        index += 1
    return parts


_MIXED_NUMBER = re.compile(r"(?<![\w.^}])(-?)(\d+)(?:\s+|\s*\\[dt]?frac\s*)(?:\{(\d+)\}\{(\d+)\}|(\d+)\s*/\s*(\d+))(?![\d])")
_PERCENT = re.compile(r"\\?%")


def normalize_math(value: str) -> str:
    """What math-verify reads: thousands separators removed in every LaTeX spelling (math-verify reads
    ``1\\,234`` as 234), mixed numbers as one fraction (``1 3/4``, ``1\\frac{3}{4}`` -> 7/4; math-verify
    reads a product), a percent sign dropped (math-verify cannot parse ``50\\%``)."""
    value = _GROUPED.sub(lambda match: re.sub(_SEP, "", match.group(0)), value)

    def improper(match: re.Match) -> str:
        sign, whole = match.group(1), int(match.group(2))
        top, bottom = (int(match.group(3)), int(match.group(4))) if match.group(3) else (int(match.group(5)), int(match.group(6)))
        return f"{sign}\\frac{{{whole * bottom + top}}}{{{bottom}}}" if bottom else match.group(0)

    value = _MIXED_NUMBER.sub(improper, value)
    return _PERCENT.sub("", value).strip()


def _verify_any(answer: str, golds: list[str]) -> bool:
    """math-verify: does ``answer`` equal any gold? Runs in a helper process (see math_equal)."""
    from math_verify import LatexExtractionConfig, parse, verify

    def latex(text: str):
        # the whole text as one LaTeX expression, so math-verify cannot pick one number out of it
        wrapped = text if text.startswith("$") else f"${text}$"
        return parse(wrapped, extraction_config=[LatexExtractionConfig(boxed_match_priority=0)],
                     parsing_timeout=None)

    parsed_answer = latex(normalize_math(answer))
    if not parsed_answer:
        return False
    for gold in golds:
        parsed_gold = latex(normalize_math(gold)) or parse(gold, parsing_timeout=None)
        if parsed_gold and verify(parsed_gold, parsed_answer, timeout_seconds=None):
            return True
    return False


def math_equal(answer: str, golds: list[str], timeout_s: float = DEFAULT_MATH_TIMEOUT_S,
               workers: int | None = None) -> bool:
    """math-verify equivalence with any gold, within ONE time budget for all golds; False on timeout."""
    return bool(golds) and bool(run_bounded(_verify_any, (answer, golds), timeout_s, default=False, workers=workers))


def math_answer_equal(answer: str, golds: list[str], timeout_s: float = DEFAULT_MATH_TIMEOUT_S,
                      workers: int | None = None) -> bool:
    """The math rule: one value (no hedge, no differing boxes, no list where every gold is one value),
    then math-verify."""
    values = answer_values(answer)
    if values is None:
        return False
    value = values[0]
    if top_level_parts(value) > 1 and all(top_level_parts(strip_delimiters(gold)) == 1 for gold in golds):
        return False
    return math_equal(value, golds, timeout_s, workers)


def is_correct(data_source: str, prediction: str | None, gold, math_timeout_s: float = DEFAULT_MATH_TIMEOUT_S,
               math_workers: int | None = None) -> bool:
    """The correctness rule of ``data_source`` applied to an extracted answer block (None -> False).
    ``gold``: a string or a list of accepted golds (any one matching is enough)."""
    golds = golds_of(gold)
    if prediction is None or not prediction.strip() or not golds or len(prediction) > MAX_ANSWER_CHARS:
        return False
    rule = rule_for(data_source)
    if rule == "numeric":
        return numeric_equal(prediction, golds, math_timeout_s, math_workers)
    if rule == "choice":
        return choice_letter(prediction) in {one.strip().upper() for one in golds}
    return math_answer_equal(prediction, golds, math_timeout_s, math_workers)
