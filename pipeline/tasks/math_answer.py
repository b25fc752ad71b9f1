"""Math-answer extraction and comparison for users' prompt/answer data.

Invariants:
- The answer of a completion is the content of its last `\\boxed{...}` (braces balanced), else its last
  number; a completion with neither has no answer and scores 0.
- Numbers compare as exact rationals: "85", "85.0", "+85", "1,000" (thousands groups), "170/2",
  "\\frac{170}{2}" and "$85$" are all 85; "0.5" equals "1/2"; "85.01" does not equal "85".
- Anything that is not a number compares as text with all whitespace removed ("x = 3" vs "x=3" match).

Worked example: extract_answer("so 3/4 + 1/4 = \\boxed{1}") == "1"; answers_match("1.0", "1") is True.
"""
from __future__ import annotations

import re
from fractions import Fraction

_NUMBER = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|[-+]?\.\d+"
_LAST_NUMBER = re.compile(_NUMBER)
_WHOLE_NUMBER = re.compile(rf"^(?:{_NUMBER})$")
_FRAC = re.compile(r"^([-+]?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    begin = i
    while i < len(text):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i]
        i += 1
    return None


def extract_answer(text: str) -> str | None:
    """The answer a completion gives (see the module docstring), or None."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers = _LAST_NUMBER.findall(text)
    return numbers[-1] if numbers else None


def parse_number(text: str) -> Fraction | None:
    """The exact value of a numeric answer, or None when it is not a number."""
    s = re.sub(r"\s+", "", text).strip("$").replace("\\!", "")
    frac = _FRAC.match(s)
    if frac:
        sign, num, den = frac.groups()
        top, bottom = parse_number(num), parse_number(den)
        if top is None or bottom is None or bottom == 0:
            return None
        return (-1 if sign == "-" else 1) * top / bottom
    if not _WHOLE_NUMBER.match(s):
        return None
    s = s.replace(",", "")
    if "/" in s:
        num, den = s.split("/")
        return None if Fraction(den) == 0 else Fraction(num) / Fraction(den)
    return Fraction(s)


def answers_match(predicted: str, reference: str) -> bool:
    """Whether two answers are the same number, or the same text up to whitespace."""
    p, r = parse_number(predicted), parse_number(reference)
    if p is not None and r is not None:
        return p == r
    return re.sub(r"\s+", "", predicted) == re.sub(r"\s+", "", reference)
