"""Operators against a scripted executor, evaluation (concurrency, timeout, failures, cost), the worker,
and one workflow end to end on the embedded server with the tiny random model."""
import asyncio
import importlib.util
import inspect
import re

import pytest

from aflow_rl.envs.aflow.evaluator import PRICES_PER_MTOK, evaluate, price_for
from aflow_rl.envs.aflow.graph import Node, Workflow
from aflow_rl.envs.aflow.operators import OpContext, Review, extract_code, majority, run_node
from aflow_rl.llm.base import Completion
from tests.envs.aflow.fakes import Problem

HAS_SANDBOX = importlib.util.find_spec("aflow_rl.sandbox") is not None
HAS_DATASETS = importlib.util.find_spec("aflow_rl.envs.aflow.datasets") is not None


class ScriptedExecutor:
    """An LLMClient whose chat replies ``respond(prompt)`` (a string, or a coroutine for delays/errors).

    Tokens are counted as words; it tracks the calls in flight to check concurrency."""

    base_url = "fake://executor"
    model = ""

    def __init__(self, respond):
        self.respond = respond
        self.prompts: list[str] = []
        self.sampling: list[dict] = []
        self.in_flight = self.max_in_flight = 0

    async def chat(self, messages, *, return_logprob=False, **sampling):
        prompt = messages[-1]["content"]
        self.prompts.append(prompt)
        self.sampling.append(sampling)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            reply = self.respond(prompt)
            if inspect.isawaitable(reply):
                reply = await reply
        finally:
            self.in_flight -= 1
        return Completion(text=reply, prompt_tokens=len(prompt.split()), completion_tokens=len(reply.split()) + 1)

    async def generate(self, prompt=None, **kw):
        raise AssertionError("operators use chat")

    async def aclose(self):
        pass

    def count(self, marker: str) -> int:
        return sum(marker in p for p in self.prompts)


# Markers of this package's own prompts, used to route the scripted replies.
REVIEW, REVISE, SC, MD, FIX, PROGRAM, FORMAT, ANSWER = (
    "<verdict>", "Reviewer feedback", "most solutions agree on", "solves the question best", "fails its tests",
    "`solve()`", "State the final answer", "<answer></answer>")


def run_op(op, params, args, llm, problem=None, sandbox=None, tester=None):
    ctx = OpContext(executor=llm, problem=problem or Problem("p", "What is 6*7?", "42"), max_tokens=64,
                    sandbox=sandbox, tester=tester)
    value = asyncio.run(run_node(ctx, Node("n", op, params, [a[0] for a in args]), args))
    return value, ctx


# ---------------------------------------------------------------------------
# Operators
# ---------------------------------------------------------------------------


def test_custom_records_tokens():
    llm = ScriptedExecutor(lambda p: "forty two")
    value, ctx = run_op("Custom", {"instruction": "Be terse."}, [("problem", "What is 6*7?")], llm)
    assert value == "forty two"
    assert llm.prompts[0].startswith("Be terse.") and "What is 6*7?" in llm.prompts[0]
    assert llm.sampling[0] == {"max_new_tokens": 64, "temperature": 0.0}
    (call,) = ctx.calls
    assert call.node == "n" and call.op == "Custom" and call.tokens_in > 0 and call.tokens_out == 3
    assert ctx.tokens_in == call.tokens_in and ctx.tokens_out == 3


def test_answer_generate_parses_answer_with_fallback():
    llm = ScriptedExecutor(lambda p: "<thought>6 times 7</thought><answer> 42 </answer>")
    assert run_op("AnswerGenerate", {}, [("problem", "q")], llm)[0] == "42"
    llm = ScriptedExecutor(lambda p: "it is 42")
    assert run_op("AnswerGenerate", {}, [("problem", "q")], llm)[0] == "it is 42"


def test_custom_code_generate_extracts_the_entry_point():
    reply = ("Sure.\n```python\nimport math\n```\n```python\nimport math\n\ndef add(a, b):\n    return a + b\n```\n"
             "Example: add(1, 2)")
    problem = Problem("c", "def add(a, b):\n    '''Sum.'''", kind="code", metadata={"entry_point": "add"})
    code, _ = run_op("CustomCodeGenerate", {"instruction": "Write clean code."}, [("problem", problem.question)],
                     ScriptedExecutor(lambda p: reply), problem)
    assert code == "import math\n\ndef add(a, b):\n    return a + b"
    assert extract_code("def f():\n    return 1") == "def f():\n    return 1"
    assert extract_code("Here:\nimport os\nprint(1)") == "import os\nprint(1)"


def test_samples_give_k_candidates_at_sampling_temperature():
    seen = iter(["a", "b", "c"])
    llm = ScriptedExecutor(lambda p: next(seen))
    value, ctx = run_op("Custom", {"samples": 3}, [("problem", "q")], llm)
    assert sorted(value) == ["a", "b", "c"] and len(ctx.calls) == 3
    assert all(s["temperature"] == 0.8 for s in llm.sampling)


def majority_voter(prompt: str) -> str:
    """A faithful executor for ScEnsemble: counts the candidates' answers and names one of the majority."""
    blocks = re.findall(r"Solution ([A-Z]):\n(.*?)(?=\n\nSolution [A-Z]:|\n\nCompare)", prompt, re.DOTALL)
    answers = [b[1].strip().split()[-1] for b in blocks]
    best = max(set(answers), key=answers.count)
    return f"<thought>count</thought><letter>{blocks[answers.index(best)][0]}</letter>"


def test_sc_ensemble_picks_the_majority():
    cands = ["so the answer is 41", "the answer is 42", "I get 42", "maybe 40"]
    llm = ScriptedExecutor(majority_voter)
    value, ctx = run_op("ScEnsemble", {}, [("g", cands)], llm)
    assert value == "the answer is 42" and len(ctx.calls) == 1 and llm.count(SC) == 1
    # an unreadable choice falls back to a deterministic majority over normalized answers
    llm = ScriptedExecutor(lambda p: "I like all of them")
    votes = ["<answer>7</answer>", "<answer>5</answer>", "<answer> 5. </answer>"]
    assert run_op("ScEnsemble", {}, [("a", votes[0]), ("b", votes[1]), ("c", votes[2])], llm)[0] == votes[1]
    assert majority(["x", "y", "Y", "x"]) == 0
    # unanimous candidates need no model call
    llm = ScriptedExecutor(lambda p: "<letter>A</letter>")
    assert run_op("ScEnsemble", {}, [("g", ["42", " 42 "])], llm)[0] == "42" and not llm.prompts


def test_md_ensemble_votes_over_shuffles():
    def pick_42(prompt):
        letters = re.findall(r"Solution ([A-Z]):\n(.*?)(?=\n\nSolution|\n\nDecide)", prompt, re.DOTALL)
        return "<letter>" + next(letter for letter, text in letters if "42" in text) + "</letter>"

    cands = ["answer 41", "answer 42", "answer 43"]
    llm = ScriptedExecutor(pick_42)
    value, ctx = run_op("MdEnsemble", {"votes": 4}, [("g", cands)], llm)
    assert value == "answer 42" and len(ctx.calls) == 4
    orders = {tuple(re.findall(r"answer 4\d", p)) for p in llm.prompts}
    assert len(orders) > 1  # the candidates were shuffled between rounds
    llm = ScriptedExecutor(lambda p: "no idea")
    assert run_op("MdEnsemble", {"votes": 2}, [("g", ["x", "y", "y"])], llm)[0] == "y"


def test_review_verdicts():
    fail = ScriptedExecutor(lambda p: "<verdict>fail</verdict><feedback>6*7 is 42, not 41</feedback>")
    verdict, _ = run_op("Review", {}, [("a", "41")], fail)
    assert isinstance(verdict, Review) and not verdict.passed and verdict.feedback == "6*7 is 42, not 41"
    assert "fail" in str(verdict)
    unreadable = ScriptedExecutor(lambda p: "hmm")
    assert run_op("Review", {}, [("a", "41")], unreadable)[0].passed


def review_revise(max_rounds: int) -> Workflow:
    return Workflow(nodes=[Node("a", "AnswerGenerate", {}, ["problem"]), Node("r", "Review", {}, ["a"]),
                           Node("v", "Revise", {"max_rounds": max_rounds}, ["a", "r"])], output="v")


def scripted_loop(verdicts: list[str]):
    """Review replies come from ``verdicts`` in turn (then fail); each revision appends a prime."""
    state = {"reviews": 0, "revisions": 0}

    def respond(prompt):
        if REVIEW in prompt:
            state["reviews"] += 1
            v = verdicts[state["reviews"] - 1] if state["reviews"] <= len(verdicts) else "fail"
            return f"<verdict>{v}</verdict><feedback>check the product</feedback>"
        if REVISE in prompt:
            state["revisions"] += 1
            return "41" + "'" * state["revisions"]
        return "<answer>41</answer>"

    return ScriptedExecutor(respond), state


def exact(problem, prediction):
    return float(prediction.strip() == str(problem.answer))


@pytest.mark.parametrize("verdicts,max_rounds,revisions,reviews,out", [
    ([], 3, 3, 3, "41'''"),          # never passes: stops at max_rounds revisions
    (["pass"], 3, 0, 1, "41"),       # first review passes: no revision
    (["fail", "pass"], 3, 1, 2, "41'"),
    ([], 1, 1, 1, "41'"),            # AFlow's single review-then-revise
])
def test_review_revise_loop_is_bounded(verdicts, max_rounds, revisions, reviews, out):
    llm, state = scripted_loop(verdicts)
    result = asyncio.run(evaluate(review_revise(max_rounds), [Problem("p", "6*7?", "42")], executor=llm,
                                  scorer=exact))
    assert state == {"reviews": reviews, "revisions": revisions}
    assert result.per_problem[0].prediction == out and result.per_problem[0].calls == 1 + reviews + revisions


ADD_PROMPT = 'def add(a, b):\n    """Return a + b."""\n'
CODE_PROBLEM = Problem("add", ADD_PROMPT, kind="humaneval",
                       metadata={"entry_point": "add", "prompt": ADD_PROMPT,
                                 "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n"})


def fixer(fixed_on: int):
    """The fix request number ``fixed_on`` returns a correct solution; earlier ones stay wrong."""
    state = {"fixes": 0}

    def respond(prompt):
        assert FIX in prompt
        state["fixes"] += 1
        body = "a + b" if state["fixes"] >= fixed_on else "a - b"
        return f"The sign is wrong.\n```python\ndef add(a, b):\n    return {body}\n```"

    return ScriptedExecutor(respond), state


def fake_tester(problem, code, *, timeout_s=10):
    from types import SimpleNamespace

    ok = "return a + b" in code
    return SimpleNamespace(ok=ok, exit_code=0 if ok else 1, stdout="", stderr="" if ok else "AssertionError",
                           timed_out=False, error="" if ok else "exit code 1")


@pytest.mark.parametrize("fixed_on,max_fixes,fixes,runs,passes", [
    (2, 3, 2, 3, True),    # fixed by the second request, confirmed by the third run
    (9, 2, 2, 2, False),   # never fixed: stops after max_fixes requests
    (1, 0, 0, 0, False),   # max_fixes 0: the solution passes through
])
def test_test_then_fix(fixed_on, max_fixes, fixes, runs, passes):
    llm, state = fixer(fixed_on)
    wrong = "def add(a, b):\n    return a - b"
    value, ctx = run_op("Test", {"max_fixes": max_fixes}, [("c", wrong)], llm, CODE_PROBLEM, tester=fake_tester)
    assert state["fixes"] == fixes and ctx.code_runs == runs
    assert ("return a + b" in value) == passes


def test_test_passes_non_code_problems_through():
    llm = ScriptedExecutor(lambda p: "unused")
    value, ctx = run_op("Test", {}, [("a", "42")], llm, Problem("q", "6*7?", "42"), tester=fake_tester)
    assert value == "42" and not llm.prompts and ctx.code_runs == 0


@pytest.mark.skipif(not HAS_SANDBOX, reason="needs aflow_rl.sandbox")
def test_test_runs_in_the_real_sandbox():
    llm, state = fixer(1)
    value, ctx = run_op("Test", {"max_fixes": 2}, [("c", "```python\ndef add(a, b):\n    return a - b\n```")],
                        llm, CODE_PROBLEM)
    assert value == "def add(a, b):\n    return a + b" and state["fixes"] == 1 and ctx.code_runs == 2
    assert "AssertionError" in llm.prompts[0]  # the failing test's output reached the fixer


@pytest.mark.skipif(not HAS_SANDBOX, reason="needs aflow_rl.sandbox")
def test_programmer_runs_code_in_the_sandbox_and_retries():
    replies = iter(["```python\ndef solve():\n    return 6 * undefined_name\n```",
                    "```python\ndef solve():\n    return 6 * 7\n```"])
    llm = ScriptedExecutor(lambda p: next(replies))
    value, ctx = run_op("Programmer", {"attempts": 3}, [("problem", "What is 6*7?")], llm)
    assert value == "42" and ctx.code_runs == 2 and len(ctx.calls) == 2
    assert "NameError" in llm.prompts[1]  # the error was fed back
    llm = ScriptedExecutor(lambda p: "```python\nwhile True:\n    pass\n```")
    ctx = OpContext(executor=llm, problem=Problem("p", "q"), code_timeout_s=0.5)
    value = asyncio.run(run_node(ctx, Node("n", "Programmer", {"attempts": 1}, []), [("problem", "q")]))
    assert value.startswith("Code execution failed") and "timed out" in value


def test_format_extracts_code_without_the_model_and_asks_otherwise():
    llm = ScriptedExecutor(lambda p: "unused")
    value, _ = run_op("Format", {}, [("t", "Done:\n```python\ndef add(a, b):\n    return a + b\n```")], llm,
                      CODE_PROBLEM)
    assert value == "def add(a, b):\n    return a + b" and not llm.prompts
    llm = ScriptedExecutor(lambda p: "  42 \n")
    assert run_op("Format", {}, [("a", "6*7 = 42, so 42")], llm)[0] == "42" and llm.count(FORMAT) == 1


# ---------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------


def two_step() -> Workflow:
    return Workflow(nodes=[Node("a", "AnswerGenerate", {}, []), Node("f", "Format", {}, ["a"])], output="f")


def test_bounded_concurrency_and_cost():
    async def slow_answer(prompt):
        await asyncio.sleep(0.05)
        return "<answer>42</answer>" if ANSWER in prompt else "42"

    llm = ScriptedExecutor(slow_answer)
    problems = [Problem(f"p{i}", f"6*7? ({i})", "42" if i % 2 else "41") for i in range(6)]
    result = asyncio.run(evaluate(two_step(), problems, executor=llm, concurrency=2, scorer=exact))
    assert llm.max_in_flight == 2 and len(llm.prompts) == 12
    assert result.score == pytest.approx(0.5) and [r.id for r in result.per_problem] == [p.id for p in problems]
    assert all(r.calls == 2 and r.tokens_in > 0 and r.tokens_out > 0 and not r.error for r in result.per_problem)
    assert result.cost.tokens_in == sum(r.tokens_in for r in result.per_problem) and result.cost.calls == 12
    p_in, p_out = PRICES_PER_MTOK["gpt-4o-mini"]
    assert result.cost.usd == pytest.approx((result.cost.tokens_in * p_in + result.cost.tokens_out * p_out) / 1e6)
    assert [f["id"] for f in result.failures] == ["p0", "p2", "p4"]
    assert result.failures[0]["expected"] == "41" and result.failures[0]["prediction"] == "42"
    assert result.to_dict()["cost"]["usd"] > 0 and result.workflow_hash


def test_timeout_and_exception_stay_with_their_problem():
    async def respond(prompt):
        if "slow" in prompt and FORMAT in prompt:
            await asyncio.sleep(30)
        if "boom" in prompt:
            raise RuntimeError("executor exploded")
        return "<answer>42</answer>" if ANSWER in prompt else "42"

    llm = ScriptedExecutor(respond)
    problems = [Problem("ok1", "6*7?", "42"), Problem("slow", "slow 6*7?", "42"), Problem("boom", "boom?", "42"),
                Problem("ok2", "7*6?", "42")]
    result = asyncio.run(evaluate(two_step(), problems, executor=llm, concurrency=4, problem_timeout_s=0.5,
                                  scorer=exact))
    by_id = {r.id: r for r in result.per_problem}
    assert by_id["slow"].error == "timeout" and by_id["slow"].score == 0.0
    assert by_id["slow"].tokens_in > 0 and by_id["slow"].calls == 1  # the call before the hang is still paid for
    assert by_id["boom"].error == "RuntimeError: executor exploded" and by_id["boom"].score == 0.0
    assert by_id["ok1"].score == by_id["ok2"].score == 1.0 and not by_id["ok1"].error
    assert result.score == pytest.approx(0.5) and result.seconds < 5
    assert {f["id"]: f["error"] for f in result.failures} == {"slow": "timeout",
                                                              "boom": "RuntimeError: executor exploded"}


def test_scorer_error_is_recorded():
    def broken(problem, prediction):
        raise ValueError("no rule")

    llm = ScriptedExecutor(lambda p: "<answer>42</answer>")
    workflow = Workflow(nodes=[Node("a", "AnswerGenerate", {}, [])], output="a")
    result = asyncio.run(evaluate(workflow, [Problem("p", "q", "42")], executor=llm, scorer=broken))
    assert result.per_problem[0].error == "scorer ValueError: no rule" and result.score == 0.0


def test_unreferenced_nodes_do_not_run_and_branches_run_at_once():
    async def respond(prompt):
        await asyncio.sleep(0.05)
        if SC in prompt:
            return "<letter>A</letter>"
        return "<answer>42</answer>" if ANSWER in prompt else "41"  # x and y disagree: the ensemble asks

    llm = ScriptedExecutor(respond)
    workflow = Workflow(nodes=[Node("x", "AnswerGenerate", {}, []), Node("y", "Custom", {}, []),
                               Node("dead", "Custom", {"instruction": "never"}, []),
                               Node("e", "ScEnsemble", {}, ["x", "y"])], output="e")
    result = asyncio.run(evaluate(workflow, [Problem("p", "q", "42")], executor=llm, scorer=exact))
    assert result.per_problem[0].calls == 3 and not any("never" in p for p in llm.prompts)
    assert llm.max_in_flight == 2


def test_price_table():
    assert price_for("gpt-4o-2024-08-06") == PRICES_PER_MTOK["gpt-4o"]
    assert price_for("openai/gpt-4o-mini") == PRICES_PER_MTOK["gpt-4o-mini"]
    assert price_for("claude-sonnet-4-5") == PRICES_PER_MTOK["claude-sonnet-4"]
    assert price_for("") == price_for("/models/tiny") == PRICES_PER_MTOK["gpt-4o-mini"]


# ---------------------------------------------------------------------------
# Worker and the real embedded server
# ---------------------------------------------------------------------------


def _ctx(overrides, urls=None, run_dir=""):
    from aflow_rl.config import load_config
    from aflow_rl.rollout.types import WorkerContext

    return WorkerContext(config=load_config(None, overrides), urls=urls or {}, run_dir=run_dir)


@pytest.mark.skipif(not HAS_DATASETS, reason="needs aflow_rl.envs.aflow.datasets")
def test_worker_evaluate_task_valid_and_invalid():
    from workers import aflow as aflow_worker

    llm = ScriptedExecutor(lambda p: "<answer>42</answer>")
    ctx = _ctx(["env.name=aflow", "env.aflow.max_nodes=2"])
    ctx.state.update(actor_client=llm, aflow_ready=True)
    problems = [{"id": "p1", "question": "6*7?", "answer": "42", "kind": "gsm8k", "metadata": {}}]
    workflow = {"output": "a", "nodes": [{"id": "a", "op": "AnswerGenerate", "inputs": [], "params": {}}]}
    reply = asyncio.run(aflow_worker.evaluate_task({"workflow": workflow, "problems": problems}, ctx))
    assert reply["valid"] and reply["score"] == 1.0 and reply["cost"]["tokens_in"] > 0  # scored by gsm8k's rule
    too_big = {"output": "c", "nodes": [{"id": n, "op": "Custom", "inputs": [], "params": {}} for n in "abc"]}
    calls = len(llm.prompts)
    reply = asyncio.run(aflow_worker.evaluate_task({"workflow": too_big, "problems": problems}, ctx))
    assert not reply["valid"] and "3 nodes (at most 2)" in reply["error"] and len(llm.prompts) == calls
    reply = asyncio.run(aflow_worker.evaluate_task({"workflow": {"nodes": 1}, "problems": problems}, ctx))
    assert not reply["valid"] and "'output'" in reply["error"]


@pytest.mark.skipif(not HAS_DATASETS or importlib.util.find_spec("aflow_rl.serving.manager") is None,
                    reason="needs the datasets and ServerManager")
def test_three_operators_end_to_end_on_the_embedded_server(tiny_model_dir, tmp_path):
    """Through the worker, with the tiny random model and the datasets' scorers: AnswerGenerate -> Review ->
    Revise on GSM8K-style problems, and CustomCodeGenerate -> Test -> Format on a HumanEval problem (sandbox,
    fix request). Scores are ~0; the machinery is under test."""
    from dataclasses import asdict

    from aflow_rl.envs.aflow.datasets import load_dataset
    from aflow_rl.serving.manager import ServerManager
    from workers import aflow as aflow_worker

    overrides = ["env.name=aflow", "serving.policy.backend=none", "serving.actor.backend=embedded",
                 f"serving.actor.model_path={tiny_model_dir}", f"run.dir={tmp_path}",
                 "env.aflow.executor_max_tokens=12", "env.aflow.problem_timeout_s=60"]
    math = [{"id": f"p{i}", "kind": "gsm8k", "question": f"What is {i} + {i}?", "answer": str(2 * i),
             "metadata": {}} for i in range(3)]
    text_task = {"workflow": review_revise(2).to_dict(), "problems": math}
    code_task = {"workflow": {"output": "f", "nodes": [
        {"id": "c", "op": "CustomCodeGenerate", "inputs": [], "params": {"instruction": "Write it."}},
        {"id": "t", "op": "Test", "inputs": ["c"], "params": {"max_fixes": 1}},
        {"id": "f", "op": "Format", "inputs": ["t"], "params": {}}]},
        "problems": [asdict(p) for p in load_dataset("humaneval", num_problems=1)]}
    with ServerManager(_ctx(overrides).config.serving, str(tmp_path), roles=("actor",)) as servers:
        ctx = _ctx(overrides, servers.all_urls(), str(tmp_path))
        aflow_worker.init_worker(ctx)

        async def run():
            try:
                return await asyncio.gather(aflow_worker.evaluate_task(text_task, ctx),
                                            aflow_worker.evaluate_task(code_task, ctx))
            finally:
                await ctx.state["actor_client"].aclose()

        text, code = asyncio.run(run())
    assert text["valid"] and code["valid"]
    assert [r["id"] for r in text["per_problem"]] == ["p0", "p1", "p2"]
    for r in text["per_problem"]:
        assert not r["error"], r["error"]
        assert 2 <= r["calls"] <= 1 + 2 + 2 * 2 and r["tokens_in"] > 0 and r["tokens_out"] > 0 and r["seconds"] > 0
    assert 0.0 <= text["score"] <= 1.0 and len(text["failures"]) == 3 - round(3 * text["score"])
    assert text["cost"]["tokens_in"] > 0 and text["cost"]["tokens_out"] > 0 and text["cost"]["usd"] > 0
    (r,) = code["per_problem"]  # random code fails its tests once, one fix is requested; Format needs no call
    assert not r["error"] and r["calls"] == 2 and r["code_runs"] == 1 and code["score"] == 0.0, r
    assert code["failures"][0]["expected"] == code_task["problems"][0]["answer"]
