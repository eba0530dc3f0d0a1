"""Environments: ``swarm``, ``plan_act`` and ``aflow``, each behind a thin worker module in ``workers/``.

``load_env(env.name)`` is the one way to get an environment's contract functions
(``make_tasks``, ``init_worker``, ``run_episode``); see ``aflow_rl/envs/loader.py``.
"""
from aflow_rl.envs.loader import CONTRACT, ENVIRONMENTS, EnvModule, load_env

__all__ = ["CONTRACT", "ENVIRONMENTS", "EnvModule", "load_env"]
