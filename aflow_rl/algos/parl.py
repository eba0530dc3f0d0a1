"""PARL reward shaping with annealed auxiliary weights (Kimi K2.5 Agent Swarm).

Parallel-Agent RL trains the orchestrator on

    r = lambda1 * r_parallel + lambda2 * r_finish + r_perf (+ format)

where ``r_parallel`` rewards instantiating sub-agents (against serial
collapse), ``r_finish`` rewards sub-tasks that actually complete (against
spurious parallelism), and ``r_perf`` is the task outcome. The auxiliary
weights fall linearly to 0 so that the final policy optimises the task reward
alone (docs/architecture.md, Algorithms). ``format`` is the penalty for malformed
actions; it is never annealed.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np

if TYPE_CHECKING:
    from aflow_rl.config import ParlConfig
    from aflow_rl.rollout.types import Trajectory


def parl_lambdas(step: int, cfg: "ParlConfig") -> tuple[float, float]:
    """(lambda1, lambda2) at optimizer step ``step``.

    ``lambda_j(step) = lambda_j(0) * max(0, 1 - step / anneal_steps)``: the
    initial values at step 0, half of them at ``anneal_steps / 2``, 0 from
    ``anneal_steps`` on. ``anneal_steps = 0`` means 0 from the start.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if cfg.anneal_steps < 0:
        raise ValueError(f"algo.parl.anneal_steps must be >= 0, got {cfg.anneal_steps}")
    frac = max(0.0, 1.0 - step / cfg.anneal_steps) if cfg.anneal_steps > 0 else 0.0
    return float(cfg.lambda1) * frac, float(cfg.lambda2) * frac


def shaped_reward(components: Mapping[str, float], step: int, cfg: "ParlConfig") -> float:
    """``lambda1 * r_parallel + lambda2 * r_finish + r_perf + format`` at ``step``.

    Missing components count 0; other keys in ``components`` (diagnostics an
    environment may report) do not enter the reward.
    """
    lam1, lam2 = parl_lambdas(step, cfg)
    get = components.get
    return float(lam1 * float(get("r_parallel", 0.0)) + lam2 * float(get("r_finish", 0.0))
                 + float(get("r_perf", 0.0)) + float(get("format", 0.0)))


def shaped_rewards(trajectories: "Sequence[Trajectory]", step: int, cfg: "ParlConfig") -> np.ndarray:
    """``shaped_reward`` of each trajectory's ``reward_components``; returns [B] float64."""
    lam1, lam2 = parl_lambdas(step, cfg)
    # comp: [B, 4] columns r_parallel, r_finish, r_perf, format
    comp = np.array([[float(t.reward_components.get(k, 0.0))
                      for k in ("r_parallel", "r_finish", "r_perf", "format")]
                     for t in trajectories], dtype=np.float64).reshape(-1, 4)
    return comp @ np.array([lam1, lam2, 1.0, 1.0])
