"""AFlow's own verdicts (``benchmarks/*.py`` of FoundationAgents/AFlow), for ``score(..., mode="aflow")``.

Re-implemented from AFlow's code, rule for rule, so a workflow's score here
reads on the scale of AFlow's published table:

* GSM8K (``GSM8KBenchmark``): the last match of AFlow's number pattern
  (optional sign, digits, comma groups, decimals; no exponent, so ``5e-05``
  reads as -5) in the reference's full answer text and in the prediction,
  commas dropped, as floats; equal when ``|expected - predicted| <= 1e-6``.
* MATH (``MATHBenchmark``): the last ``\\boxed{...}`` whose content nests
  braces at most one level deep (else the last sentence) of the reference
  solution and of the prediction; equal when the two strings are equal, else,
  if both read as numbers (``parse_digits``: commas dropped, ``float()``, or a
  trailing ``%`` / ``\\%`` meaning /100), when ``math.isclose(..., abs_tol=1e-3)``,
  else by sympy (``aflow_sympy.symbolic_equal``).
* HotpotQA and DROP: token F1 exactly as the default mode computes it
  (``scoring.f1``, ``scoring.drop_f1``); AFlow's two scorers are the same.
* HumanEval and MBPP: the reply goes through AFlow's ``sanitize``
  (``aflow_sanitize``); a reply whose sanitized code does not define the entry
  point fails, as AFlow's check does; otherwise AFlow's preloaded names
  (``math``, ``hashlib``, ``re`` and the ``typing`` names) are imported in front
  of it and the project's test runner (``scoring.run_tests``) decides.

``docs/scoring.md`` lists where the default mode differs, with examples.
"""
from __future__ import annotations

import math
import re

from aflow_rl.envs.aflow.aflow_sanitize import defines, sanitize
from aflow_rl.envs.aflow.aflow_sympy import symbolic_equal

GSM8K_ABS_TOL = 1e-6
MATH_ABS_TOL = 1e-3

# What AFlow's extract_number matches: signed integer part with comma groups, optional decimals.
_AFLOW_NUMBER = re.compile(r"[-+]?\d+(?:,\d{3})*(?:\.\d+)?|\d+\.\d+")
# AFlow's box: braces inside may nest one level, no deeper.
_AFLOW_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}", re.S)
_SENTENCE_END = re.compile(r"(?<!\d)[.!?]\s+")
# Names AFlow's code checker puts in the solution's globals before exec.
CODE_PRELUDE = "import math\nimport hashlib\nimport re\nfrom typing import List, Dict, Tuple, Optional, Any\n"


# ---------------------------------------------------------------------------
# GSM8K
# ---------------------------------------------------------------------------


def gsm8k_number(text: str) -> float | None:
    """AFlow's ``extract_number``: the last number its pattern finds, commas dropped, as a float."""
    found = _AFLOW_NUMBER.findall(str(text))
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def gsm8k_score(reference_text: str, prediction: str) -> float:
    """AFlow's GSM8K verdict; ``reference_text`` is the dataset's full answer (reasoning and ``#### n``)."""
    expected, got = gsm8k_number(reference_text), gsm8k_number(prediction)
    if got is None or expected is None:  # AFlow: 0 for no prediction; None - x raises, also scored 0
        return 0.0
    return 1.0 if abs(expected - got) <= GSM8K_ABS_TOL else 0.0


# ---------------------------------------------------------------------------
# MATH
# ---------------------------------------------------------------------------


def math_answer(text: str) -> str:
    """AFlow's ``extract_model_answer``: the last shallow ``\\boxed{}``'s content, else the last sentence."""
    boxes = _AFLOW_BOXED.findall(text)
    if boxes:
        return boxes[-1].strip()
    sentences = [s.strip() for s in _SENTENCE_END.split(text) if s.strip()]
    return sentences[-1] if sentences else ""


def parse_digits(text: str) -> float | None:
    """AFlow's ``parse_digits``: commas dropped, then ``float()``, or a trailing ``%``/``\\%`` as /100."""
    text = str(text).replace(",", "")
    try:
        return float(text)
    except ValueError:
        pass
    if text.endswith("%"):
        text = text[:-1]
        if text.endswith("\\"):
            text = text[:-1]
        try:
            return float(text) / 100
        except ValueError:
            pass
    return None


def math_equal(prediction: str, reference: str) -> bool:
    """AFlow's ``math_equal`` on two extracted answers (module docstring)."""
    if str(prediction) == str(reference):
        return True
    p, r = parse_digits(prediction), parse_digits(reference)
    if p is not None and r is not None:
        return math.isclose(p, r, abs_tol=MATH_ABS_TOL)  # decided here: sympy is never asked
    return symbolic_equal(str(prediction), str(reference))


def math_score(solution: str, prediction: str) -> float:
    """AFlow's MATH verdict: both texts through ``math_answer``, then ``math_equal``."""
    return 1.0 if math_equal(math_answer(prediction), math_answer(solution)) else 0.0


# ---------------------------------------------------------------------------
# HumanEval and MBPP
# ---------------------------------------------------------------------------


def code_to_run(prediction: str, entry_point: str) -> str | None:
    """The code AFlow would execute for a reply, or None where AFlow's check fails before running it."""
    try:
        code = sanitize(prediction, entry_point)
    except Exception:  # AFlow: an error escaping sanitize ends the problem with score 0
        return None
    if not defines(code, entry_point):
        return None  # AFlow: "Function <entry_point> is not defined in the solution."
    return CODE_PRELUDE + code
