"""Swarm environment: an orchestrator decomposes tasks for parallel subagents (Kimi K2.5 Agent Swarm / PARL).

Modules, in the order an episode uses them: ``kb`` and ``tools`` (the local
world and its tools), ``tasks`` (wide/deep/mixed generators, item scoring,
``make_tasks``), ``actions`` (the action JSON schema and parser),
``profiles`` and ``llm_subagents`` (the frozen subagent pool), ``runtime``
(task graph, waves, budgets), ``observation``, ``policies`` and ``baselines``,
``episode`` (the loop), ``metrics`` and ``rewards``. The worker entry points
are in ``workers.swarm``; Plan/Act is its own environment (``aflow_rl.envs.plan_act``).
"""
from aflow_rl.envs.swarm.metrics import critical_steps
from aflow_rl.envs.swarm.tasks import make_tasks

__all__ = ["critical_steps", "make_tasks"]
