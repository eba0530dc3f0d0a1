"""PARL reward components of a swarm episode, returned separately (Kimi K2.5 Agent Swarm).

The trainer combines them as ``lambda1 * r_parallel + lambda2 * r_finish + r_perf + format``
with lambda1, lambda2 annealed to 0 (``aflow_rl.algos.parl``); the environment
only measures:

- ``r_perf``: task quality, the item-level F1 of the final answer (1.0 exactly when pass@1).
- ``r_parallel``: the instantiation reward against *serial collapse*:
  ``min(spawned subagents, width) / width``, where width is the most task items
  at one dependency depth. It saturates at the useful width, so spawning more
  subagents than can work at once earns nothing extra.
- ``r_finish``: against *spurious parallelism*: subtasks finished over the work
  instantiated, ``done / max(subtasks created, subagents spawned)`` (idle
  subagents and failed, skipped or cancelled subtasks lower it; 0 if nothing was spawned).
- ``format``: the sum of penalties, ``format_penalty`` per unparseable or invalid action.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aflow_rl.envs.swarm.metrics import subtask_finish_rate
from aflow_rl.envs.swarm.tasks import item_f1, task_width

if TYPE_CHECKING:
    from aflow_rl.envs.swarm.runtime import SwarmRuntime


def r_perf(task: dict, answer: Any) -> float:
    return item_f1(task, answer)


def r_parallel(spawned: int, width: int) -> float:
    return min(spawned, width) / width if width > 0 else 0.0


def r_finish(done: int, subtasks: int, spawned: int) -> float:
    return subtask_finish_rate(done, subtasks, spawned)


def format_reward(invalid_actions: int, format_penalty: float) -> float:
    return invalid_actions * format_penalty


def reward_components(task: dict, answer: Any, rt: "SwarmRuntime", *, invalid_actions: int,
                      format_penalty: float) -> dict[str, float]:
    """``{"r_perf", "r_parallel", "r_finish", "format"}`` of one finished episode."""
    spawned = len(rt.subagents)
    return {
        "r_perf": r_perf(task, answer),
        "r_parallel": r_parallel(spawned, task_width(task["items"])),
        "r_finish": r_finish(rt.count("done"), len(rt.subtasks), spawned),
        "format": format_reward(invalid_actions, format_penalty),
    }
