"""The Plan/Act episode (``env.name: plan_act``).

A large planner (the trained orchestrator, behind the policy endpoint) writes
a numbered plan; a small frozen actor (the actor endpoint) executes it step by
step, carrying the outputs of earlier steps, and ends with ``Answer: ...``.
The answer is scored by reasoning-gym's own scorer. The planner's one turn is
the only trainable turn of the episode.

The planner has ``plan_act.timeout_s`` to answer. When it does not, and
``plan_act.fallback_on_timeout`` is set, the actor solves the task alone: the
Trajectory then has no turns (nothing to train on) and records
``metrics["planner_fallback"] = 1`` and ``info["fallback"]``. Without the
fallback the episode ends with status ``timeout``.

    tasks = make_tasks(cfg, n=8, seed=0)               # aflow_rl.envs.plan_act.tasks
    traj = await run_plan_act_episode(tasks[0], ctx)   # ctx.state from workers.plan_act.init_worker
"""
from __future__ import annotations

import asyncio
import inspect
import re
import time
from dataclasses import dataclass
from typing import Any

from aflow_rl.envs.plan_act.tasks import score_answer
from aflow_rl.llm.base import Completion, LLMClient, LLMError
from aflow_rl.rollout.turns import generate_turn
from aflow_rl.rollout.types import Trajectory, Turn, WorkerContext

PLANNER_SYSTEM = (
    "You are the planner. A small executor model will solve the problem by following your plan. "
    "Write a short plan as numbered steps (1., 2., 3., ...), one action per step. "
    "Do not state the final answer yourself.")
ACTOR_SYSTEM = (
    "You are the executor. Carry out exactly the step you are given, using the results of earlier "
    "steps. Be brief and show the numbers you compute.")
ANSWER_INSTRUCTION = "End with a last line of the form 'Answer: <final answer>'."

# Earlier step outputs are fed back to the actor; their tails (where results sit)
# are kept so that a long-winded step cannot push the prompt past the actor's context.
_CARRY_CHARS = 800

_STEP_LINE = re.compile(r"^\s*(?:step\s*)?(\d{1,2})\s*[.):\-]\s*(.*\S)?\s*$", re.I)
_ANSWER_LINE = re.compile(r"(?:final\s+answer|answer)\s*(?::|=|\bis\b)\s*(.*\S)", re.I)
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


# ---------------------------------------------------------------------------
# Text: prompts, plan parsing, answer extraction
# ---------------------------------------------------------------------------


def planner_messages(question: str) -> list[dict]:
    """Chat messages of the planner's (trainable) turn."""
    return [{"role": "system", "content": PLANNER_SYSTEM},
            {"role": "user", "content": f"Problem:\n{question}\n\nWrite the numbered plan."}]


def parse_plan(plan: str, max_steps: int) -> list[str]:
    """Numbered steps of ``plan``; lines after a step belong to it.

    Steps past ``max_steps`` merge into the last one, so no instruction is
    dropped. Returns [] when the plan has no numbered step.
    """
    steps: list[str] = []
    for line in plan.splitlines():
        m = _STEP_LINE.match(line)
        if m:
            steps.append((m.group(2) or "").strip())
        elif steps and line.strip():
            steps[-1] = (steps[-1] + " " + line.strip()).strip()
    steps = [s for s in steps if s]
    if len(steps) > max_steps:
        steps = steps[:max_steps - 1] + [" ".join(steps[max_steps - 1:])]
    return steps


def _clean_answer(text: str) -> str:
    boxed = _BOXED.findall(text)
    if boxed:
        text = boxed[-1]
    # Markdown emphasis, math delimiters and a sentence-final period are not part
    # of the answer ("Answer: **42**." -> "42"); strip them in any order.
    prev = None
    while prev != text:
        prev, text = text, text.strip().strip("*`$").strip()
        if text.endswith("."):
            text = text[:-1]
    return text


def extract_answer(text: str) -> str | None:
    """The final answer in ``text``: the last ``Answer: ...`` (or ``\\boxed{}``),
    else the last non-empty line; None when the text is empty."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    for line in reversed(lines):
        m = _ANSWER_LINE.search(line)
        if m:
            return _clean_answer(m.group(1))
    if _BOXED.search(text):
        return _clean_answer(_BOXED.findall(text)[-1])
    return _clean_answer(lines[-1]) if lines else None


def _has_explicit_answer(text: str) -> bool:
    return bool(_BOXED.search(text)) or any(_ANSWER_LINE.search(ln) for ln in text.splitlines())


def _carried(outputs: list[str]) -> str:
    if not outputs:
        return "(none yet)"
    return "\n".join(f"Step {i + 1} result: {out[-_CARRY_CHARS:].strip()}" for i, out in enumerate(outputs))


def actor_step_messages(question: str, steps: list[str], k: int, outputs: list[str]) -> list[dict]:
    """The actor's prompt for step ``k`` (0-based) of ``steps``, with earlier outputs."""
    plan = "\n".join(f"{i + 1}. {s}" for i, s in enumerate(steps))
    last = ANSWER_INSTRUCTION if k == len(steps) - 1 else "Do only this step."
    user = (f"Problem:\n{question}\n\nPlan:\n{plan}\n\nEarlier results:\n{_carried(outputs)}\n\n"
            f"Now do step {k + 1}: {steps[k]}\n{last}")
    return [{"role": "system", "content": ACTOR_SYSTEM}, {"role": "user", "content": user}]


def solo_messages(question: str) -> list[dict]:
    """The actor's prompt when it solves the task alone (planner fallback)."""
    return [{"role": "system", "content": "Solve the problem. Be brief."},
            {"role": "user", "content": f"Problem:\n{question}\n\n{ANSWER_INSTRUCTION}"}]


def final_answer_messages(question: str, outputs: list[str]) -> list[dict]:
    """One more actor prompt when the last step gave no explicit answer."""
    return [{"role": "system", "content": ACTOR_SYSTEM},
            {"role": "user", "content": f"Problem:\n{question}\n\nResults:\n{_carried(outputs)}\n\n"
                                        "Reply with one line: 'Answer: <final answer>'."}]


# ---------------------------------------------------------------------------
# The episode
# ---------------------------------------------------------------------------


@dataclass
class _Tally:
    """Counters and the trace step of one episode."""

    episode_id: str
    trace: Any = None
    step: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    actor_steps: int = 0

    async def event(self, **fields: Any) -> None:
        """Append one trace event (no-op without a TraceWriter) and advance the step."""
        if self.trace is not None:
            out = self.trace.event(self.episode_id, step=self.step, **fields)
            if inspect.isawaitable(out):
                await out
        self.step += 1


async def _actor_call(actor: LLMClient, messages: list[dict], pa: Any, tally: _Tally,
                      observation: str) -> str:
    """One frozen-actor generation, counted and traced."""
    t0 = time.perf_counter()
    comp: Completion = await actor.chat(messages, max_new_tokens=pa.max_act_tokens,
                                        temperature=pa.actor_temperature)
    tally.actor_steps += 1
    tally.tokens_in += comp.prompt_tokens
    tally.tokens_out += comp.completion_tokens
    await tally.event(observation=observation, action=comp.text,
                      outcome={"role": "actor", "finish_reason": comp.finish_reason},
                      reward=0.0, timings={"latency_ms": 1000 * (time.perf_counter() - t0)})
    return comp.text


async def _execute(actor: LLMClient, question: str, steps: list[str], pa: Any, tally: _Tally) -> str | None:
    """Run the plan step by step on the actor; return the extracted final answer."""
    outputs: list[str] = []
    if steps:
        for k, step in enumerate(steps):
            text = await _actor_call(actor, actor_step_messages(question, steps, k, outputs), pa, tally,
                                     observation=f"step {k + 1}: {step}")
            outputs.append(text)
    else:
        outputs.append(await _actor_call(actor, solo_messages(question), pa, tally, observation=question))
    if _has_explicit_answer(outputs[-1]):
        return extract_answer(outputs[-1])
    # The actor skipped the answer line: ask for it once, then fall back to its last line.
    text = await _actor_call(actor, final_answer_messages(question, outputs), pa, tally,
                             observation="final answer")
    return extract_answer(text) or extract_answer(outputs[-1])


def _resolve(ctx: WorkerContext, key: str, given: Any) -> Any:
    if given is not None:
        return given
    if key not in ctx.state:
        raise KeyError(f"plan_act needs ctx.state[{key!r}] (workers.plan_act.init_worker sets it) "
                       f"or the {key} argument")
    return ctx.state[key]


@dataclass
class _Plan:
    """The planner's outcome: its text and Turn, or why there is none."""

    text: str = ""
    turn: Turn | None = None
    fallback: str = ""        # "" | planner_timeout | planner_error
    reason: str = ""
    latency_ms: float = 0.0


async def _plan(task: dict, ctx: WorkerContext, policy: LLMClient, tokenizer: Any) -> _Plan:
    """The planner's trainable turn, bounded by ``plan_act.timeout_s``."""
    pa = ctx.config.env.plan_act
    t0 = time.perf_counter()
    out = _Plan()
    try:
        comp, out.turn = await asyncio.wait_for(
            generate_turn(policy, tokenizer, planner_messages(task["question"]),
                          temperature=ctx.config.env.temperature, max_new_tokens=pa.max_plan_tokens,
                          anchor_key=f"plan_act/{task['task_id']}/plan"),
            timeout=pa.timeout_s)
        out.text = comp.text
    except asyncio.TimeoutError:
        out.fallback, out.reason = "planner_timeout", f"planner gave no plan within {pa.timeout_s:g} s"
    except LLMError as exc:
        if not pa.fallback_on_timeout:
            raise
        # An unreachable planner is a planner that does not answer: same fallback, own label.
        out.fallback, out.reason = "planner_error", f"planner failed: {exc}"
    out.latency_ms = 1000 * (time.perf_counter() - t0)
    return out


async def run_plan_act_episode(task: dict, ctx: WorkerContext, *, policy_client: LLMClient | None = None,
                               actor_client: LLMClient | None = None, tokenizer: Any = None,
                               trace: Any = None) -> Trajectory:
    """One Plan/Act episode: planner turn (timed), actor execution, reasoning-gym score.

    Clients, tokenizer and trace writer come from ``ctx.state`` (keys
    ``policy_client``, ``actor_client``, ``tokenizer``, ``trace``) unless given
    explicitly. A planner that raises LLMError is treated like one that timed
    out when the fallback is on; actor errors propagate so the pool retries.
    """
    pa = ctx.config.env.plan_act
    actor = _resolve(ctx, "actor_client", actor_client)
    policy = _resolve(ctx, "policy_client", policy_client)
    tokenizer = _resolve(ctx, "tokenizer", tokenizer)
    episode_id = str(task.get("episode_id", task["task_id"]))
    tally = _Tally(episode_id=episode_id, trace=trace if trace is not None else ctx.state.get("trace"))
    t_start = time.perf_counter()

    plan = await _plan(task, ctx, policy, tokenizer)
    if plan.turn is not None:
        tally.tokens_in += len(plan.turn.prompt_ids)
        tally.tokens_out += len(plan.turn.response_ids)
    await tally.event(observation=task["question"], action=plan.text,
                      outcome={"role": "planner", "fallback": plan.fallback or None,
                               "finish_reason": plan.turn.finish_reason if plan.turn else None},
                      reward=0.0, timings={"latency_ms": plan.latency_ms})

    traj = Trajectory(episode_id=episode_id, group_id=str(task.get("group_id", task["task_id"])),
                      attempt=int(task.get("attempt", 1)), reward_components=_components(0.0, 0.0),
                      info={"task_id": task["task_id"], "dataset": task["dataset"],
                            "expected": task["answer"], "plan": plan.text})
    if plan.fallback == "planner_timeout" and not pa.fallback_on_timeout:
        traj.status, traj.error = "timeout", plan.reason
        traj.metrics = _metrics(tally, success=0.0, plan=plan, plan_steps=0,
                                wall_ms=1000 * (time.perf_counter() - t_start))
        return traj

    steps = parse_plan(plan.text, pa.max_steps)
    fmt = pa.format_penalty if (plan.turn is not None and not steps) else 0.0
    # An unnumbered but non-empty plan is still the planner's guidance: run it as one step.
    to_run = steps or ([plan.text.strip()] if plan.text.strip() else [])
    answer = await _execute(actor, task["question"], to_run, pa, tally)
    r_perf = score_answer(task, answer)
    await tally.event(observation=answer, action="score",
                      outcome={"expected": task["answer"], "r_perf": r_perf, "format": fmt},
                      reward=r_perf + fmt, timings={"episode_ms": 1000 * (time.perf_counter() - t_start)})

    traj.reward_components = _components(r_perf, fmt)
    traj.final_reward = r_perf + fmt
    if plan.turn is not None:
        # step_reward stays 0: the trainer adds the terminal (PARL-shaped) reward from
        # reward_components itself (algos.advantages.from_trajectories), so no double count.
        traj.turns = [plan.turn]
    if plan.fallback:
        traj.info.update(fallback=plan.fallback, fallback_reason=plan.reason)
    traj.info["answer"] = answer
    traj.metrics = _metrics(tally, success=float(r_perf >= 1.0), plan=plan, plan_steps=len(steps),
                            wall_ms=1000 * (time.perf_counter() - t_start))
    return traj


def _components(r_perf: float, fmt: float) -> dict[str, float]:
    # r_parallel and r_finish are 0 so the trainer's PARL shaping treats plan_act like swarm episodes.
    return {"r_perf": r_perf, "r_parallel": 0.0, "r_finish": 0.0, "format": fmt}


def _metrics(tally: _Tally, *, success: float, plan: _Plan, plan_steps: int, wall_ms: float) -> dict[str, float]:
    return {
        "success": success,
        "planner_latency_ms": plan.latency_ms,
        "actor_steps": float(tally.actor_steps),
        "plan_steps": float(plan_steps),
        # Plan/Act is serial: the planner's turn (if it answered) plus every actor call.
        "critical_steps": float(tally.actor_steps + (plan.turn is not None)),
        "tokens_in": float(tally.tokens_in),
        "tokens_out": float(tally.tokens_out),
        "wall_clock_ms": wall_ms,
        "planner_fallback": float(bool(plan.fallback) and tally.actor_steps > 0),
    }
