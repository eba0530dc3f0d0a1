"""Evaluate a workflow on a batch of problems with the executor model.

    result = await evaluate(workflow, problems, executor=client, concurrency=8,
                            problem_timeout_s=60, max_tokens=512)
    result.score, result.cost.usd, result.failures

The workflow is validated first, so an invalid one raises ``WorkflowError``
before a single executor call. Problems then run at most ``concurrency`` at a
time (an ``asyncio.Semaphore``); each gets ``problem_timeout_s`` of wall clock
from when it starts (a timed-out problem scores 0 with error ``"timeout"``),
and an exception in one problem is recorded as its error without touching the
others. Tokens spent before a timeout or an error still count in the cost,
as AFlow's cost tracking counts every executor call.
"""
from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from aflow_rl.envs.aflow.graph import (DEFAULT_MAX_LOOP_ROUNDS, DEFAULT_MAX_NODES, DEFAULT_MAX_SAMPLES, PROBLEM,
                                       Workflow, execution_order, validate, workflow_hash)
from aflow_rl.envs.aflow.operators import OpContext, Value, run_node
from aflow_rl.envs.aflow.scoring import MODES as SCORING_MODES, score
from aflow_rl.llm.base import LLMClient

# USD per million tokens (input, output): list prices, an estimate for comparing workflows, not a bill.
# Unknown models (a local tiny or served model) are priced as gpt-4o-mini, AFlow's executor, so a
# workflow's cost reads on the same scale as the paper's.
PRICES_PER_MTOK: dict[str, tuple[float, float]] = {
    "gpt-4o-mini": (0.15, 0.60),
    "gpt-4o": (2.50, 10.00),
    "gpt-4.1-mini": (0.40, 1.60),
    "gpt-4.1": (2.00, 8.00),
    "claude-3-5-haiku": (0.80, 4.00),
    "claude-haiku-4-5": (1.00, 5.00),
    "claude-sonnet-4": (3.00, 15.00),
    "deepseek-chat": (0.27, 1.10),
}
DEFAULT_PRICE_MODEL = "gpt-4o-mini"


def price_for(model: str) -> tuple[float, float]:
    """(input, output) USD per million tokens of ``model``: exact name, else the longest known prefix."""
    name = (model or "").lower().rsplit("/", 1)[-1]
    if name in PRICES_PER_MTOK:
        return PRICES_PER_MTOK[name]
    prefixes = [k for k in PRICES_PER_MTOK if name.startswith(k)]
    return PRICES_PER_MTOK[max(prefixes, key=len) if prefixes else DEFAULT_PRICE_MODEL]


@dataclass
class ProblemResult:
    """One problem's outcome. ``error`` is empty, ``"timeout"``, or the exception text."""

    id: str
    score: float
    prediction: str
    error: str
    tokens_in: int
    tokens_out: int
    seconds: float
    calls: int = 0
    code_runs: int = 0

    @property
    def tokens(self) -> int:
        return self.tokens_in + self.tokens_out


@dataclass
class Cost:
    """Executor usage of one evaluation and its estimated price."""

    tokens_in: int = 0
    tokens_out: int = 0
    calls: int = 0
    code_runs: int = 0
    usd: float = 0.0


@dataclass
class EvalResult:
    """A workflow's evaluation: mean score, per-problem records, cost, time, failures for the optimizer."""

    score: float
    per_problem: list[ProblemResult]
    cost: Cost
    seconds: float
    failures: list[dict] = field(default_factory=list)  # id, question, prediction, expected, error, score
    workflow_hash: str = ""

    def to_dict(self) -> dict:
        """Plain JSON-able dict (what a worker sends back)."""
        return asdict(self)


async def run_workflow(workflow: Workflow, ctx: OpContext) -> str:
    """Execute a validated workflow on ``ctx.problem``; returns the output node's text.

    Each node is a task awaiting its inputs' tasks, so independent branches (e.g.
    k generators feeding an ensemble) run at once. Nodes the output does not
    depend on are not run."""
    tasks: dict[str, asyncio.Task] = {}

    async def node_task(node) -> Value:
        args = []
        for i in node.resolved_inputs():
            args.append((i, ctx.question if i == PROBLEM else await tasks[i]))
        return await run_node(ctx, node, args)

    try:
        async with asyncio.TaskGroup() as group:
            for node in execution_order(workflow):  # inputs first, so every awaited task exists
                tasks[node.id] = group.create_task(node_task(node))
    except BaseExceptionGroup as grouped:
        raise _first_leaf(grouped) from None  # report the operator's own error, not the group
    return str(tasks[workflow.output].result())


def _first_leaf(group: BaseExceptionGroup) -> BaseException:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


async def evaluate(workflow: Workflow, problems: list, *, executor: LLMClient, concurrency: int = 8,
                   problem_timeout_s: float = 60.0, max_tokens: int = 512,
                   scorer: Callable[[Any, str], float] | None = None, scoring_mode: str = "default",
                   max_nodes: int = DEFAULT_MAX_NODES, max_samples: int = DEFAULT_MAX_SAMPLES,
                   max_loop_rounds: int = DEFAULT_MAX_LOOP_ROUNDS, code_timeout_s: float = 10.0,
                   sandbox: Callable[..., Any] | None = None,
                   price: tuple[float, float] | None = None) -> EvalResult:
    """Score ``workflow`` on ``problems`` (``datasets.Problem``s) with the executor.

    ``scorer(problem, prediction) -> float`` (None: ``scoring.score`` in ``scoring_mode``, default or
    aflow, env.aflow.scoring) runs in a thread: code scorers block on the sandbox. ``price`` is (input,
    output) USD per million tokens; None looks the executor's model up in ``PRICES_PER_MTOK``.
    Raises WorkflowError, before any execution, when the workflow is invalid, and ValueError for an
    unknown scoring mode."""
    validate(workflow, max_nodes=max_nodes, max_samples=max_samples, max_loop_rounds=max_loop_rounds)
    if scorer is None:
        if scoring_mode not in SCORING_MODES:
            raise ValueError(f"unknown scoring mode {scoring_mode!r}: use one of {', '.join(SCORING_MODES)}")
        scorer = functools.partial(score, mode=scoring_mode)
    gate = asyncio.Semaphore(max(1, int(concurrency)))
    t0 = time.monotonic()

    async def one(problem) -> ProblemResult:
        async with gate:
            ctx = OpContext(executor=executor, problem=problem, max_tokens=max_tokens,
                            code_timeout_s=code_timeout_s, sandbox=sandbox)
            start = time.monotonic()
            prediction, error, value = "", "", 0.0
            try:
                prediction = await asyncio.wait_for(run_workflow(workflow, ctx), problem_timeout_s)
            except TimeoutError:
                error = "timeout"
            except Exception as exc:  # one problem's failure never ends the evaluation
                error = f"{type(exc).__name__}: {exc}"
            if not error:
                try:
                    value = float(await asyncio.to_thread(scorer, problem, prediction))
                except Exception as exc:
                    error = f"scorer {type(exc).__name__}: {exc}"
            return ProblemResult(id=str(problem.id), score=value, prediction=prediction, error=error,
                                 tokens_in=ctx.tokens_in, tokens_out=ctx.tokens_out,
                                 seconds=time.monotonic() - start, calls=len(ctx.calls), code_runs=ctx.code_runs)

    per_problem = list(await asyncio.gather(*(one(p) for p in problems)))
    p_in, p_out = price if price is not None else price_for(getattr(executor, "model", "") or "")
    cost = Cost(tokens_in=sum(r.tokens_in for r in per_problem), tokens_out=sum(r.tokens_out for r in per_problem),
                calls=sum(r.calls for r in per_problem), code_runs=sum(r.code_runs for r in per_problem))
    cost.usd = (cost.tokens_in * p_in + cost.tokens_out * p_out) / 1e6
    failures = [{"id": r.id, "question": str(p.question), "prediction": r.prediction, "expected": p.answer,
                 "error": r.error, "score": r.score}
                for p, r in zip(problems, per_problem) if r.score < 1.0]
    mean = sum(r.score for r in per_problem) / len(per_problem) if per_problem else 0.0
    return EvalResult(score=mean, per_problem=per_problem, cost=cost, seconds=time.monotonic() - t0,
                      failures=failures, workflow_hash=workflow_hash(workflow))
