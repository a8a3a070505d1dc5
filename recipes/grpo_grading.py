"""Grading: the last `\\boxed{...}` of a completion against the number after `#### ` in the answer."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_BOXED = "\\boxed{"
_FRAC = re.compile(r"^(-?)\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}$")


def extract_boxed(text: str) -> str | None:
    """Content of the LAST complete, non-empty `\\boxed{...}`, braces balanced (`\\boxed{\\frac{1}{2}}` works).

    An unclosed box (a truncated completion) or an empty one is passed over for the previous box.
    """
    start = text.rfind(_BOXED)
    while start != -1:
        depth, i = 1, start + len(_BOXED)
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        content = text[start + len(_BOXED):i - 1].strip()
        if depth == 0 and content:
            return content
        start = text.rfind(_BOXED, 0, start)
    return None


def normalize_number(s: str) -> str:
    """Canonical text of a numeric answer: no `$`, commas, spaces, braces or trailing dot; `1000.00` -> `1000`.

    A simple `\\frac{a}{b}` becomes its decimal value when that is exact. Non-numbers are returned cleaned.
    """
    s = s.strip().replace("\\$", "").replace("$", "").replace("\\!", "").replace("\\,", "")
    m = _FRAC.match(s.replace(" ", ""))
    if m:
        sign, num, den = m.groups()
        if int(den) != 0:
            value = Decimal(int(num)) / Decimal(int(den))
            if value * int(den) == int(num):
                return normalize_number(sign + format(value, "f"))
    s = s.replace(",", "").replace(" ", "").replace("{", "").replace("}", "").rstrip(".")
    try:
        value = Decimal(s)
    except InvalidOperation:
        return s
    if not value.is_finite():
        return s
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def gsm8k_final_answer(answer_text: str) -> str:
    """The normalised number after `#### ` in a GSM8K answer."""
    marker = answer_text.rfind("####")
    if marker == -1:
        raise ValueError(f"no '#### <answer>' in GSM8K answer: {answer_text!r}")
    tail = answer_text[marker + 4:].strip()
    return normalize_number(tail.splitlines()[0] if tail else "")


def grade(completion_text: str, answer_text: str) -> float:
    """1.0 if the completion's last `\\boxed{}` equals the GSM8K answer's final number, else 0.0."""
    boxed = extract_boxed(completion_text)
    if boxed is None:
        return 0.0
    truth = gsm8k_final_answer(answer_text)
    return 1.0 if truth and normalize_number(boxed) == truth else 0.0


def upstream_grade(completion_text: str, answer_text: str) -> float:
    """The PyTRIO GSM8K demo's grader, kept only so tests can show where it and `grade` differ.

    It takes the last `\\boxed\\{([^}]+)\\}` regex match (stops at the first `}`, skips empty boxes) and only
    strips commas, surrounding spaces and trailing dots.
    """
    def norm(t: str) -> str:
        return t.replace(",", "").strip().rstrip(".")

    matches = re.findall(r"\\boxed\{([^}]+)\}", completion_text)
    truth = re.search(r"####\s*(.+)", answer_text)
    if not matches or truth is None:
        return 0.0
    return 1.0 if norm(matches[-1].strip()) == norm(norm(truth.group(1))) else 0.0
