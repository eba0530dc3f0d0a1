"""The swarm episode loop: observation -> policy action -> runtime, until finish or a budget ends it.

Each orchestrator turn is one main step. The action text is parsed; an
unparseable or invalid action (including one the state forbids, such as a
subtask whose dependency was never spawned) costs ``format_penalty`` on that
turn and the episode goes on. The episode ends on ``finish`` or when a budget
is spent (turns, tool calls, tokens, wall time); queued subtasks are then
cancelled and the answer given at ``finish`` (none otherwise) is scored.

The Trajectory carries the model's Turns (none for baselines), the PARL
components separately, ``final_reward = r_perf + format`` (unweighted: the
trainer adds the annealed ``lambda1 * r_parallel + lambda2 * r_finish``) and
the metrics of ``metrics.py``. Step rewards: each turn carries its own format
penalty and the last turn also ``r_perf``, so they sum to ``final_reward``.
An LLMError from the policy server propagates, so the pool retries the episode.
"""
from __future__ import annotations

import inspect
import time
from typing import Any

from aflow_rl.envs.swarm.actions import parse_action
from aflow_rl.envs.swarm.kb import build_kb
from aflow_rl.envs.swarm.metrics import episode_metrics
from aflow_rl.envs.swarm.observation import render
from aflow_rl.envs.swarm.decision import Policy
from aflow_rl.envs.swarm.profiles import SimulatedSubagents, SubagentExecutor
from aflow_rl.envs.swarm.rewards import reward_components
from aflow_rl.envs.swarm.runtime import Budgets, InvalidAction, SwarmRuntime
from aflow_rl.envs.swarm.tasks import stable_seed
from aflow_rl.envs.swarm.tools import call_tool
from aflow_rl.rollout.types import Trajectory, Turn

_MAX_ERRORS_KEPT = 8  # invalid-action messages kept in Trajectory.info


async def _trace(trace: Any, episode_id: str, **fields: Any) -> None:
    if trace is None:
        return
    out = trace.event(episode_id, **fields)
    if inspect.isawaitable(out):
        await out


def episode_seed(task: dict) -> int:
    """Seed of the subagents' luck: fixed by the task and the episode id, so a rerun is identical
    while the G episodes of one task group see different draws."""
    return stable_seed("swarm-episode", task["task_id"], task.get("seed", 0),
                       task.get("episode_id", task["task_id"]))


async def run_swarm_episode(task: dict, cfg: Any, policy: Policy, *, executor: SubagentExecutor | None = None,
                            trace: Any = None) -> Trajectory:
    """Run one swarm episode of ``task`` with ``policy``; ``cfg`` is the full Config.

    ``executor`` runs subagent attempts (default: simulated subagents over the
    task's knowledge base); ``trace`` is a TraceWriter-like object with
    ``event(episode_id, step=, observation=, action=, outcome=, reward=, timings=)``.
    """
    sw = cfg.env.swarm
    kb = build_kb(int(task.get("kb_seed", sw.kb_seed)))
    episode_id = str(task.get("episode_id", task["task_id"]))
    rt = SwarmRuntime(task["items"], Budgets.from_config(sw), executor or SimulatedSubagents(kb),
                      tools=lambda tool, args: call_tool(kb, tool, args), seed=episode_seed(task),
                      solve=sw.solve_action)
    policy.begin_episode(task)
    turns: list[Turn] = []
    errors: list[str] = []
    last: dict | None = None
    step = 0
    while rt.ended is None:
        obs = render(task, rt, mailbox=rt.drain_mailbox(), last=last, compact=sw.prompt in ("compact", "shape", "graph"),
                     shape=sw.prompt in ("shape", "graph"), graph=sw.prompt == "graph")
        t0 = time.perf_counter()
        decision = await policy.act(obs)
        t1 = time.perf_counter()
        rt.turn(decision.tokens_in, decision.tokens_out, decision.latency_ms)
        parsed = parse_action(decision.text)
        error, outcome = parsed.error, ""
        if parsed.ok:
            try:
                outcome = await rt.apply(parsed.action)
            except InvalidAction as exc:
                error = str(exc)
        penalty = sw.format_penalty if error else 0.0
        if error:
            errors.append(error)
        if decision.turn is not None:
            decision.turn.step_reward = penalty
            turns.append(decision.turn)
        rt.check_budgets()
        last = {"action": decision.text, "outcome": outcome, "error": error}
        await _trace(trace, episode_id, step=step, observation=obs.text, action=decision.text,
                     outcome={"text": outcome, "error": error or None, "ended": rt.ended,
                              "anchor_key": obs.anchor_key},
                     reward=penalty, timings={"policy_ms": 1000 * (t1 - t0),
                                              "runtime_ms": 1000 * (time.perf_counter() - t1),
                                              "clock_ms": rt.clock.now_ms})
        step += 1
    rt.close()

    answer = rt.answer
    if sw.auto_answer:
        # The orchestrator aggregates: what its subagents found is the answer, whatever
        # ended the episode; entries it wrote itself fill the items nobody solved.
        given = answer if isinstance(answer, dict) else {}
        answer = {**given, **rt.results()}
    metrics = episode_metrics(task, answer, rt)
    components = reward_components(task, answer, rt, invalid_actions=len(errors), format_penalty=sw.format_penalty,
                                   latency_coef=sw.latency_coef, critical_steps=metrics["critical_steps"])
    metrics["invalid_actions"] = float(len(errors))
    final_reward = components["r_perf"] + components["format"]
    if turns:
        turns[-1].step_reward += components["r_perf"]
    policy.end_episode(task, metrics, components)
    await _trace(trace, episode_id, step=step, observation="episode end", action="score",
                 outcome={"termination": rt.ended, "answer": answer, "components": components,
                          "item_f1": metrics["item_f1"], "critical_steps": metrics["critical_steps"]},
                 reward=final_reward, timings={"clock_ms": rt.clock.now_ms})
    return Trajectory(
        episode_id=episode_id, group_id=str(task.get("group_id", task["task_id"])),
        attempt=int(task.get("attempt", 1)), turns=turns, final_reward=final_reward,
        reward_components=components, metrics=metrics, status="ok",
        info={"task_id": task["task_id"], "suite": task.get("suite", ""), "mode": "swarm", "policy": policy.name,
              "termination": rt.ended, "answer": answer, "invalid_actions": len(errors),
              "errors": errors[:_MAX_ERRORS_KEPT]})
