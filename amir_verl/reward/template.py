"""The one prompt template of amir-verl and its parser (pure python).

A response must be laid out as

    <think> reasoning </think>
    <answer> final answer </answer>
    <confidence> a number in [0, 1] </confidence>

each tag exactly once, in this order, with nothing but whitespace between the blocks or after the
last. ``data_prep`` builds every prompt with :func:`build_prompt` and the reward parses with
:func:`parse_response`, so the two cannot drift apart.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

THINK, ANSWER, CONFIDENCE = "think", "answer", "confidence"
TAGS = (THINK, ANSWER, CONFIDENCE)

INSTRUCTION = (
    "Solve the problem. Reason step by step inside <think> </think>. Then write only the final answer inside "
    "<answer> </answer>, and how confident you are that it is correct, as a number between 0 and 1, inside "
    "<confidence> </confidence>. Use each tag exactly once, in this order, and write nothing after "
    "</confidence>.\nExample: <think> 2 + 3 = 5 </think> <answer> 5 </answer> <confidence> 0.9 </confidence>"
)
CHOICE_INSTRUCTION = "Answer with the letter of the correct option."

# Responses up to this many characters are parsed whole (in time linear in their length): 1,024x the paper
# recipes' max_response_length of 1,024 tokens. A longer response is not parsed at all: no answer, format 0
# (problem "response longer than ..."), so a runaway generation can never be graded correct.
MAX_RESPONSE_CHARS = 1 << 20
_NUMBER = re.compile(r"\s*([+-]?(?:\d+(?:\.\d*)?|\.\d+))\s*")


def build_prompt(question: str, options: list[str] | None = None) -> list[dict[str, str]]:
    """verl's chat prompt (one user message): the question, its options if any, then the instruction."""
    text = question.strip()
    if options:
        text += "\nOptions:\n" + "\n".join(option.strip() for option in options) + "\n" + CHOICE_INSTRUCTION
    return [{"role": "user", "content": f"{text}\n\n{INSTRUCTION}"}]


@dataclass(frozen=True)
class ParsedResponse:
    """answer: text of the answer block (None if absent); confidence: q in [0, 1] or None;
    format_ok: the exact layout above; problem: why the format failed ("" when it did not)."""

    answer: str | None
    confidence: float | None
    format_ok: bool
    problem: str


def _blocks(text: str, tag: str) -> list[tuple[int, int, str]]:
    """All ``<tag> ... </tag>`` blocks as (start, end, inner text), scanning left to right (linear)."""
    opening, closing = f"<{tag}>", f"</{tag}>"
    found, at = [], 0
    while True:
        start = text.find(opening, at)
        if start < 0:
            return found
        end = text.find(closing, start + len(opening))
        if end < 0:
            return found
        found.append((start, end + len(closing), text[start + len(opening) : end]))
        at = end + len(closing)


def parse_confidence(text: str) -> float | None:
    """A plain decimal number in [0, 1] ("0.8", " 1 ", ".25"); anything else is None."""
    match = _NUMBER.fullmatch(text)
    if not match:
        return None
    value = float(match.group(1))
    return value if 0.0 <= value <= 1.0 else None


def parse_response(text: object) -> ParsedResponse:
    """Parse a model response; never raises. The answer is taken from the last answer block even when
    the layout is wrong (correctness still counts); the confidence only when it is well-formed."""
    if not isinstance(text, str):
        return ParsedResponse(None, None, False, "response is not text")
    if len(text) > MAX_RESPONSE_CHARS:
        return ParsedResponse(None, None, False, f"response longer than {MAX_RESPONSE_CHARS} characters")
    blocks = {tag: _blocks(text, tag) for tag in TAGS}
    answer = (blocks[ANSWER][-1][2].strip() or None) if blocks[ANSWER] else None
    confidence = parse_confidence(blocks[CONFIDENCE][-1][2]) if blocks[CONFIDENCE] else None

    problem = ""
    counts = {tag: text.count(f"<{tag}>") + text.count(f"</{tag}>") for tag in TAGS}
    if any(len(blocks[tag]) != 1 or counts[tag] != 2 for tag in TAGS):
        problem = "each of <think>, <answer>, <confidence> must appear exactly once"
    else:
        (t0, t1, _), (a0, a1, _), (c0, c1, _) = (blocks[tag][0] for tag in TAGS)
        if not (t1 <= a0 and a1 <= c0):
            problem = "blocks out of order: think, answer, confidence"
        elif text[:t0].strip() or text[t1:a0].strip() or text[a1:c0].strip() or text[c1:].strip():
            problem = "text outside the three blocks"
        elif not answer:
            problem = "empty answer"
        elif confidence is None:
            problem = "confidence is not a number in [0, 1]"
    return ParsedResponse(answer, confidence, problem == "", problem)
