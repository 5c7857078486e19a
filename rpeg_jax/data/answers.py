"""Answer extraction and comparison for GSM8K/MATH-style text. Nothing is ever evaluated:
numbers are parsed with `fractions.Fraction` from strings that a regular expression has
already checked.

    extract_answer("... so she has 18 left.\\n#### 18")    -> "18"
    extract_answer("The answer is $\\boxed{\\frac{1}{2}}$") -> "\\frac{1}{2}"
    answers_match("\\frac{1}{2}", "0.5")                   -> True
    answers_match("1,000", "1000.0")                      -> True

Order of extraction: the text after the last "####" (GSM8K; its first number when it has
one), else the last \\boxed{...} / \\fbox{...} (nested braces balanced; MATH), else the last
plain number. Normalisation drops whitespace, "$", thousands commas, \\left/\\right, spacing
macros, degree and percent signs, a trailing "."; numbers (integers, decimals, a/b,
\\frac{a}{b}, \\dfrac, \\tfrac) compare exactly as fractions, anything else as normalised text.

Called by: data/rewards.py (the "math_answer" reward).
"""

from __future__ import annotations

import re
from fractions import Fraction

NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+"
NUMBER_RE = re.compile(NUMBER)
_FULL_NUMBER_RE = re.compile(rf"(?:{NUMBER})")
_FRAC_RE = re.compile(r"(-?)\\frac\{([^{}]+)\}\{([^{}]+)\}|(-?)\\frac(\d)(\d)")
_SLASH_RE = re.compile(rf"({NUMBER})/({NUMBER})")
_TEXT_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_DROP = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "^\\circ", "^{\\circ}", "\\%", "%", "\\$", "$")
MAX_NUMBER_CHARS = 100  # longer digit strings are compared as text (keeps Fraction cheap)


def _balanced(text: str, start: int) -> str | None:
    """The contents of the brace group opening at text[start] == "{", or None if unbalanced."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
    return None


def last_boxed(text: str) -> str | None:
    """Contents of the last \\boxed{...} or \\fbox{...} (nested braces kept), or "\\boxed 5" form."""
    best = None
    for m in re.finditer(r"\\(?:boxed|fbox)\s*", text):
        end = m.end()
        if end < len(text) and text[end] == "{":
            inner = _balanced(text, end)
        else:
            tail = re.match(r"[^\s$]+", text[end:])
            inner = tail.group(0) if tail else None
        if inner is not None:
            best = inner
    return best


def last_number(text: str) -> str | None:
    matches = NUMBER_RE.findall(text)
    return matches[-1] if matches else None


def extract_answer(text: str) -> str | None:
    """The final answer in a solution text, or None when there is none (see module doc)."""
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip().splitlines()
        tail = tail[0].strip() if tail else ""
        m = NUMBER_RE.search(tail.replace("$", ""))
        if m:
            return m.group(0)
        if tail:
            return tail
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    return last_number(text)


def normalize_answer(ans: str) -> str:
    """Canonical text of an answer: numbers as "p/q" or an integer, other text with noise removed."""
    s = ans.strip()
    s = _TEXT_RE.sub(r"\1", s)
    for tok in _DROP:
        s = s.replace(tok, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = "".join(s.split()).rstrip(".")
    value = to_number(s)
    if value is None:
        return s
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def _parse_plain(s: str) -> Fraction | None:
    if len(s) > MAX_NUMBER_CHARS or not _FULL_NUMBER_RE.fullmatch(s):
        return None
    return Fraction(s.replace(",", ""))


def to_number(s: str) -> Fraction | None:
    """An exact Fraction for "42", "-1,234.50", ".5", "3/4", "\\frac{3}{4}", "-\\frac12"; else None."""
    plain = _parse_plain(s)
    if plain is not None:
        return plain
    m = _FRAC_RE.fullmatch(s)
    if m:
        sign, num, den = (m.group(1), m.group(2), m.group(3)) if m.group(2) is not None else m.group(4, 5, 6)
        p, q = _parse_plain(num), _parse_plain(den)
        if p is not None and q:
            return -p / q if sign else p / q
        return None
    m = _SLASH_RE.fullmatch(s)
    if m:
        p, q = _parse_plain(m.group(1)), _parse_plain(m.group(2))
        if p is not None and q:
            return p / q
    return None


def answers_match(pred: str | None, gold: str | None) -> bool:
    """True when two extracted answers agree: numerically when both parse, else as normalised text."""
    if pred is None or gold is None:
        return False
    p, g = normalize_answer(pred), normalize_answer(gold)
    return bool(p) and p == g
