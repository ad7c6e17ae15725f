"""The grader against answers real models write: one table, each expected value decided from the rules
in amir_verl/reward/answers.py (and the README's grading table) before running.

The rules: the answer block must denote ONE value. Hedges ("or", "either"), two boxes with different
contents, two different option letters, or a list where the gold is one value are wrong. A single value
in any common spelling is right: GSM8K reads it as an exact number, AQUA-RAT as one option letter, the
math-verify sources compare it with math-verify.
"""

import time

import numpy as np
import pytest

from amir_verl.reward import compute_score
from amir_verl.reward.answers import MAX_ANSWER_CHARS, is_correct

GSM, AQUA = "openai/gsm8k", "deepmind/aqua_rat"
MINERVA, AIME, AMC, LIVE, OLYMPIAD = ("math-ai/minervamath", "math-ai/aime25", "math-ai/amc23",
                                      "opencompass/LiveMathBench", "Hothan/OlympiadBench")

# (source, answer block, gold, expected correct)
CASES = [
    # ---- GSM8K: one number, every common spelling of it is right
    (GSM, "1234", "1234", True),
    (GSM, "1,234", "1234", True),
    (GSM, "1{,}234", "1234", True),
    (GSM, "1,\\!234", "1234", True),
    (GSM, "1\\,234", "1234", True),
    (GSM, "1\u2009234", "1234", True),  # thin space
    (GSM, "1\u202f234", "1234", True),  # narrow no-break space
    (GSM, "1\\ 234", "1234", True),
    (GSM, "$1,234", "1234", True),
    (GSM, "\\$1,234.00", "1234", True),
    (GSM, "1234.0", "1234", True),
    (GSM, "1234.", "1234", True),
    (GSM, "\\boxed{1234}", "1234", True),
    (GSM, "$\\boxed{1,234}$", "1234", True),
    (GSM, "\\(1234\\)", "1234", True),
    (GSM, "The answer is 1234.", "1234", True),
    (GSM, "The final answer is $1234$", "1234", True),
    (GSM, "Answer: 1234", "1234", True),
    (GSM, "1234 dollars", "1234", True),
    (GSM, "\\text{1234 dollars}", "1234", True),
    (GSM, "1234 \\text{ dollars}", "1234", True),
    (GSM, "x = 1234", "1234", True),
    (GSM, "1000 + 234 = 1234", "1234", True),
    (GSM, "\\boxed{1234} \\boxed{1234}", "1234", True),  # the same value twice is one value
    (GSM, "**1234**", "1234", True),
    (GSM, "1234 (one thousand two hundred thirty-four)", "1234", True),
    (GSM, "1,234,000", "1234000", True),
    (GSM, "1.234 million", "1234000", True),
    (GSM, "1234\n", "1234", True),
    (GSM, "\u22121234", "-1234", True),  # Unicode minus
    (GSM, "\u2212 1234", "1234", False),
    (GSM, "-15", "-15", True),
    (GSM, "\u221215", "-15", True),
    (GSM, "\u201315", "-15", True),  # en dash used as minus
    (GSM, "$-15$", "-15", True),
    (GSM, "15", "-15", False),
    (GSM, "\\frac{3}{4}", "0.75", True),
    (GSM, "\\dfrac{3}{4}", "0.75", True),
    (GSM, "\\tfrac{3}{4}", "0.75", True),
    (GSM, "\\frac34", "0.75", True),
    (GSM, "3/4", "0.75", True),
    (GSM, ".75", "0.75", True),
    (GSM, "0.750", "0.75", True),
    (GSM, "75%", "0.75", False),  # a percent sign is dropped: 75 is not 0.75
    (GSM, "1 3/4", "1.75", True),
    (GSM, "1\\frac{3}{4}", "1.75", True),
    (GSM, "1\\tfrac{3}{4}", "1.75", True),
    (GSM, "7/4", "1.75", True),
    (GSM, "\\frac{7}{4}", "1.75", True),
    (GSM, "1 3/5", "1.75", False),
    (GSM, "72 \\text{ m}^2", "72", True),
    (GSM, "72 m^2", "72", True),
    (GSM, "72 \\mathrm{m^2}", "72", True),
    (GSM, "72 \\text{cm}^{2}", "72", True),
    (GSM, "72 cm^3", "72", True),
    (GSM, "72 square meters", "72", True),
    (GSM, "72^\\circ", "72", True),
    (GSM, "72\u00b0", "72", True),
    (GSM, "25%", "25", True),
    (GSM, "25\\%", "25", True),
    (GSM, "25 percent", "25", True),
    (GSM, "0.25", "25", False),
    (GSM, "\\$18.00", "18", True),
    (GSM, "18 eggs", "18", True),
    (GSM, "$18 per hour", "18", True),
    (GSM, "18.5", "18", False),
    (GSM, "5th", "5", True),
    (GSM, "10/2", "5", True),
    (GSM, "2+3", "5", True),  # an expression: math-verify evaluates it
    (GSM, "2^{10}", "1024", True),
    (GSM, "10^6", "1000000", True),
    (GSM, "1 million", "1000000", True),
    (GSM, "5!", "120", True),  # a factorial, not an exclamation: math-verify evaluates it
    (GSM, "5!.", "120", True),
    (GSM, "Wow! It is 42", "42", True),  # an exclamation, not a factorial
    # ---- GSM8K: wrong values, and right values offered next to wrong ones
    (GSM, "1235", "1234", False),
    (GSM, "1,235", "1234", False),
    (GSM, "12340", "1234", False),
    (GSM, "123.4", "1234", False),
    (GSM, "1234 or 1235", "1235", False),
    (GSM, "1235 or 1234", "1235", False),
    (GSM, "either 1234 or 1235", "1234", False),
    (GSM, "\\boxed{1234} \\boxed{1235}", "1235", False),
    (GSM, "\\boxed{1234}, \\boxed{1235}", "1234", False),
    (GSM, "1234, 1235", "1235", False),
    (GSM, "1234 \\text{ or } 1235", "1234", False),
    (GSM, "between 1200 and 1300", "1234", False),
    (GSM, "12,34", "1234", False),  # not a thousands grouping: two numbers
    (GSM, "1 234", "1234", False),  # a plain space is not a thousands separator: two numbers
    (GSM, "one thousand two hundred thirty-four", "1234", False),
    (GSM, "\\sqrt{5}", "5", False),  # no last-number shortcut
    (GSM, "2^{10}", "10", False),
    (GSM, "3\\pi", "3", False),
    (GSM, "1234^2", "1234", False),
    (GSM, "5!", "5", False),
    (GSM, "5 apples and 3 oranges", "5", False),
    (GSM, "3 \\times 5 = 15", "5", False),
    (GSM, "2 hours and 30 minutes", "2.5", False),
    (GSM, "none", "1234", False),
    (GSM, "", "1234", False),
    (GSM, "   ", "1234", False),
    # ---- AQUA-RAT: exactly one option letter
    (AQUA, "C", "C", True),
    (AQUA, "c", "C", True),
    (AQUA, "(C)", "C", True),
    (AQUA, "(c)", "C", True),
    (AQUA, "C)", "C", True),
    (AQUA, "C.", "C", True),
    (AQUA, "C:", "C", True),
    (AQUA, "[C]", "C", True),
    (AQUA, "\\boxed{C}", "C", True),
    (AQUA, "$\\boxed{\\text{C}}$", "C", True),
    (AQUA, "\\text{C}", "C", True),
    (AQUA, "\\textbf{(C)}", "C", True),
    (AQUA, "**C**", "C", True),
    (AQUA, "Option C", "C", True),
    (AQUA, "option (c)", "C", True),
    (AQUA, "Choice C", "C", True),
    (AQUA, "The answer is C", "C", True),
    (AQUA, "The answer is (C).", "C", True),
    (AQUA, "C) 42 meters", "C", True),
    (AQUA, "(C) 42", "C", True),
    (AQUA, "C. 42 km/h", "C", True),
    (AQUA, "C) 10 C", "C", True),  # degrees Celsius after the marked letter
    (AQUA, "A total of 42, option C", "C", True),  # "A" is an article here
    (AQUA, "B", "C", False),
    (AQUA, "B) 10 C", "C", False),
    (AQUA, "A or B", "A", False),
    (AQUA, "B or A", "A", False),
    (AQUA, "A, B", "A", False),
    (AQUA, "(A) or (B)", "A", False),
    (AQUA, "A and C", "A", False),
    (AQUA, "\\boxed{A} \\boxed{C}", "C", False),
    (AQUA, "either C or D", "C", False),
    (AQUA, "C) 42 or D) 45", "C", False),
    (AQUA, "42", "C", False),
    (AQUA, "F", "C", False),
    (AQUA, "CD", "C", False),
    (AQUA, "None of these", "C", False),
    (AQUA, "", "C", False),
    # ---- math-verify sources: one value, equivalence by math-verify
    (AIME, "\\boxed{70}", "70", True),
    (AIME, "070", "70", True),
    (AIME, "$70$", "70", True),
    (AIME, "70.", "70", True),
    (AIME, "The final answer is $70$.", "70", True),
    (AIME, "x = 70", "70", True),
    (AIME, "71", "70", False),
    (AIME, "70 or 71", "70", False),
    (AIME, "\\boxed{70} \\boxed{71}", "70", False),
    (AIME, "70, 71", "70", False),
    (AIME, "70; 71", "70", False),
    (AIME, "70 and 71", "70", False),
    (AIME, "1,234", "1234", True),
    (AIME, "1{,}234", "1234", True),
    (AIME, "1\\,234", "1234", True),
    (AIME, "1,\\!234", "1234", True),
    (MINERVA, "\\sqrt{5}", "5", False),
    (MINERVA, "2^{10}", "10", False),
    (MINERVA, "3\\pi", "3", False),
    (MINERVA, "\\frac{1}{2}", "0.5", True),
    (MINERVA, "0.5", "\\frac{1}{2}", True),
    (MINERVA, "\\dfrac{1}{2}", "\\frac12", True),
    (MINERVA, "\\tfrac{3}{4}", "\\frac34", True),
    (MINERVA, "2\\sqrt{2}", "\\sqrt{8}", True),
    (MINERVA, "3\\sqrt{2}", "\\sqrt{18}", True),
    (MINERVA, "\\sqrt{3}", "\\sqrt{2}", False),
    (MINERVA, "\\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt3}{2}", True),
    (MINERVA, "\\pi/2", "\\frac{\\pi}{2}", True),
    (MINERVA, "10^{-3}", "0.001", True),
    (MINERVA, "0.333", "\\frac13", False),
    (MINERVA, "50\\%", "50", True),
    (MINERVA, "\u221215", "-15", True),
    (MINERVA, "1 3/4", "\\frac{7}{4}", True),
    (MINERVA, "1\\frac{3}{4}", "\\frac{7}{4}", True),
    (MINERVA, "\\pm 2", "2", False),
    (MINERVA, "x = 1 \\text{ or } x = 2", "1", False),
    (LIVE, "[1, 2)", "[1,2)", True),
    (LIVE, "(1, 2)", "[1,2)", False),
    (LIVE, "x^2 + 2x + 1", "(x+1)^2", True),
    (LIVE, "x^2 + 2x", "(x+1)^2", False),
    (LIVE, "1, 2", "1, 2", True),
    (LIVE, "\\{1, 2\\}", "1,2", True),
    (LIVE, "1, 2", "1", False),
    (LIVE, "\\infty", "\\infty", True),
    (AMC, "\\boxed{\\frac{7}{4}}", "\\frac{7}{4}", True),
    (AMC, "\\textbf{(C) }\\frac{7}{4}", "\\frac{7}{4}", False),  # an option label is a second value
    (AMC, "either 3 or 4", "3", False),
    (AMC, "", "3", False),
    (AMC, "\\boxed{}", "3", False),
    (AMC, "3!", "6", True),  # "!" after a value is a factorial
    (AMC, "3!", "3", False),
    (AMC, "\\boxed{(2+1)!}", "6", True),
    # ---- OlympiadBench: a list of accepted golds, any one matches; still one value
    (OLYMPIAD, "3", ["2", "3"], True),
    (OLYMPIAD, "4", ["2", "3"], False),
    (OLYMPIAD, "2 or 3", ["2", "3"], False),
    (OLYMPIAD, "2, 3", ["2", "3"], False),
    (OLYMPIAD, "\\frac{1}{2}", ["\\frac{1}{2}"], True),
    # ---- hostile input: wrong, within the time budget, never an exception
    (AIME, "9^9^9^9", "5", False),
    (AIME, "((9!)!)!", "5", False),
    (GSM, "9^{9^{9^{9}}}", "5", False),
    (AIME, "\\frac{1}{0}", "0", False),
    (GSM, "\\frac{1}{0}", "0", False),
    (AIME, "{" * 1000, "1", False),
    (GSM, "}" * 1000, "5", False),
    (GSM, "}}}5", "5", True),  # text around one number is ignored, even stray braces
    (GSM, "1" * 1900, "1", False),
    (AIME, "nan", "5", False),
    (GSM, "NaN", "5", False),
    (GSM, "inf", "5", False),
    (GSM, "\\infty", "5", False),
    (GSM, "\x00", "5", False),
    (AQUA, "\x00C", "C", True),
    (GSM, "5" * (MAX_ANSWER_CHARS + 1), "5" * (MAX_ANSWER_CHARS + 1), False),  # longer than one value can be
]


@pytest.mark.parametrize("source,answer,gold,expected", CASES, ids=[f"{i}-{c[0].split('/')[-1]}" for i, c in enumerate(CASES)])
def test_grader_case_table(source, answer, gold, expected):
    started = time.perf_counter()
    assert is_correct(source, answer, gold, math_timeout_s=2.0) is expected
    assert time.perf_counter() - started < 10.0  # one 2 s budget, plus a helper start on a loaded machine


def test_the_table_is_large_and_balanced():
    assert len(CASES) >= 150
    assert sum(expected for *_, expected in CASES) >= 60 and sum(not expected for *_, expected in CASES) >= 60


@pytest.mark.parametrize("gold", ["42", ["42"], ("41", "42"), np.array(["42"], dtype=object), np.array(["40", "42"])])
def test_every_gold_container_data_prep_or_verl_can_pass(gold):
    """data_prep writes a list; read back through pandas it is a numpy array; verl's own parquet a string."""
    for source in (GSM, AIME, OLYMPIAD):
        assert is_correct(source, "42", gold)
        assert not is_correct(source, "43", gold)


def test_whole_response_goes_through_compute_score():
    text = "<think> 1000 + 234 </think> <answer> 1,\\!234 or 1235 </answer> <confidence> 0.9 </confidence>"
    hedged = compute_score(GSM, text, ["1234"])
    assert hedged["acc"] == 0.0 and hedged["format"] == 1.0
    right = compute_score(GSM, text.replace(" or 1235", ""), ["1234"])
    assert right["acc"] == 1.0
