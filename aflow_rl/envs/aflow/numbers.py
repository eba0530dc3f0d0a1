"""Numbers in answers: the one rule by which the default scoring mode reads and compares them.

This rule decides GSM8K in the default mode (``scoring.score``) and reads the
reference answers the datasets store; MATH answers follow the same rule for
percentages, thousands separators, scientific notation and the minus sign
(``math_equiv.normalize``). AFlow's own reading is ``aflow_reference`` (mode
``aflow``); ``docs/scoring.md`` lists every difference with an example.

A number is written as

    [sign] mantissa [exponent] [percent]      or a fraction: [sign] a/b, [sign] \\frac{a}{b}

* sign: ``-``, ``+`` or the Unicode minus ``−``, but only where it cannot be
  a binary minus: not right after a letter, digit or closing bracket
  (``x = -5`` is -5; ``3-5`` is 3 and 5; a date ``2023-10-05`` is 2023, 10, 5).
  A currency sign may sit between sign and digits (``-$5``).
* mantissa: digits, optionally grouped by thousands separators, which are commas
  between groups of exactly three digits after a first group of one to three
  (``1,234,567``); any other comma separates two numbers (``1,23`` is 1 and 23);
  then optionally ``.digits`` (``.5`` is read too; in ``5.`` the dot ends a sentence).
* exponent: ``e`` or ``E``, an optional sign and one to four digits, written
  right after the mantissa (``1e3`` is 1000, ``5e-05`` is 0.00005, ``2.5E+3`` is 2500).
* fraction: two plain integers around ``/`` (``3/4``, ``-1/2``; not part of a
  longer ``a/b/c`` chain such as a date, and never with a zero denominator), or
  ``\\frac{a}{b}`` / ``\\dfrac`` / ``\\tfrac`` with integers ``a`` (signed) and ``b``.
* percent: ``%`` or ``\\%`` after the number, spaces allowed, marks a percentage.

Values are exact rationals (``fractions.Fraction``), never floats, so
``0.00005`` and ``5e-5`` are the same number and ``1e3`` equals ``1000``.

The answer in a reply (``answer_number``) is the last number inside the last
``\\boxed{}`` when a box holds one, else the first number after the last
``####`` (GSM8K's answer marker) when one follows it, else the last number of
the text.

Two numbers are equal (``numbers_equal(prediction, reference)``) when
``|p - r| <= 1e-6 * min(1, |r|)``: AFlow's absolute tolerance of 1e-6, made
relative for references below 1 in magnitude so that 0.000051 does not match
0.00005. A percent sign is a unit whose meaning the reference decides: a
reference written ``p%`` is matched by ``p``, ``p/100`` and ``p%``; against a
reference written without one the prediction's percent sign is dropped (``25%``
matches 25, not 0.25). The reference's form is not the model's to choose, so
writing ``%`` cannot hedge between two answers.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from aflow_rl.envs.aflow.math_equiv import extract_boxed

TOLERANCE = Fraction(1, 10**6)

_SIGN = r"(?P<sign>(?<![\w)\]}])[-+\u2212])?(?:\\?\$\s?)?"
_INT_FRACTION = r"(?<![\d/.])(?P<num>\d+)/(?P<den>0*[1-9]\d*)(?![\d/]|\.\d)"
_TEX_FRACTION = (r"\\[dt]?frac\s*\{\s*(?P<tsign>[-\u2212])?\s*(?P<tnum>\d+)\s*\}"
                 r"\s*\{\s*(?P<tden>0*[1-9]\d*)\s*\}")
_DECIMAL = (r"(?P<mant>(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"
            r"(?P<exp>[eE][-+\u2212]?\d{1,4}(?![A-Za-z\d]))?")
_PERCENT = r"(?P<pct>\s*\\?%)?"
_NUMBER = re.compile(f"{_SIGN}(?:{_TEX_FRACTION}|{_INT_FRACTION}|{_DECIMAL}){_PERCENT}")
_MARKER = "####"


@dataclass(frozen=True)
class Number:
    """One number as written: its exact value, whether it carried a percent sign, and its text."""

    value: Fraction
    percent: bool
    text: str


def find_numbers(text: str) -> list[Number]:
    """Every number in ``text``, in order (module docstring)."""
    return [n for m in _NUMBER.finditer(str(text)) if (n := _number(m)) is not None]


def answer_number(text: str) -> Number | None:
    """The answer of a reply: last number in the last box, else first after the last ``####``, else last."""
    text = str(text)
    boxed = extract_boxed(text)
    if boxed is not None and (inside := find_numbers(boxed)):
        return inside[-1]
    if _MARKER in text and (after := find_numbers(text.rsplit(_MARKER, 1)[1])):
        return after[0]
    found = find_numbers(text)
    return found[-1] if found else None


def numbers_equal(prediction: Number, reference: Number) -> bool:
    """The default mode's equality of a predicted and a reference number (module docstring)."""
    candidates = [reference.value]
    if reference.percent and not prediction.percent:
        candidates.append(reference.value / 100)  # "50%" is 50 and 0.5
    return any(_close(prediction.value, r) for r in candidates)


def _close(p: Fraction, r: Fraction) -> bool:
    return abs(p - r) <= TOLERANCE * min(1, abs(r))


def _number(m: re.Match) -> Number | None:
    negative = m.group("sign") in ("-", "\u2212")
    try:
        value = _value(m)
    except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits): not a number
        return None
    return Number(-value if negative else value, m.group("pct") is not None, m.group(0).strip())


def _value(m: re.Match) -> Fraction:
    if m.group("tnum") is not None:
        value = Fraction(int(m.group("tnum")), int(m.group("tden")))
        return -value if m.group("tsign") else value
    elif m.group("num") is not None:
        return Fraction(int(m.group("num")), int(m.group("den")))
    else:
        mantissa = m.group("mant").replace(",", "")
        value = Fraction(mantissa)
        if m.group("exp"):
            value *= Fraction(10) ** int(m.group("exp")[1:].replace("\u2212", "-"))
    return value
