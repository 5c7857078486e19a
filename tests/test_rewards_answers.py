"""Answer extraction and normalisation for GSM8K/MATH-style text (a table of hand-worked cases)."""

from fractions import Fraction

import pytest

from rpeg_jax.data.answers import answers_match, extract_answer, last_boxed, normalize_answer, to_number

EXTRACT = [
    ("Natalia sold 48 clips in April and 24 in May.\n#### 72", "72"),
    ("She pays $1,200.\n#### $1,200", "1,200"),
    ("so x = 3\n#### -3.5 dollars", "-3.5"),
    ("#### 5\nbut later #### 6", "6"),  # the last marker counts
    ("The answer is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
    ("\\boxed{1} then \\boxed{\\sqrt{\\frac{a}{b}}}", "\\sqrt{\\frac{a}{b}}"),  # nested braces, last box
    ("so \\boxed 7 is it", "7"),
    ("\\fbox{(2, 3)}", "(2, 3)"),
    ("I think it is 12, no wait, 1,234.5 apples", "1,234.5"),
    ("-7 is less than .5", ".5"),
    ("no numbers here", None),
    ("\\boxed{unbalanced", None),
]


@pytest.mark.parametrize("text,want", EXTRACT)
def test_extract_answer(text, want):
    assert extract_answer(text) == want


NUMBERS = [
    ("42", Fraction(42)),
    ("-1,234.50", Fraction(-246900, 200)),
    (".5", Fraction(1, 2)),
    ("3/4", Fraction(3, 4)),
    ("\\frac{3}{4}", Fraction(3, 4)),
    ("-\\frac12", Fraction(-1, 2)),
    ("1e5", None),
    ("abc", None),
    ("1/0", None),
    ("1,23", None),
    ("9" * 101, None),
]


@pytest.mark.parametrize("text,want", NUMBERS)
def test_to_number(text, want):
    assert to_number(text) == want


MATCH = [
    ("72", "72", True),
    ("72.0", "72", True),
    ("72.00", "72", True),
    ("$1,200", "1200", True),
    ("0.5", "\\frac{1}{2}", True),
    ("\\dfrac{1}{2}", "1/2", True),
    ("50\\%", "50", True),
    ("90^\\circ", "90", True),
    (" 7 .", "7", True),
    ("\\left( 2, 3 \\right)", "(2,3)", True),
    ("\\text{(A)}", "(A)", True),
    ("0.333", "\\frac{1}{3}", False),
    ("71", "72", False),
    ("x", "y", False),
    (None, "1", False),
    ("", "", False),
]


@pytest.mark.parametrize("pred,gold,want", MATCH)
def test_answers_match(pred, gold, want):
    assert answers_match(pred, gold) is want


def test_normalize_and_boxed():
    assert normalize_answer("  $2,500.0 ") == "2500"
    assert normalize_answer("\\frac{6}{4}") == "3/2"
    assert last_boxed("no box") is None
