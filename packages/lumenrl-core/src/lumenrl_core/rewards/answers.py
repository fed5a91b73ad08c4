"""Final-answer extraction and equivalence for verifiable math rewards.

Extraction order (the first that matches wins):

1. the last ``\\boxed{...}`` / ``\\fbox{...}`` (braces matched, so ``\\boxed{\\frac{1}{2}}`` works);
2. the text after the last ``####`` (GSM8K style), up to the end of that line;
3. the last number in the text (``-12``, ``1,000``, ``.5``, ``3/4``, ``2.5e3``).

Equivalence: both sides are normalized (``$``, ``\\text{}``, ``\\left``/``\\right``, spaces, a
trailing period, ``\\!`` thin spaces, thousands separators) and, when both parse as numbers
(integers, decimals, ``a/b``, ``\\frac{a}{b}``, percentages, scientific notation), compared
exactly as rationals (``0.50 == .5``, ``3/4 == 0.75``, ``1,000 == 1000``); a float answer and
a float ground truth that are not exactly equal still match within a relative 1e-9 (rounding
of the stated value; compared exactly, so huge values cannot overflow). Scientific notation with an
exponent past 1000 is not parsed as a number (its string is compared). Otherwise the normalized
strings must be equal (case-insensitive).
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["extract_final_answer", "extract_boxed", "parse_number", "normalize_answer", "answers_match"]

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_HASHES = re.compile(r"####\s*([^\n]*)")
_NUMBER = re.compile(
    r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:[eE][-+]?\d+)?(?:\s*/\s*\d+)?",
)
_FRAC = re.compile(r"^(-?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_REL_TOL = Fraction(1, 10**9)  # exact: comparing with a float would convert huge rationals to float (overflow)
_MAX_EXPONENT = 1000  # |e| of scientific notation past this is not parsed as a number (10**e would be built)
_EXPONENT = re.compile(r"[eE]([-+]?\d+)")


def extract_boxed(text: str) -> str | None:
    """Contents of the last ``\\boxed{...}`` with nested braces, or None (also if unbalanced)."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth, pos = 1, start
        while pos < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[pos], 0)
            pos += 1
        if depth == 0:
            return text[start : pos - 1].strip()
    return None


def _last_number(text: str) -> str | None:
    found = [m.group(0) for m in _NUMBER.finditer(text) if re.search(r"\d", m.group(0))]
    return found[-1].strip() if found else None


def extract_final_answer(text: str) -> str | None:
    """The final answer in a response (see the module docstring), or None when there is none."""
    boxed = extract_boxed(text)
    if boxed:
        return boxed
    hashes = _HASHES.findall(text)
    if hashes and hashes[-1].strip():
        return hashes[-1].strip()
    return _last_number(text)


def normalize_answer(answer: str) -> str:
    """Strip LaTeX/format noise that does not change the value."""
    s = _TEXT.sub(r"\1", answer)
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "$", "\\%", "%"):
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = "".join(s.split()).rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    return s


def parse_number(answer: str) -> Fraction | None:
    """Exact rational value of a numeric answer (``"1,000"``, ``"-.5"``, ``"3/4"``, ``"\\frac{3}{4}"``)."""
    s = normalize_answer(answer)
    frac = _FRAC.match(s)
    if frac:
        sign, num, den = frac.groups()
        s = f"{sign}{num}/{den}"
    if s.endswith("/") or s.startswith("/"):
        return None
    if any(abs(int(e)) > _MAX_EXPONENT for e in _EXPONENT.findall(s)):  # "1e999999999": no 10**e
        return None
    try:
        if "/" in s:
            num, den = s.split("/", 1)
            return Fraction(num) / Fraction(den)
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(predicted: str, ground_truth: str) -> bool:
    """Whether two answers denote the same value (numeric when both parse, else by string)."""
    a, b = parse_number(predicted), parse_number(ground_truth)
    if a is not None and b is not None:
        if a == b:
            return True
        return abs(a - b) <= _REL_TOL * max(abs(a), abs(b))
    return normalize_answer(predicted).lower() == normalize_answer(ground_truth).lower()
