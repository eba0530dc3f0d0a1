"""Per-episode metrics of the swarm environment (logged as ``episode/<name>``).

Critical steps are Kimi K2.5's latency measure for agent swarms: over the
stages of an episode, the orchestrator's steps plus the slowest subagent's,

    critical_steps = sum over stages of (S_main + max_i S_sub,i)      (max of none = 0)

so spawning ten subagents costs as much latency as the slowest of them, and a
single agent that does everything itself pays for every step.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Sequence

from aflow_rl.envs.swarm.tasks import item_f1, pass_at_1

if TYPE_CHECKING:
    from aflow_rl.envs.swarm.runtime import SwarmRuntime

METRICS = ("success", "item_f1", "critical_steps", "wall_clock_ms", "tokens_in", "tokens_out", "estimated_cost",
           "retry_count", "failure_rate", "skip_rate", "avg_parallelism", "spawn_count", "subtask_finish_rate",
           "solved_self")


def critical_steps(stages: Iterable[tuple[int, Sequence[int]]]) -> int:
    """``sum over stages of (S_main + max_i S_sub,i)``; stages are ``[(main_steps, [sub_steps, ...]), ...]``."""
    return int(sum(int(main) + max((int(s) for s in subs), default=0) for main, subs in stages))


def task_objective(item_f1: float, critical_steps: float, latency_coef: float) -> float:
    """The task objective every orchestrator is judged by: quality minus a latency cost,
    ``item_f1 - c * critical_steps`` (``c = env.swarm.latency_coef``)."""
    return float(item_f1) - float(latency_coef) * float(critical_steps)


def subtask_finish_rate(done: int, subtasks: int, spawned: int) -> float:
    """Finished subtasks over the work instantiated: subtasks created or subagents spawned, whichever is more.

    An idle subagent (spawned, never given a subtask) counts against the rate
    just like a subtask that failed; nothing spawned gives 0.
    """
    denom = max(subtasks, spawned)
    return done / denom if denom else 0.0


def episode_metrics(task: dict, answer: Any, rt: "SwarmRuntime") -> dict[str, float]:
    """Every metric of one finished episode (``rt`` already closed)."""
    span = critical_steps(rt.stages)
    n_sub = len(rt.subtasks)
    return {
        "success": pass_at_1(task, answer),
        "item_f1": item_f1(task, answer),
        "critical_steps": float(span),
        "wall_clock_ms": float(rt.clock.now_ms),
        "tokens_in": float(rt.tokens_in),
        "tokens_out": float(rt.tokens_out),
        "estimated_cost": float(rt.cost),
        "retry_count": float(rt.retry_count),
        "failure_rate": rt.count("failed") / n_sub if n_sub else 0.0,
        "skip_rate": rt.count("skipped") / n_sub if n_sub else 0.0,
        # work / span: how many agents were busy on average along the critical path (1.0 = serial).
        "avg_parallelism": (rt.steps + rt.sub_steps) / span if span else 0.0,
        "spawn_count": float(len(rt.subagents)),
        "subtask_finish_rate": subtask_finish_rate(rt.count("done"), n_sub, len(rt.subagents)),
        "solved_self": float(rt.solved_self),
        "steps": float(rt.steps),
        "tool_calls": float(rt.tool_calls),
        "subtasks": float(n_sub),
        "waves": float(rt.waves),
    }
