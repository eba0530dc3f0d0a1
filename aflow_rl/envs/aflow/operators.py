"""AFlow's operators over an executor ``LLMClient`` (the actor endpoint).

Each operator is an async function ``op(ctx, node, args, temperature) -> value``
where ``args`` are the node's inputs as ``(input id, value)`` pairs and a value
is a text, a list of candidate texts (a generator with ``samples: k``) or a
:class:`Review`. Semantics follow AFlow's ``operator.py``; the prompts are this
project's own. Replies are parsed leniently: a small or random executor rarely
follows a format, so every parse has a fallback and no reply makes an operator
raise (only a failed request or sandbox does).

Every model call goes through :meth:`OpContext.ask`, which records the node,
tokens in/out and latency (the evaluator's cost accounting); generated code
runs only through :meth:`OpContext.run_code`, i.e. ``aflow_rl.sandbox.run_python``.
"""
from __future__ import annotations

import asyncio
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Union

from aflow_rl.envs.aflow.graph import CODE_KINDS, OPERATORS, PROBLEM, Node
from aflow_rl.envs.aflow.scoring import run_tests
from aflow_rl.llm.base import LLMClient

SAMPLE_TEMPERATURE = 0.8   # k > 1 samples need diversity, or the ensemble sees k copies
_TAIL_CHARS = 1500         # error output shown back to the model when code fails
_RESULT_MARK = "@@AFLOW_RESULT@@"


@dataclass
class Review:
    """A Review operator's verdict on ``solution``."""

    passed: bool
    feedback: str
    solution: str

    def __str__(self) -> str:
        return f"Review verdict: {'pass' if self.passed else 'fail'}\nFeedback: {self.feedback}"


Value = Union[str, list, Review]


@dataclass
class CallRecord:
    """One executor call, for cost accounting and traces."""

    node: str
    op: str
    tokens_in: int
    tokens_out: int
    seconds: float
    finish_reason: str


@dataclass
class OpContext:
    """What an operator call sees: the executor, the problem, budgets; it records every call.

    ``sandbox`` defaults to ``aflow_rl.sandbox.run_python`` (imported on first use,
    so text-only workflows never need it) and ``tester`` to ``scoring.run_tests`` (the
    judged test run); tests may pass stand-ins with the same signatures."""

    executor: LLMClient
    problem: Any                                   # datasets.Problem: id, question, answer, kind, metadata
    max_tokens: int = 512
    code_timeout_s: float = 10.0
    sandbox: Callable[..., Any] | None = None
    tester: Callable[..., Any] | None = None
    calls: list[CallRecord] = field(default_factory=list)
    code_runs: int = 0

    @property
    def tokens_in(self) -> int:
        return sum(c.tokens_in for c in self.calls)

    @property
    def tokens_out(self) -> int:
        return sum(c.tokens_out for c in self.calls)

    async def ask(self, node: Node, prompt: str, *, temperature: float = 0.0) -> str:
        """One chat turn to the executor; records tokens in/out under the node."""
        t0 = time.monotonic()
        done = await self.executor.chat([{"role": "user", "content": prompt}],
                                        max_new_tokens=self.max_tokens, temperature=temperature)
        self.calls.append(CallRecord(node.id, node.op, int(done.prompt_tokens), int(done.completion_tokens),
                                     time.monotonic() - t0, done.finish_reason))
        return done.text or ""

    async def run_code(self, code: str) -> Any:
        """Run ``code`` in the sandbox (in a thread: ``run_python`` blocks); returns its SandboxResult."""
        if self.sandbox is None:
            from aflow_rl.sandbox import run_python

            self.sandbox = run_python
        self.code_runs += 1
        return await asyncio.to_thread(self.sandbox, code, timeout_s=self.code_timeout_s)

    async def run_tests(self, solution: str) -> Any:
        """Judge ``solution`` against the problem's tests (in a thread: it blocks); its SandboxResult."""
        self.code_runs += 1
        return await asyncio.to_thread(self.tester or run_tests, self.problem, solution,
                                       timeout_s=self.code_timeout_s)

    # -- problem facts the code operators need ---------------------------------------

    @property
    def question(self) -> str:
        return str(self.problem.question)

    @property
    def metadata(self) -> dict:
        return dict(getattr(self.problem, "metadata", None) or {})

    @property
    def is_code(self) -> bool:
        return getattr(self.problem, "kind", "") in CODE_KINDS or "entry_point" in self.metadata

    @property
    def entry_point(self) -> str:
        return str(self.metadata.get("entry_point") or "")


# ---------------------------------------------------------------------------
# Parsing helpers (lenient by design)
# ---------------------------------------------------------------------------


def tag(text: str, name: str) -> str | None:
    """Content of ``<name>...</name>`` (the last one; a missing close tag runs to the end), or None."""
    closed = re.findall(rf"<{name}>(.*?)</{name}>", text, flags=re.DOTALL | re.IGNORECASE)
    if closed:
        return closed[-1].strip()
    m = re.search(rf"<{name}>(.*)", text, flags=re.DOTALL | re.IGNORECASE)
    return m.group(1).strip() if m else None


_FENCE_RE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_CODE_START_RE = re.compile(r"^(?:def |class |import |from |async def |@)", re.MULTILINE)


def extract_code(text: str, entry_point: str = "") -> str:
    """The code in a reply: the fenced block defining ``entry_point`` (else the longest block),
    else the text from the first def/import line, else the text itself."""
    blocks = [b.strip() for b in _FENCE_RE.findall(text) if b.strip()]
    if blocks:
        if entry_point:
            defining = [b for b in blocks if re.search(rf"def\s+{re.escape(entry_point)}\s*\(", b)]
            if defining:
                return max(defining, key=len)
        return max(blocks, key=len)
    m = _CODE_START_RE.search(text)
    return (text[m.start():] if m else text).strip()


def letter_choice(text: str, n: int) -> int | None:
    """The index chosen by ``<letter>X</letter>`` (or a reply that is a lone letter), if in range."""
    raw = tag(text, "letter")
    raw = raw if raw is not None else text.strip()
    m = re.fullmatch(r"\W*([A-Za-z])\W*", raw)
    if not m:
        return None
    index = ord(m.group(1).upper()) - ord("A")
    return index if 0 <= index < n else None


def normalize_answer(text: str) -> str:
    """The part of a candidate that votes: its <answer> or last \\boxed{}, lowercased, spaces collapsed."""
    inner = tag(text, "answer")
    if inner is None:
        boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
        inner = boxed[-1] if boxed else text
    return re.sub(r"\s+", " ", inner).strip().strip(".").lower()


def majority(candidates: list[str]) -> int:
    """Index of the first candidate whose normalized answer is the most common (the deterministic fallback)."""
    keys = [normalize_answer(c) for c in candidates]
    counts = Counter(keys)
    best = max(counts.values())
    return next(i for i, k in enumerate(keys) if counts[k] == best)


def _text(value: Value) -> str:
    return "\n\n".join(str(v) for v in value) if isinstance(value, list) else str(value)


def _context(args: list[tuple[str, Value]]) -> str:
    """A generator's input text: a lone input as is, several as labelled sections."""
    if len(args) == 1:
        return _text(args[0][1])
    return "\n\n".join(f"### {'Problem' if name == PROBLEM else 'Input from ' + name}\n{_text(v)}"
                       for name, v in args)


def _lettered(candidates: list[str]) -> str:
    return "\n\n".join(f"Solution {chr(65 + i)}:\n{c}" for i, c in enumerate(candidates))


def _tail(text: str) -> str:
    return text if len(text) <= _TAIL_CHARS else "..." + text[-_TAIL_CHARS:]


# ---------------------------------------------------------------------------
# Generators
# ---------------------------------------------------------------------------


async def custom(ctx: OpContext, node: Node, args: list, temperature: float) -> str:
    """Custom: the instruction followed by the inputs; the whole reply is the output."""
    instruction = node.param("instruction") or ""
    body = _context(args)
    return await ctx.ask(node, f"{instruction}\n\n{body}" if instruction else body, temperature=temperature)


async def answer_generate(ctx: OpContext, node: Node, args: list, temperature: float) -> str:
    """AnswerGenerate: reasoning in <thought>, the concise answer in <answer>; the answer is the output."""
    prompt = ("Work through the task below step by step. Put your reasoning inside <thought></thought>. "
              "Then put only the final answer, short and without explanation, inside <answer></answer>.\n\n"
              f"Task:\n{_context(args)}")
    reply = await ctx.ask(node, prompt, temperature=temperature)
    answer = tag(reply, "answer")
    return answer if answer else reply.strip()


async def custom_code_generate(ctx: OpContext, node: Node, args: list, temperature: float) -> str:
    """CustomCodeGenerate: the instruction and problem -> code for the entry-point function."""
    instruction = node.param("instruction") or ""
    target = f"the function `{ctx.entry_point}`" if ctx.entry_point else "the requested function"
    prompt = (f"{instruction}\n\n" if instruction else "") + (
        f"{_context(args)}\n\nImplement {target} in Python: a complete, self-contained definition with the "
        "imports it needs and no example usage or tests. Reply with a single ```python code block.")
    return extract_code(await ctx.ask(node, prompt, temperature=temperature), ctx.entry_point)


def _program(code: str) -> str:
    """The script the sandbox runs: the model's code, then solve()'s value after a marker."""
    return (f"{code}\n\n"
            f"if __name__ == '__main__':\n"
            f"    import sys as _aflow_sys\n"
            f"    _aflow_sys.stdout.write('\\n{_RESULT_MARK}' + str(solve()))\n")


async def programmer(ctx: OpContext, node: Node, args: list, temperature: float) -> str:
    """Programmer: write solve(), run it in the sandbox, return its value; on an error, retry
    with the error shown (``attempts`` in all), as AFlow's Programmer does."""
    others = [a for a in args if a[0] != PROBLEM]  # the problem is always in the prompt; the rest is analysis
    analysis = _context(others) if others else "None"
    feedback, output = "", "No code was produced."
    for _ in range(node.param("attempts")):
        prompt = ("Write a self-contained Python program that computes the answer to the problem. Define a "
                  "function `solve()` without parameters that returns the final answer as a number or a short "
                  "string; do not read input or files. Reply with a single ```python code block.\n\n"
                  f"Problem:\n{ctx.question}\n\nAnalysis so far:\n{analysis}" + feedback)
        code = extract_code(await ctx.ask(node, prompt, temperature=temperature))
        if not code:
            continue
        result = await ctx.run_code(_program(code))
        stdout = result.stdout or ""
        if result.ok and _RESULT_MARK in stdout:
            return stdout.rsplit(_RESULT_MARK, 1)[1].strip()
        why = "timed out" if result.timed_out else (result.stderr or result.error or "solve() returned no result")
        output = f"Code execution failed: {_tail(str(why))}"
        feedback = f"\n\nYour previous code failed.\nCode:\n{code}\n\nError:\n{_tail(str(why))}\nFix it."
    return output


# ---------------------------------------------------------------------------
# Ensembles
# ---------------------------------------------------------------------------


def _candidates(args: list) -> list[str]:
    out: list[str] = []
    for _, value in args:
        if isinstance(value, list):
            out.extend(str(v) for v in value)
        else:
            out.append(str(value))
    return out


async def sc_ensemble(ctx: OpContext, node: Node, args: list, temperature: float) -> str:
    """ScEnsemble (universal self-consistency): the executor names the candidate most others agree
    with; an unreadable choice falls back to a majority vote over normalized answers."""
    cands = _candidates(args)
    if len({normalize_answer(c) for c in cands}) == 1:
        return cands[0]  # unanimous: asking the model could only lose information
    prompt = (f"Question:\n{ctx.question}\n\nSeveral independent solutions follow.\n\n{_lettered(cands)}\n\n"
              "Compare their final answers and find the answer that most solutions agree on. Explain briefly "
              "inside <thought></thought>, then give only the letter of one solution with that answer inside "
              "<letter></letter>.")
    choice = letter_choice(await ctx.ask(node, prompt, temperature=temperature), len(cands))
    return cands[choice if choice is not None else majority(cands)]


async def md_ensemble(ctx: OpContext, node: Node, args: list, temperature: float) -> str:
    """MdEnsemble (Medprompt's choice shuffling): ``votes`` rounds, each over a fresh order of the
    candidates so position bias averages out; the most voted candidate wins (ties: earliest)."""
    cands = _candidates(args)
    rng = random.Random(f"{getattr(ctx.problem, 'id', '')}/{node.id}")  # reproducible per problem and node
    tally: Counter[int] = Counter()
    for _ in range(node.param("votes")):
        order = list(range(len(cands)))
        rng.shuffle(order)
        prompt = (f"Question:\n{ctx.question}\n\nCandidate solutions:\n\n{_lettered([cands[i] for i in order])}"
                  "\n\nDecide which solution solves the question best. Explain briefly inside "
                  "<thought></thought>, then give only its letter inside <letter></letter>.")
        choice = letter_choice(await ctx.ask(node, prompt, temperature=temperature), len(cands))
        if choice is not None:
            tally[order[choice]] += 1
    if not tally:
        return cands[majority(cands)]
    best = max(tally.values())
    return cands[min(i for i, n in tally.items() if n == best)]


# ---------------------------------------------------------------------------
# Checks and repairs
# ---------------------------------------------------------------------------


def has_tests(ctx: OpContext) -> bool:
    """Code problems (HumanEval, MBPP) carry their test code and entry point in the metadata."""
    return bool(ctx.metadata.get("test")) and bool(ctx.entry_point)


async def test(ctx: OpContext, node: Node, args: list, temperature: float) -> str:
    """Test: run the problem's tests on the solution; on failure ask for a fix (at most ``max_fixes``)
    and test again. Returns the last solution. Problems without tests pass the solution through.

    AFlow runs HumanEval's public tests here; the datasets carry one test suite per
    problem, so this runs that suite, judged as the scorer judges it (``scoring.run_tests``)."""
    if not has_tests(ctx):
        return _text(args[0][1])
    solution = extract_code(_text(args[0][1]), ctx.entry_point)
    for _ in range(node.param("max_fixes")):
        # the scorer's own judged run, so passing here means passing there
        result = await ctx.run_tests(solution)
        if result.ok:
            return solution
        why = "timed out" if result.timed_out else (result.stderr or result.error or f"exit code {result.exit_code}")
        prompt = (f"This Python solution fails its tests.\n\nProblem:\n{ctx.question}\n\nSolution:\n"
                  f"```python\n{solution}\n```\n\nTest output:\n{_tail(str(why))}\n\nExplain the failure in a "
                  "sentence or two, then give the corrected complete solution in a single ```python code block, "
                  "without tests.")
        solution = extract_code(await ctx.ask(node, prompt, temperature=temperature), ctx.entry_point)
    return solution


# How each dataset kind (datasets.KINDS) wants its answer written; its scorer reads that form.
_FORMAT_HINTS = {
    "math": "as a LaTeX expression inside \\boxed{}",
    "gsm8k": "as a single number",
    "hotpotqa": "as a short phrase of a few words",
    "drop": "as a short phrase or number",
    "rg": "exactly in the form the problem asks for",
}


async def format_answer(ctx: OpContext, node: Node, args: list, temperature: float) -> str:
    """Format: the final answer alone, in the dataset's form. Code is extracted without the model,
    because sending a program through another generation can only damage it."""
    solution = _text(args[0][1])
    if ctx.is_code:
        return extract_code(solution, ctx.entry_point)
    hint = _FORMAT_HINTS.get(str(getattr(ctx.problem, "kind", "")).lower(), "as briefly as possible")
    prompt = (f"Problem:\n{ctx.question}\n\nSolution:\n{solution}\n\nState the final answer of this solution "
              f"{hint}. Reply with the answer only: no explanation, no extra words.")
    reply = (await ctx.ask(node, prompt, temperature=temperature)).strip()
    return reply or solution


async def review_once(ctx: OpContext, node: Node, solution: str, temperature: float = 0.0) -> Review:
    """One critique; an unreadable verdict counts as pass (no reason to change the answer)."""
    prompt = (f"Check the solution to this problem critically.\n\nProblem:\n{ctx.question}\n\nSolution:\n"
              f"{solution}\n\nOnly if you are confident the final answer is wrong, the verdict is fail; "
              "otherwise it is pass. Reply as <verdict>pass or fail</verdict> followed by "
              "<feedback>the error and how to fix it, or why the answer holds</feedback>.")
    reply = await ctx.ask(node, prompt, temperature=temperature)
    verdict = (tag(reply, "verdict") or "").lower()
    feedback = tag(reply, "feedback") or reply.strip()
    failed = re.search(r"fail|false|incorrect|wrong", verdict) is not None
    return Review(passed=not failed, feedback=feedback, solution=solution)


async def review(ctx: OpContext, node: Node, args: list, temperature: float) -> Review:
    """Review: a pass/fail verdict with feedback on the input solution."""
    return await review_once(ctx, node, _text(args[0][1]), temperature)


async def revise(ctx: OpContext, node: Node, args: list, temperature: float) -> str:
    """Revise: while the review fails, rewrite the solution from its feedback and re-review the
    rewrite; at most ``max_rounds`` revisions (AFlow's bounded review-then-revise loop)."""
    solution, verdict = _text(args[0][1]), args[1][1]
    rounds = node.param("max_rounds")
    for r in range(rounds):
        if verdict.passed:
            break
        want = ("Give the corrected complete code in a single ```python code block." if ctx.is_code
                else "Give the corrected complete solution, ending with the final answer.")
        prompt = (f"A reviewer found this solution wrong.\n\nProblem:\n{ctx.question}\n\nSolution:\n{solution}\n\n"
                  f"Reviewer feedback:\n{verdict.feedback}\n\n{want}")
        reply = await ctx.ask(node, prompt, temperature=temperature)
        solution = extract_code(reply, ctx.entry_point) if ctx.is_code else reply.strip() or solution
        if r + 1 < rounds:
            verdict = await review_once(ctx, node, solution, temperature)
    return solution


OpFn = Callable[[OpContext, Node, list, float], Awaitable[Value]]

IMPLEMENTATIONS: dict[str, OpFn] = {
    "Custom": custom,
    "AnswerGenerate": answer_generate,
    "CustomCodeGenerate": custom_code_generate,
    "Programmer": programmer,
    "ScEnsemble": sc_ensemble,
    "MdEnsemble": md_ensemble,
    "Test": test,
    "Format": format_answer,
    "Review": review,
    "Revise": revise,
}
assert set(IMPLEMENTATIONS) == set(OPERATORS), "every registered operator needs an implementation"


async def run_node(ctx: OpContext, node: Node, args: list[tuple[str, Value]]) -> Value:
    """Run one node; a generator with ``samples: k > 1`` runs k times at once and yields the k candidates."""
    fn = IMPLEMENTATIONS[node.op]
    k = node.param("samples") or 1
    temperature = node.param("temperature")
    if k == 1:
        return await fn(ctx, node, args, float(temperature or 0.0))
    t = float(SAMPLE_TEMPERATURE if temperature is None else temperature)
    return list(await asyncio.gather(*(fn(ctx, node, args, t) for _ in range(k))))
