"""PARL reward components of a swarm episode, returned separately (Kimi K2.5 Agent Swarm).

The trainer combines them as ``lambda1 * r_parallel + lambda2 * r_finish + r_perf + format``
with lambda1, lambda2 annealed to 0 (``aflow_rl.algos.parl``); the environment
only measures:

- ``r_perf``: the task objective, ``item_f1 - latency_coef * critical_steps``
  (``metrics.task_objective``). With ``env.swarm.latency_coef = 0`` it is the
  item-level F1 of the final answer (1.0 exactly when pass@1). The latency cost
  sits in r_perf, not in an annealed term, so that once lambda reaches 0 the
  policy is still trained on the objective it is judged by: quality *and*
  Kimi K2.5's critical-steps latency.
- ``r_parallel``: the instantiation reward against *serial collapse*:
  ``min(productive subagents, width) / width``, where width is the most task
  items at one dependency depth and a subagent is productive once it has
  finished a subtask (1 for a task of width 1: a chain cannot collapse serially). It saturates at the useful width, so spawning more
  subagents than can work at once earns nothing extra, and idle subagents
  (spawned and never run, or given only failing work) earn nothing at all.
- ``r_finish``: against *spurious parallelism*: subtasks finished over the work
  instantiated, ``done / max(subtasks created, subagents spawned)`` (idle
  subagents and failed, skipped or cancelled subtasks lower it; 0 if nothing was spawned).
- ``format``: the sum of penalties, ``format_penalty`` per unparseable or invalid action.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aflow_rl.envs.swarm.metrics import subtask_finish_rate, task_objective
from aflow_rl.envs.swarm.tasks import item_f1, task_width

if TYPE_CHECKING:
    from aflow_rl.envs.swarm.runtime import SwarmRuntime


def r_perf(task: dict, answer: Any, critical_steps: float = 0.0, latency_coef: float = 0.0) -> float:
    return task_objective(item_f1(task, answer), critical_steps, latency_coef)


def r_parallel(spawned: int, width: int) -> float:
    """``spawned``: the subagents that count, i.e. the productive ones (see module docstring).

    A task of width 1 (a chain) has no parallelism to collapse: serial work is its best plan, so
    the term is 1 whatever the orchestrator does (constant within a group, it adds nothing to
    the advantage). Rewarding a chain's single subagent instead taught the policy to spawn on
    chains as well, at 12 critical steps where solving them itself takes 5.5 (docs/benchmarks.md)."""
    if width == 1:
        return 1.0
    return min(spawned, width) / width if width > 0 else 0.0


def r_finish(done: int, subtasks: int, spawned: int) -> float:
    return subtask_finish_rate(done, subtasks, spawned)


def format_reward(invalid_actions: int, format_penalty: float) -> float:
    return invalid_actions * format_penalty


def reward_components(task: dict, answer: Any, rt: "SwarmRuntime", *, invalid_actions: int,
                      format_penalty: float, latency_coef: float = 0.0,
                      critical_steps: float = 0.0) -> dict[str, float]:
    """``{"r_perf", "r_parallel", "r_finish", "format"}`` of one finished episode."""
    return {
        "r_perf": r_perf(task, answer, critical_steps, latency_coef),
        "r_parallel": r_parallel(rt.productive_subagents(), task_width(task["items"])),
        "r_finish": r_finish(rt.count("done"), len(rt.subtasks), len(rt.subagents)),
        "format": format_reward(invalid_actions, format_penalty),
    }
